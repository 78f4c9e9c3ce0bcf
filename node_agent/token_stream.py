"""A request's token stream as NDJSON: {"token", "text"} lines (with "logprobs" where the request
asked for them), then one {"done": true, ...} line or one {"error": {...}} line, whatever
happens to the request."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from starlette.responses import StreamingResponse

from engine_adapters.base import EngineAdapter, EngineRequest
from tandem_protocol.api import PREFILLER_FAILED
from tandem_protocol.client import AgentHTTPError
from tandem_protocol.errors import Cancelled, TandemError
from tandem_protocol.sampling import TokenLogprobs

from .errors import error_body
from .handshake import Handshake
from .metrics import Metrics

log = logging.getLogger("tandem.agent")


class IncrementalDetokenizer:
    """Text deltas from a growing token list, decoding only a short window of recent tokens
    (the offsets scheme of Hugging Face's TextStreamer and vLLM's detokenizer), so a long answer
    costs O(n), not O(n^2). A partial UTF-8 character is held back until it completes.

    Tokens that add no text (special tokens, which decode to nothing) or leave it ending in a
    partial character are decoded again with the next token; past MAX_HELD of them they go out as
    they decode (U+FFFD for bytes that make no character), so that the window stays short even
    when a request steers its output to such tokens (logit_bias, ignore_eos): left to grow, each
    token would decode all of them again (issue 43)."""

    MAX_HELD = 8  # a UTF-8 character is at most 4 bytes, so at most 4 tokens

    def __init__(self, adapter: EngineAdapter):
        self.adapter, self.ids, self.prefix, self.read = adapter, [], 0, 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.adapter.detokenize(self.ids[self.prefix : self.read])
        text = self.adapter.detokenize(self.ids[self.prefix :])
        held = len(self.ids) - self.read
        if (len(text) <= len(before) or text.endswith("\ufffd")) and held < self.MAX_HELD:
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]


class NDJSONResponse(StreamingResponse):
    """A token stream's response; `release` runs however it ends. The lines' own `finally` is
    not enough: a client gone before the first line makes Starlette give up before it starts
    the generator, whose body (and so its `finally`) then never runs."""

    def __init__(self, lines: AsyncIterator[bytes], release: Callable[[], None] | None = None):
        super().__init__(lines, media_type="application/x-ndjson")
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._release is not None:
                self._release()


def line(item: dict) -> bytes:
    return (json.dumps(item) + "\n").encode()


def logprobs_entry(adapter: EngineAdapter, token: int, logprobs: TokenLogprobs) -> dict:
    """A token's log-probabilities as OpenAI's chat API shows them: the token's text, bytes and
    logprob, and its `top_logprobs` alternatives the same way, most likely first."""
    ids = [token, *(t for t, _ in logprobs.top)]
    pieces = adapter.token_pieces(ids)

    def entry(piece: tuple[str, bytes], logprob: float) -> dict:
        return {"token": piece[0], "logprob": logprob, "bytes": list(piece[1])}

    return {
        **entry(pieces[0], logprobs.logprob),
        "top_logprobs": [entry(p, lp) for p, (_, lp) in zip(pieces[1:], logprobs.top, strict=True)],
    }


def finish_reason(adapter: EngineAdapter, req: EngineRequest, count: int, last: int | None) -> str:
    stops = set(req.sampling.stop_token_ids) | (set() if req.sampling.ignore_eos else adapter.eos_token_ids)
    return "stop" if last in stops or count < req.sampling.max_tokens else "length"


async def token_lines(
    adapter: EngineAdapter,
    metrics: Metrics,
    req: EngineRequest,
    tokens: AsyncIterator[int],
    kind: str,
    t0: float,
    extra: dict,
    handshake: Handshake | None = None,
) -> AsyncIterator[bytes]:
    text = IncrementalDetokenizer(adapter)
    outcome, count, ttft, first_at, last = "error", 0, None, None, None
    try:
        async with aclosing(tokens) as stream:
            async for token in stream:
                if ttft is None:
                    ttft, first_at = time.perf_counter() - t0, time.time()
                count, last = count + 1, token
                metrics.generated_tokens.inc()
                item = {"token": token, "text": text.add(token)}
                if req.sampling.logprobs is not None:
                    item["logprobs"] = logprobs_entry(adapter, token, req.token_logprobs[count - 1])
                yield line(item)
        finish = finish_reason(adapter, req, count, last)
        outcome = "ok"
        yield line(
            {
                "done": True,
                "finish_reason": finish,
                "prompt_tokens": len(req.token_ids),
                "completion_tokens": count,
                "cached_tokens": req.cached_tokens,
                "ttft_seconds": ttft,
                "first_token_at": first_at,  # wall clock, as the page times (stage breakdowns)
                **extra,
                **({"last_page_imported_at": req.imported_at} if req.imported_at else {}),
            }
        )
    except (TandemError, AgentHTTPError) as e:
        outcome = "cancelled" if isinstance(e, Cancelled) else "failed"
        body = error_body(e)
        if count == 0 and handshake is not None and handshake.failed:
            body["error"][PREFILLER_FAILED] = True  # nothing was sent: the panel may serve D alone
        yield line(body)
    except Exception as e:  # a bug or an engine failing in a way nobody foresaw: still a last line
        log.exception("%s request %s failed", kind, req.request_id)
        outcome = "failed"
        yield line({"error": {"type": "engine_error", "message": f"{type(e).__name__}: {e}"}})
    finally:
        metrics.requests.labels(kind=kind, outcome=outcome).inc()
