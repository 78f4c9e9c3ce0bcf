"""POST /v1/tokenize: chat messages or text to token ids, with this node's tokenizer."""

from __future__ import annotations

from fastapi import APIRouter

from tandem_protocol.api import TokenizeAnswer, TokenizeBody
from tandem_protocol.errors import RequestError

from ..deps import KEYED, Slot

router = APIRouter(dependencies=KEYED)


@router.post("/v1/tokenize")
async def tokenize(body: TokenizeBody, slot: Slot) -> TokenizeAnswer:
    if (body.messages is None) == (body.prompt is None):
        raise RequestError("give exactly one of `messages` (chat) or `prompt` (plain text)")
    try:
        if body.messages is not None:
            ids = slot.adapter.chat_token_ids(body.messages)
        else:
            ids = slot.adapter.encode(body.prompt)
    except Exception as e:  # template errors name the problem
        raise RequestError(f"cannot tokenize: {e}") from e
    return TokenizeAnswer(token_ids=ids)
