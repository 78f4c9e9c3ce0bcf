"""The Playground: chat with a pair or a node; the answer streams in (NDJSON over fetch()) with
its route, time to first token, tokens/s and bytes moved, and the request is logged."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy import Engine

from .. import services
from ..api.errors import OpenAIError
from ..deps import SIGNED_IN, AgentRouter, CsrfHeader, Db, Render, Tr
from ..models import RequestLog
from ..request_log import save as log_request
from ..router import RouteError, Router, RouteStats, Target
from ..targets import resolve_target
from .render import fmt_bytes

router = APIRouter(include_in_schema=False, dependencies=SIGNED_IN)


@router.get("/playground")
async def playground_page(db: Db, render: Render):
    return render("playground.html", models=services.model_names(db))


def ndjson(item: dict) -> bytes:
    return (json.dumps(item) + "\n").encode()


def refuse(message: str, status_code: int) -> Response:
    return Response(ndjson({"error": message}), status_code=status_code, media_type="application/x-ndjson")


def summary(stats: RouteStats, prompt_tokens: int) -> dict:
    elapsed = time.perf_counter() - stats.started
    decode_s = elapsed - (stats.ttft_ms or 0) / 1000
    tps = (stats.output_tokens - 1) / decode_s if stats.output_tokens > 1 and decode_s > 0 else None
    return {
        "done": True,
        "route": stats.route,
        "reason": stats.reason,
        "prompt_tokens": prompt_tokens,
        "output_tokens": stats.output_tokens,
        "ttft_ms": stats.ttft_ms,
        "tokens_per_s": tps,
        "bytes_moved": stats.bytes_moved,
        "bytes_label": fmt_bytes(stats.bytes_moved),
    }


async def answer(
    db: Engine, agents: Router, target: Target, model: str, message: str, sampling: dict
) -> AsyncIterator[bytes]:
    """The answer's text deltas, then its summary; logged as ok, error or cancelled (the user
    left) whatever happens."""
    stats = RouteStats()
    ids: list[int] = []
    outcome, error = "cancelled", ""
    try:
        ids = (await agents.tokenize(target, messages=[{"role": "user", "content": message}])).token_ids
        gen = agents.run(target, ids, sampling, stats)
        try:
            async for event in gen:
                if "error" in event:
                    raise RouteError(event["error"].get("message", "error"), 503)
                if "token" in event:
                    yield ndjson({"text": event["text"]})
        finally:
            await gen.aclose()
        outcome = "ok"
    except RouteError as e:
        outcome, error = "error", str(e)
        yield ndjson({"error": str(e)})
    finally:
        done = summary(stats, len(ids))
        row = RequestLog(
            model=model,
            route=stats.route or "",
            reason=stats.reason,
            prompt_tokens=len(ids),
            ttft_ms=stats.ttft_ms,
            predicted_ttft_ms=stats.predicted_ttft_ms,
            output_tokens=stats.output_tokens,
            bytes_moved=stats.bytes_moved,
            outcome=outcome,
            error=error,
        )
        log_request(db, row)
    yield ndjson(done)


@router.post("/ui/playground/stream")
async def playground_stream(_csrf: CsrfHeader, request: Request, db: Db, agents: AgentRouter, t: Tr):
    _ = t.gettext
    try:
        body = await request.json()
        model, message = str(body["model"]), str(body["message"])
        max_tokens = max(1, min(int(body.get("max_tokens") or 128), 2048))
        temperature = float(body.get("temperature") or 0.0)
    except (ValueError, KeyError, TypeError):
        return refuse(_("Bad request."), 400)
    if not message.strip():
        return refuse(_("Type a message first."), 400)
    try:
        target = resolve_target(db, model)
    except OpenAIError:
        return refuse(_("Unknown model %(model)s.", model=model), 404)
    sampling = {"max_tokens": max_tokens, "temperature": temperature, "top_p": 1.0, "top_k": 0, "seed": None}
    return StreamingResponse(
        answer(db, agents, target, model, message, sampling),
        media_type="application/x-ndjson",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )
