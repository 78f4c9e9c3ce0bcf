"""Each API key's prefix cache namespace (security review L4).

The nodes' prefix caches and the router's index are shared by every request of a model, so a key
whose prompt is served from them learns (`usage.prompt_tokens_details.cached_tokens`, or a
shorter time to first token) that some request sent the same prefix before, 64 tokens at a time.
Unless the admin shares the cache across keys (Settings), every API request therefore carries
its key's cache salt (tandem_protocol/prefix.py): pages cached for one key are found by that key
alone. The salt is an HMAC of the key's stored digest under a secret the panel keeps in its
settings: neither the key nor anything a client can compute, the same at every start, and a new
key never gets a revoked key's salt (SQLite may give it the old key's id, never its digest).
The panel's own requests (the Playground, calibrations) carry none.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from sqlalchemy import Engine

from .db import get_setting, set_setting
from .models import ApiKey

SECRET_SETTING = "prefix_cache_salt_secret"
SHARED_SETTING = "share_prefix_cache"  # "1": every key's requests share one cache, unsalted


@dataclass
class CacheSalts:
    secret: bytes
    shared: bool = False

    def of(self, key: ApiKey) -> str | None:
        """The cache salt of `key`'s requests: None while the cache is shared across keys."""
        if self.shared:
            return None
        return hmac.new(self.secret, key.key_hash.encode(), hashlib.sha256).hexdigest()


def load_cache_salts(engine: Engine) -> CacheSalts:
    """The panel's salts: the secret made on first use and kept, and the admin's setting."""
    secret = get_setting(engine, SECRET_SETTING)
    if not secret:
        secret = secrets.token_hex(32)
        set_setting(engine, SECRET_SETTING, secret)
    return CacheSalts(bytes.fromhex(secret), get_setting(engine, SHARED_SETTING) == "1")


def set_shared(engine: Engine, salts: CacheSalts, shared: bool) -> None:
    """Share the prefix cache across keys, or not, from the next request on."""
    set_setting(engine, SHARED_SETTING, "1" if shared else "0")
    salts.shared = shared
