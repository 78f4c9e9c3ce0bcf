"""One completion's answer, chat or text, whole or streamed (SSE), cut at its stop strings and
logged however it ends: what /v1/chat/completions and /v1/completions share."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from fastapi.responses import StreamingResponse

from tandem_protocol.api import TokenizeAnswer
from tandem_protocol.sampling import SamplingParams
from tandem_protocol.tools import ToolCall

from ..models import RequestLog
from ..rate_limits import Slot
from ..request_log import RequestLogWriter
from ..router import RouteError, Router, RouteStats, Target
from .bodies import _Common
from .errors import route_failure
from .reasoning import ReasoningText
from .tool_calls import ToolCallText


class StopScanner:
    """Cuts the text at the first stop string, holding back what could still become one: the
    longest end of the text that is the start of a stop string.

    Linear in the text, however long the stop strings (issue 43): each stop string is matched as
    the text streams (Knuth-Morris-Pratt), so the text is read once, not again at each token, and
    what is held back is a stop string's start, so it is kept as which one and how much of it,
    never copied."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.borders = [_borders(s) for s in self.stops]
        self.firsts = frozenset(s[0] for s in self.stops)
        self.matched = [0] * len(self.stops)  # of each stop string, how much the text ends with
        self.held_of, self.held = 0, 0  # held back: the start of stops[held_of], `held` characters
        self.hit = False

    def feed(self, text: str) -> str:
        if not self.held and self.firsts.isdisjoint(text):  # the usual case: nothing begins a stop string
            return text
        ends = []  # (where in `text` a stop string ends, minus its length)
        for i, stop in enumerate(self.stops):
            self.matched[i], end = _match(stop, self.borders[i], self.matched[i], text)
            if end >= 0:
                ends.append((end, -len(stop)))
        if ends:  # the first to end (the longest of those): the text goes up to its start
            end, length = min(ends)
            self.hit = True
            out = self._release(text[:end], -length, 0)
            self.held = 0  # the stop string itself never goes out
            return out
        longest = max(range(len(self.stops)), key=self.matched.__getitem__)
        return self._release(text, self.matched[longest], longest)

    def _release(self, text: str, keep: int, of: int) -> str:
        """The held text followed by `text`, less its last `keep` characters: those are held
        back from now on, the start of stops[of]."""
        out = self.held + len(text) - keep  # characters that go out
        held = self.stops[self.held_of]
        released = held[:out] if out <= self.held else held[: self.held] + text[: out - self.held]
        self.held_of, self.held = of, keep
        return released

    def flush(self) -> str:
        out = self.stops[self.held_of][: self.held] if self.stops else ""
        self.held = 0
        return out


def _borders(stop: str) -> list[int]:
    """For each length n of the start of `stop`, the longest proper start of `stop` that its first
    n characters end with (Knuth-Morris-Pratt's failure function)."""
    borders, k = [0] * (len(stop) + 1), 0
    for n in range(2, len(stop) + 1):
        while k and stop[k] != stop[n - 1]:
            k = borders[k]
        if stop[k] == stop[n - 1]:
            k += 1
        borders[n] = k
    return borders


def _match(stop: str, borders: list[int], k: int, text: str) -> tuple[int, int]:
    """After `text`, how much of `stop` the text ends with, `k` before it; and where in `text` the
    whole of `stop` first ends (-1: it does not)."""
    if k and stop.startswith(text, k):  # (scans in C: the text goes on with it, or cannot begin it)
        k += len(text)
        return k, len(text) if k == len(stop) else -1
    start = text.find(stop[0]) if k == 0 else 0
    if start < 0:
        return 0, -1
    for at in range(start, len(text)):
        while k and stop[k] != text[at]:
            k = borders[k]
        if stop[k] == text[at]:
            k += 1
            if k == len(stop):
                return k, at + 1
    return k, -1


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


async def tokenize(agents: Router, target: Target, request_log: RequestLogWriter, rid: str, **body) -> TokenizeAnswer:
    """The prompt's token ids from the target's decoder (`body`: the agent's tokenize fields). A
    routing error is logged under `rid` here (no Answer exists yet to log it) and raised as the
    client is told it."""
    try:
        return await agents.tokenize(target, **body)
    except RouteError as e:
        logged = request_log.start(RequestLog(model=target.name, request_id=rid, route=""))
        request_log.finish(logged, outcome="error", error=str(e))
        raise route_failure(e, rid) from e


