"""Responses API answers kept in SQLite for a bounded time (`KEEP_SECONDS`, OpenAI's 30 days), so
a request can continue a conversation by `previous_response_id` instead of resending it. What is
kept is the conversation as chat messages, and the response object for GET /v1/responses/{id}.

Each kept answer belongs to the API key that made it: for any other key it does not exist (the
same None as an unknown id, so the API's 404 tells nothing), and revoking the key deletes it
(`security.revoke_api_key`). The store is bounded in bytes, per key (`KEY_BYTES`) and in all
(`TOTAL_BYTES`): a new answer past a cap evicts the oldest answers, the key's own for its cap,
anyone's for the total, as expiry would have, rather than refusing `store: true`. A client loses
the oldest conversations it could have continued, never the one it is in; one that continues an
evicted one is told 404, as for an expired one, and resends its input. Expired rows are deleted
whenever a new one is written."""

from __future__ import annotations

import json
import threading
import time

from sqlalchemy import Engine, delete, func
from sqlmodel import Session, col, select

from .models import ApiKey, StoredResponse

KEEP_SECONDS = 30 * 86400
# A long agent session keeps its whole conversation again at each turn: a 100-turn session of
# 100k-token turns is about 20 MiB. The caps leave room for many such, and bound the disk.
KEY_BYTES = 256 << 20
TOTAL_BYTES = 1 << 30

# One save at a time in this process: each one's sums and evictions see the one before it.
_SAVING = threading.Lock()


def save(engine: Engine, key_id: int, response: dict, conversation: list[dict]) -> None:
    """Keep `response` and its conversation for `key_id`, evicting the oldest past the caps. Nothing
    is kept when the key is gone: a request still running while its key was revoked."""
    kept = StoredResponse(
        id=response["id"],
        key_id=key_id,
        expires=0.0,
        conversation=json.dumps(conversation),
        response=json.dumps(response),
    )
    kept.size = len(kept.conversation.encode()) + len(kept.response.encode())
    with _SAVING, Session(engine) as s:
        now = time.time()
        kept.created, kept.expires = now, now + KEEP_SECONDS
        # the first statement writes, so the transaction holds SQLite's write lock from here on:
        # a revocation commits wholly before it (the key is gone below) or after it (deleting this row)
        s.exec(delete(StoredResponse).where(col(StoredResponse.expires) < now))
        if s.get(ApiKey, key_id) is None:
            s.rollback()
            return
        _evict(s, KEY_BYTES - kept.size, StoredResponse.key_id == key_id)
        _evict(s, TOTAL_BYTES - kept.size)
        s.add(kept)
        s.commit()


def _evict(s: Session, room: int, *where) -> None:
    """Delete the oldest rows matching `where` until they hold at most `room` bytes together."""
    over = (s.exec(select(func.coalesce(func.sum(StoredResponse.size), 0)).where(*where)).one()) - room
    if over <= 0:
        return
    # `expires` is `created` plus a constant, and indexed
    oldest = s.exec(select(StoredResponse.id, StoredResponse.size).where(*where).order_by(StoredResponse.expires))
    doomed = []
    for rid, size in oldest:
        if over <= 0:
            break
        doomed.append(rid)
        over -= size
    s.exec(delete(StoredResponse).where(col(StoredResponse.id).in_(doomed)))


def _live(s: Session, key_id: int, response_id: str) -> StoredResponse | None:
    """The key's own unexpired row; another key's is None, as an unknown id is."""
    row = s.get(StoredResponse, response_id)
    return row if row is not None and row.key_id == key_id and row.expires >= time.time() else None


def conversation(engine: Engine, key_id: int, response_id: str) -> list[dict] | None:
    """The messages of the key's kept response's conversation; None when it is unknown, expired
    or another key's."""
    with Session(engine) as s:
        row = _live(s, key_id, response_id)
        return None if row is None else json.loads(row.conversation)


def response(engine: Engine, key_id: int, response_id: str) -> dict | None:
    with Session(engine) as s:
        row = _live(s, key_id, response_id)
        return None if row is None else json.loads(row.response)


def forget(engine: Engine, key_id: int, response_id: str) -> bool:
    with Session(engine) as s:
        row = _live(s, key_id, response_id)
        if row is None:
            return False
        s.delete(row)
        s.commit()
        return True


def forget_key(s: Session, key_id: int) -> None:
    """Delete every response the key made, in the caller's transaction (its revocation's)."""
    s.exec(delete(StoredResponse).where(StoredResponse.key_id == key_id))
