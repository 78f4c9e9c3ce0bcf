"""The cluster key check both servers make."""

from __future__ import annotations

import hmac


def key_matches(presented: str | None, key: str) -> bool:
    """Constant-time comparison, so response timing reveals nothing about the key."""
    return presented is not None and hmac.compare_digest(presented.encode(), key.encode())