def new_rid(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


class Answer:
    """The answer to a checked request whose prompt is `ids`."""

    def __init__(
        self,
        body: _Common,
        chat: bool,
        ids: list[int],
        target: Target,
        sampling: SamplingParams,
        agents: Router,
        request_log: RequestLogWriter,
        reasoning: bool = False,
        rid: str | None = None,
        index: int = 0,
        slot: Slot | None = None,
    ):
        """`reasoning`: the chat template left a reasoning block open, so the answer begins in it.
        `rid`: the answer's id (default: a new chatcmpl-… or cmpl-…). `index`: its choice's.
        `slot`: the API key's (rate_limits.py), charged the tokens: the prompt once per request
        (as `usage` counts it, whatever `n`), each choice's answer when it ends."""
        self.body, self.chat, self.ids, self.request_log, self.index = body, chat, ids, request_log, index
        self.slot = slot
        if slot is not None and index == 0:
            slot.charge(len(ids))
        self.stats = RouteStats()
        self.rid = rid or new_rid(chat)
        self.created = int(time.time())
        self.logged = request_log.start(
            RequestLog(model=body.model, request_id=self.rid, route="", prompt_tokens=len(ids))
        )
        self.events = agents.run(target, ids, sampling, self.stats)
        self.scanner = StopScanner(body.stops)
        self.logprobs = sampling.logprobs is not None  # asked for: every choice carries them
        tool_mode = getattr(body, "tool_mode", None)  # chat only
        self.reasoning_text = ReasoningText(reasoning) if chat else None
        self.tool_text = ToolCallText(body.tools, body.tool_choice, tool_mode == "forced") if tool_mode else None
        self.calls: list[ToolCall] = []  # read from the answer once it ended
        self.text_offset = 0  # a text completion's logprobs count characters from the answer's start
        self.delivered = 0  # tokens that have arrived
        self.reasoning_tokens = 0  # of them, those whose text was all reasoning

    def log(self, outcome: str, error: str = "") -> None:
        """Record how the answer ended (called once, however it ends)."""
        stats = self.stats
        if self.slot is not None:
            self.slot.charge(stats.output_tokens)
        self.request_log.finish(
            self.logged,
            route=stats.route,
            reason=stats.reason,
            ttft_ms=stats.ttft_ms,
            predicted_ttft_ms=stats.predicted_ttft_ms,
            output_tokens=stats.output_tokens,
            bytes_moved=stats.bytes_moved,
            cached_tokens=stats.cached_tokens,
            decode_node=stats.decode_node,
            prefill_node=stats.prefill_node,
            outcome=outcome,
            error=error,
        )

    async def texts(self) -> AsyncIterator[tuple[str, list[dict]]]:
        """Text deltas until the end, a stop string or an error (raised as RouteError), each with
        the log-probability entries (the agent's, OpenAI's chat shape) of the tokens that arrived
        since the last delta: a token whose text is held back (a stop string could begin there)
        sends its entry with the text that follows."""
        entries: list[dict] = []
        try:
            async for event in self.events:
                if "error" in event:
                    raise RouteError(event["error"]["message"], 503)
                if "token" in event:
                    self.delivered += 1
                    if "logprobs" in event:
                        entries.append(event["logprobs"])
                    delta = self.scanner.feed(event["text"])
                    if delta or (self.scanner.hit and entries):
                        yield delta, entries
                        entries = []
                    if self.scanner.hit:
                        self.stats.finish_reason = "stop"
                        return
            rest = self.scanner.flush()
            if rest or entries:
                yield rest, entries
        finally:
            await self.events.aclose()  # a stop string or a client gone: abort both roles now

    async def contents(self) -> AsyncIterator[tuple[str, list[dict], str]]:
        """`texts` as (content, log-probability entries, reasoning): a chat's reasoning taken out
        of its content, and what the tools' reader holds back as calls (read into `self.calls`
        when the answer ends)."""
        counted = 0
        async with aclosing(self.texts()) as texts:
            async for delta, entries in texts:
                reasoning, content = self.reasoning_text.feed(delta) if self.reasoning_text else ("", delta)
                if reasoning or content:  # held text counts with what it comes out with
                    self.reasoning_tokens += 0 if content else self.delivered - counted
                    counted = self.delivered
                if self.tool_text is not None:
                    content = self.tool_text.feed(content)
                if content or entries or reasoning:
                    yield content, entries, reasoning
                if self.tool_text is not None and self.tool_text.repeated:
                    break  # closing `texts` aborts both roles now
        reasoning, content = self.reasoning_text.finish() if self.reasoning_text else ("", "")
        if self.tool_text is not None:
            content = self.tool_text.feed(content)
            rest, self.calls = self.tool_text.finish()
            content += rest
        if content or reasoning:
            yield content, [], reasoning

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.calls else self.stats.finish_reason or "stop"

    def usage(self) -> dict:
        done = self.stats.output_tokens
        return {
            "prompt_tokens": len(self.ids),
            "completion_tokens": done,
            "total_tokens": len(self.ids) + done,
            "prompt_tokens_details": {"cached_tokens": self.stats.cached_tokens},
        }

    def head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.body.model}

    def choice_logprobs(self, entries: list[dict]) -> dict | None:
        """A choice's `logprobs`: OpenAI's chat shape ({"content": entries}), or the legacy text
        completion's (parallel lists, alternatives as {text: logprob}, character offsets)."""
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(e["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets,
        }

    def chunk(self, delta: str | None, finish: str | None, entries: list[dict] | None = None) -> dict:
        logprobs = self.choice_logprobs(entries) if entries else None
        if self.chat:
            d = {} if delta is None else {"content": delta}
            choice = {"index": self.index, "delta": d, "logprobs": logprobs, "finish_reason": finish}
            return {**self.head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": self.index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
        return {**self.head("text_completion"), "choices": [choice]}

    def piece_chunk(self, content: str, entries: list[dict], reasoning: str) -> dict:
        chunk = self.chunk(content if content or not reasoning else None, None, entries)
        if reasoning:
            chunk["choices"][0]["delta"]["reasoning_content"] = reasoning
        return chunk

    async def respond(self):
        """The answer: a JSON body, or an SSE stream."""
        return await (self.streamed() if self.body.stream else self.whole())

    async def pieces(self) -> list[tuple[str, list[dict], str]]:
        """All of `contents`, logged; a routing error raised as an OpenAIError."""
        try:
            pieces = [piece async for piece in self.contents()]
        except RouteError as e:
            self.log("error", str(e))
            raise route_failure(e, self.rid) from e
        except asyncio.CancelledError:  # the client hung up, or the panel is stopping
            self.log("cancelled")
            raise
        self.log("ok")
        return pieces

    async def whole(self) -> dict:
        pieces = await self.pieces()
        finish = self.finish_reason
        text = "".join(delta for delta, _, _ in pieces)
        reasoning = "".join(r for _, _, r in pieces)
        logprobs = self.choice_logprobs([e for _, entries, _ in pieces for e in entries])
        message = {"role": "assistant", "content": text}
        if self.calls:
            message = {"role": "assistant", "content": text or None, "tool_calls": [c.openai() for c in self.calls]}
        if reasoning:
            message["reasoning_content"] = reasoning
        choice = (
            {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish}
            if self.chat
            else {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        )
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self.head(obj), "choices": [choice], "usage": self.usage()}

    async def streamed(self, render=None) -> StreamingResponse:
        """The answer as SSE: `render(pieces, first)` makes the events of `contents`' pieces (the
        first one given apart), by default chat or completion chunks (`sse`)."""
        (gen,), (first,) = await first_pieces([self])
        return StreamingResponse(
            (render or self.sse)(gen, first), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def chunks(self, gen: AsyncIterator[tuple[str, list[dict], str]], first: tuple | None) -> AsyncIterator[dict]:
        """The stream's chunks, from the role's to the finish reason's; a routing error raised."""
        if self.chat:
            head = self.chunk(None, None)
            head["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield head
        if first is not None:
            yield self.piece_chunk(*first)
            async for piece in gen:
                yield self.piece_chunk(*piece)
        for index, call in enumerate(self.calls):  # each whole, in one chunk: the SDK joins them as sent
            chunk = self.chunk(None, None)
            chunk["choices"][0]["delta"] = {"tool_calls": [call.openai(index)]}
            yield chunk
        yield self.chunk(None, self.finish_reason)

    def usage_chunk(self, usage: dict) -> bytes | None:
        """The final usage chunk, when the request asked for it."""
        if not (self.body.stream_options and self.body.stream_options.include_usage):
            return None
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self.head(obj), "choices": [], "usage": usage})

    def sse(self, gen: AsyncIterator[tuple[str, list[dict], str]], first: tuple | None) -> AsyncIterator[bytes]:
        return stream_choices([self], [gen], [first], self.usage)


async def first_pieces(answers: list[Answer]) -> tuple[list[AsyncIterator], list[tuple | None]]:
    """Each answer's `contents` and its first piece, pulled at once before anything is sent, so
    that a routing error is a real HTTP error; if one fails, or the client goes, every answer is
    closed and logged."""
    gens = [a.contents() for a in answers]

    async def first(gen: AsyncIterator) -> tuple | None:
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            return None

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(first(g)) for g in gens]
    except BaseException as e:  # a routing error (in a group), or the client gone
        route_error = next((x for x in getattr(e, "exceptions", ()) if isinstance(x, RouteError)), None)
        for answer, gen in zip(answers, gens, strict=True):
            try:
                await gen.aclose()
            finally:
                answer.log("error" if route_error else "cancelled", str(route_error or ""))
        if route_error is not None:
            raise route_failure(route_error, answers[0].rid) from route_error
        raise
    return gens, [t.result() for t in tasks]


async def stream_choices(
    answers: list[Answer], gens: list[AsyncIterator], firsts: list[tuple | None], usage: Callable[[], dict]
) -> AsyncIterator[bytes]:
    """The SSE stream of one or more answers (`n` choices) whose first pieces were pulled: their
    chunks as they come, interleaved, then the usage chunk if asked and [DONE]; a routing error in
    any ends the stream with an error event and stops the others. Each answer is logged."""
    chunks: asyncio.Queue = asyncio.Queue()  # chunks, then None from each answer (or its error)

    async def pump(answer: Answer, gen: AsyncIterator, first: tuple | None) -> None:
        try:
            async for chunk in answer.chunks(gen, first):
                await chunks.put(chunk)
            await chunks.put(None)
        except Exception as e:  # noqa: BLE001 -- raised where the stream is written
            await chunks.put(e)

    outcome, error = "cancelled", ""
    tasks = [asyncio.create_task(pump(*args)) for args in zip(answers, gens, firsts, strict=True)]
    try:
        running = len(tasks)
        while running:
            item = await chunks.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield sse(item)
        if usage_chunk := answers[0].usage_chunk(usage()):
            yield usage_chunk
        yield DONE
        outcome = "ok"
    except RouteError as e:
        outcome, error = "error", str(e)
        yield error_event(e, answers[0].rid)
    finally:
        # A client gone cancels this stream's task for good (anyio's cancel scope: every later
        # await here is cancelled too), so the closing runs as a task of its own, to its end.
        closing = asyncio.ensure_future(_close(answers, gens, tasks, outcome, error))
        _CLOSING.add(closing)
        closing.add_done_callback(_CLOSING.discard)
        await asyncio.shield(closing)


_CLOSING: set[asyncio.Task] = set()  # closings under way (the loop keeps only weak references)


async def _close(answers: list[Answer], gens: list[AsyncIterator], tasks: list[asyncio.Task], outcome: str, error: str):
    """Stop the answers' pumps, close their streams (aborting both roles of each) and log them."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for answer, gen in zip(answers, gens, strict=True):
        try:
            await gen.aclose()
        finally:  # logged even when closing fails (the panel shutting down under it)
            answer.log(outcome, error)


def error_event(e: RouteError, rid: str) -> bytes:
    """A routing error in the middle of a stream (as the client is told it), and the stream's end."""
    return sse({"error": {"message": str(route_failure(e, rid)), "type": e.kind, "param": None, "code": None}}) + DONE
