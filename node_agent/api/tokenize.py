"""POST /v1/tokenize: chat messages or text to token ids, with this node's tokenizer."""

from __future__ import annotations

from fastapi import APIRouter

from tandem_protocol.api import TokenizeAnswer, TokenizeBody
from tandem_protocol.errors import RequestError
from tandem_protocol.reasoning import opens_reasoning

from ..deps import KEYED, Slot

router = APIRouter(dependencies=KEYED)


@router.post("/v1/tokenize")
async def tokenize(body: TokenizeBody, slot: Slot) -> TokenizeAnswer:
    if (body.messages is None) == (body.prompt is None):
        raise RequestError("give exactly one of `messages` (chat) or `prompt` (plain text)")
    try:
        if body.prompt is not None:
            return TokenizeAnswer(token_ids=slot.adapter.encode(body.prompt))
        text = slot.adapter.chat_prompt(body.messages, body.tools, body.chat_template_kwargs)
        return TokenizeAnswer(token_ids=slot.adapter.encode(text), reasoning=opens_reasoning(text))
    except Exception as e:  # template errors name the problem
        raise RequestError(f"cannot tokenize: {e}") from e
