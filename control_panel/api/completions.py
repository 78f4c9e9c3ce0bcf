"""POST /v1/completions: one prompt, as text or as token ids."""

from __future__ import annotations

from fastapi import APIRouter

from ..deps import API_KEY, AgentRouter, Db, RequestLogs
from ..router import Router, Target
from ..targets import resolve_target
from .bodies import CompletionBody
from .choices import answer_or_choices
from .errors import OpenAIError

router = APIRouter(dependencies=API_KEY)


async def prompt_ids(body: CompletionBody, agents: Router, target: Target) -> list[int]:
    if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], int):
        return list(body.prompt)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise OpenAIError(400, "exactly one prompt per request is supported", param="prompt")
    return (await agents.tokenize(target, prompt=prompts[0])).token_ids


@router.post("/v1/completions")
async def completions(body: CompletionBody, db: Db, agents: AgentRouter, request_log: RequestLogs):
    body.check()
    sampling = body.sampling()  # refused here, before any agent is asked anything
    target = resolve_target(db, body.model)
    ids = await prompt_ids(body, agents, target)
    return await answer_or_choices(body, False, ids, target, sampling, agents=agents, request_log=request_log).respond()
