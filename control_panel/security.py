"""Credentials: the admin password (argon2), API keys (stored as SHA-256), the cluster key."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets

from argon2 import PasswordHasher
from argon2.exceptions import VerificationError
from sqlalchemy import Engine
from sqlmodel import Session, select

from . import response_store
from .db import cached_until_state_changes, get_setting, set_setting
from .models import ApiKey

_hasher = PasswordHasher()
# An argon2 hash or verify takes ~64 MiB and ~0.1 s of a core: two at once at most, in threads, so
# a burst of logins neither stalls the event loop nor takes the memory of many.
_ARGON2_AT_ONCE = asyncio.Semaphore(2)


async def off_loop_argon2(fn, *args):
    """`fn(*args)` (something that hashes or verifies a password) in a thread, two at most at once."""
    async with _ARGON2_AT_ONCE:
        return await asyncio.to_thread(fn, *args)


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


def set_key_limits(engine: Engine, key_id: int, max_concurrent: int | None, tokens_per_minute: int | None) -> None:
    """A key's limits (None: none), applied from the key's next request on."""
    with Session(engine) as s:
        key = s.get(ApiKey, key_id)
        if key is not None:
            key.max_concurrent, key.tokens_per_minute = max_concurrent, tokens_per_minute
            s.add(key)
            s.commit()


def revoke_api_key(engine: Engine, key_id: int) -> None:
    """Delete a key and, in the same transaction, the responses it stored: what its holder kept
    goes with the key, and no later key given the same id (SQLite reuses a deleted row's id)
    finds it."""
    with Session(engine) as s:
        response_store.forget_key(s, key_id)
        key = s.get(ApiKey, key_id)
        if key is not None:
            s.delete(key)
        s.commit()


def revoke_api_keys_named(engine: Engine, name: str, prefix: str | None = None) -> None:
    """Revoke every key named `name` (or whose name starts with `prefix`)."""
    with Session(engine) as s:
        keys = s.exec(select(ApiKey)).all()
        ids = [k.id for k in keys if k.name == name or (prefix is not None and k.name.startswith(prefix))]
    for key_id in ids:
        revoke_api_key(engine, key_id)


def api_key_valid(engine: Engine, presented: str | None) -> bool:
    return presented_key(engine, presented) is not None


def presented_key(engine: Engine, presented: str | None) -> ApiKey | None:
    """The stored key (with its limits) a client presented, or None if there is none such."""
    if not presented:
        return None
    digest = _digest(presented)
    found = _stored_key(engine, digest)
    return found if found is not None and hmac.compare_digest(found.key_hash, digest) else None


@cached_until_state_changes
def _stored_key(engine: Engine, digest: str) -> ApiKey | None:
    with Session(engine) as s:
        return s.exec(select(ApiKey).where(ApiKey.key_hash == digest)).first()  # detached as it closes


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
