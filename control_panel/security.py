"""Credentials: the admin password (argon2), API keys (stored as SHA-256), the cluster key."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from argon2 import PasswordHasher
from argon2.exceptions import VerificationError
from sqlalchemy import Engine
from sqlmodel import Session, select

from .db import cached_until_state_changes, get_setting, set_setting
from .models import ApiKey

_hasher = PasswordHasher()


def ensure_admin_password(engine: Engine) -> str | None:
    """Generate the admin password on first start; return it once (None if it already existed)."""
    if get_setting(engine, "admin_password_hash"):
        return None
    password = secrets.token_urlsafe(12)
    set_setting(engine, "admin_password_hash", _hasher.hash(password))
    return password


def check_admin_password(engine: Engine, password: str) -> bool:
    stored = get_setting(engine, "admin_password_hash")
    try:
        return bool(stored) and _hasher.verify(stored, password)
    except VerificationError:
        return False


def _digest(key: str) -> str:
    # API keys are 256-bit random strings: a fast hash is enough (nothing to brute-force).
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(engine: Engine, name: str) -> str:
    key = "tsk_" + secrets.token_urlsafe(32)
    with Session(engine) as s:
        s.add(ApiKey(name=name, prefix=key[:10], key_hash=_digest(key)))
        s.commit()
    return key


def api_key_valid(engine: Engine, presented: str | None) -> bool:
    if not presented:
        return False
    digest = _digest(presented)
    found = _stored_digest(engine, digest)
    return found is not None and hmac.compare_digest(found, digest)


@cached_until_state_changes
def _stored_digest(engine: Engine, digest: str) -> str | None:
    with Session(engine) as s:
        return s.exec(select(ApiKey.key_hash).where(ApiKey.key_hash == digest)).first()


def set_admin_password(engine: Engine, password: str) -> None:
    """Replace the admin password (stored hashed); sessions signed for the old one stop working."""
    set_setting(engine, "admin_password_hash", _hasher.hash(password))


def admin_password_version(engine: Engine) -> str:
    """A short tag of the current password hash: a session carries it, so a password change logs everyone out."""
    return hashlib.sha256((get_setting(engine, "admin_password_hash") or "").encode()).hexdigest()[:16]


def ui_session_secret(engine: Engine) -> str:
    """The secret that signs the web UI's session cookies, made on first use and kept in the settings."""
    secret = get_setting(engine, "ui_session_secret")
    if not secret:
        secret = secrets.token_urlsafe(32)
        set_setting(engine, "ui_session_secret", secret)
    return secret
