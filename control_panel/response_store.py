"""Responses API answers kept in SQLite for a bounded time (`KEEP_SECONDS`, OpenAI's 30 days), so
a request can continue a conversation by `previous_response_id` instead of resending it. What is
kept is the conversation as chat messages, and the response object for GET /v1/responses/{id}.
Expired rows are deleted whenever a new one is written."""

from __future__ import annotations

import json
import time

from sqlalchemy import Engine, delete
from sqlmodel import Session

from .models import StoredResponse

KEEP_SECONDS = 30 * 86400


def save(engine: Engine, response: dict, conversation: list[dict]) -> None:
    now = time.time()
    with Session(engine) as s:
        s.exec(delete(StoredResponse).where(StoredResponse.expires < now))
        s.merge(
            StoredResponse(
                id=response["id"],
                created=now,
                expires=now + KEEP_SECONDS,
                conversation=json.dumps(conversation),
                response=json.dumps(response),
            )
        )
        s.commit()


def _live(s: Session, response_id: str) -> StoredResponse | None:
    row = s.get(StoredResponse, response_id)
    return row if row is not None and row.expires >= time.time() else None


def conversation(engine: Engine, response_id: str) -> list[dict] | None:
    """The messages of a kept response's conversation; None when it is unknown or expired."""
    with Session(engine) as s:
        row = _live(s, response_id)
        return None if row is None else json.loads(row.conversation)


def response(engine: Engine, response_id: str) -> dict | None:
    with Session(engine) as s:
        row = _live(s, response_id)
        return None if row is None else json.loads(row.response)


def forget(engine: Engine, response_id: str) -> bool:
    with Session(engine) as s:
        row = _live(s, response_id)
        if row is None:
            return False
        s.delete(row)
        s.commit()
        return True
