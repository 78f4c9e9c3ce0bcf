"""POST /v1/tokenize: chat messages or text to token ids, with this node's tokenizer.

The body is at most the agent's MAX_BODY_BYTES (8 MiB, refused before it is read), its template
switches only those tandem_protocol/template_switches.py allows (TokenizeBody: a 400 naming the
key); the render and the encoding run on the engine's tokenizer thread, bounded in time
(`EngineAdapter.on_tokenizer`), so the event loop goes on serving token streams, page streams
and status while a long prompt is tokenized.
"""

from __future__ import annotations

from fastapi import APIRouter

from engine_adapters.base import EngineAdapter
from tandem_protocol.api import TokenizeAnswer, TokenizeBody
from tandem_protocol.errors import RequestError
from tandem_protocol.reasoning import opens_reasoning

from ..deps import KEYED, Slot

router = APIRouter(dependencies=KEYED)


@router.post("/v1/tokenize")
async def tokenize(body: TokenizeBody, slot: Slot) -> TokenizeAnswer:
    if (body.messages is None) == (body.prompt is None):
        raise RequestError("give exactly one of `messages` (chat) or `prompt` (plain text)")
    adapter = slot.adapter
    return await adapter.on_tokenizer(_tokenize, adapter, body)


def _tokenize(adapter: EngineAdapter, body: TokenizeBody) -> TokenizeAnswer:
    """On the tokenizer thread."""
    try:
        if body.prompt is not None:
            return TokenizeAnswer(token_ids=adapter.encode(body.prompt))
        text = adapter.chat_prompt(body.messages, body.tools, body.chat_template_kwargs)
        return TokenizeAnswer(token_ids=adapter.encode(text), reasoning=opens_reasoning(text))
    except Exception as e:  # template errors name the problem
        raise RequestError(f"cannot tokenize: {e}") from e
