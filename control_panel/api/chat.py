"""POST /v1/chat/completions: chat messages, tokenized by the decoder's chat template."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from sqlalchemy import Engine

from ..deps import API_KEY, AgentRouter, CacheSalt, Db, KeySlot, RequestLogs
from ..rate_limits import Slot
from ..request_log import RequestLogWriter
from ..router import Router
from ..targets import resolve_target
from .answer import Answer, new_rid, tokenize
from .bodies import ChatBody, checked_sampling
from .choices import Choices, answer_or_choices

router = APIRouter(dependencies=API_KEY)


async def chat_answer(
    body: ChatBody,
    db: Engine,
    agents: Router,
    request_log: RequestLogWriter,
    rid: str | None = None,
    slot: Slot | None = None,
    cache_salt: str | None = None,
) -> Answer | Choices:
    """The answer to a chat body, checked, routed and tokenized (what /v1/responses runs too);
    `rid`: its id (default: a new chatcmpl-…), `slot`: the API key's, charged its tokens,
    `cache_salt`: its prefix cache namespace."""
    sampling = await asyncio.to_thread(checked_sampling, body)  # refused here, before any agent is asked anything
    target = resolve_target(db, body.model, cache_salt)
    rid = rid or new_rid(True)
    prompt = await tokenize(
        agents,
        target,
        request_log,
        rid,
        messages=body.messages,
        tools=body.tools if body.tool_mode else None,
        chat_template_kwargs=body.chat_template_kwargs,
    )
    return answer_or_choices(
        body,
        True,
        prompt.token_ids,
        target,
        sampling,
        agents=agents,
        request_log=request_log,
        reasoning=prompt.reasoning,
        rid=rid,
        slot=slot,
    )


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatBody, db: Db, agents: AgentRouter, request_log: RequestLogs, slot: KeySlot, salt: CacheSalt
):
    return await (await chat_answer(body, db, agents, request_log, slot=slot, cache_salt=salt)).respond()
