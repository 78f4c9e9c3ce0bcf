"""POST /v1/chat/completions: chat messages, tokenized by the decoder's chat template."""

from __future__ import annotations

from fastapi import APIRouter

from ..deps import API_KEY, AgentRouter, Db, RequestLogs
from ..targets import resolve_target
from .answer import Answer
from .bodies import ChatBody

router = APIRouter(dependencies=API_KEY)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatBody, db: Db, agents: AgentRouter, request_log: RequestLogs):
    body.check()
    sampling = body.sampling()  # refused here, before any agent is asked anything
    target = resolve_target(db, body.model)
    ids = await agents.tokenize(target, body.messages, None)
    return await Answer(body, True, ids, target, sampling, agents, request_log).respond()
