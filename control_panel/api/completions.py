"""POST /v1/completions: one prompt, as text or as token ids."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from ..deps import API_KEY, AgentRouter, CacheSalt, Db, KeySlot, RequestLogs
from ..request_log import RequestLogWriter
from ..router import Router, Target
from ..targets import resolve_target
from .answer import new_rid, tokenize
from .bodies import CompletionBody, checked_sampling
from .choices import answer_or_choices
from .errors import OpenAIError

router = APIRouter(dependencies=API_KEY)


async def prompt_ids(
    body: CompletionBody, agents: Router, target: Target, request_log: RequestLogWriter, rid: str
) -> list[int]:
    if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], int):
        return list(body.prompt)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise OpenAIError(400, "exactly one prompt per request is supported", param="prompt")
    return (await tokenize(agents, target, request_log, rid, prompt=prompts[0])).token_ids


@router.post("/v1/completions")
async def completions(
    body: CompletionBody, db: Db, agents: AgentRouter, request_log: RequestLogs, slot: KeySlot, salt: CacheSalt
):
    sampling = await asyncio.to_thread(checked_sampling, body)  # refused here, before any agent is asked anything
    target = resolve_target(db, body.model, salt)
    rid = new_rid(False)
    ids = await prompt_ids(body, agents, target, request_log, rid)
    kw = {"agents": agents, "request_log": request_log, "rid": rid, "slot": slot}
    return await answer_or_choices(body, False, ids, target, sampling, **kw).respond()
