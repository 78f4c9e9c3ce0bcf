"""`n` > 1: a request's choices, each its own answer on the request's route, run at once so that
the decoder's engine batches them (torch and MLX decode concurrent requests as one batch; vLLM
and SGLang schedule them together). Seeded, choice i samples with seed + i, so choices differ as
they do on OpenAI; greedy choices are alike. Whole, the choices are one answer; streamed, their
chunks interleave as they come, each with its index, then one usage chunk and one [DONE].
If one choice fails, the others are stopped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from tandem_protocol.sampling import SamplingParams

from ..router import Target
from .answer import Answer, first_pieces, stream_choices
from .bodies import _Common


def seeded(seed: int, index: int) -> int:
    """seed + index, kept in the signed 64-bit range seeds are given in."""
    return (seed + index + 2**63) % 2**64 - 2**63


class Choices:
    def __init__(self, answers: list[Answer]):
        self.answers = answers
        self.body = answers[0].body

    async def respond(self):
        return await (self.streamed() if self.body.stream else self.whole())

    def usage(self) -> dict:
        usage = self.answers[0].usage()
        done = sum(a.stats.output_tokens for a in self.answers)
        return {**usage, "completion_tokens": done, "total_tokens": usage["prompt_tokens"] + done}

    async def whole(self) -> dict:
        try:
            async with asyncio.TaskGroup() as group:  # a choice's error stops the others
                tasks = [group.create_task(a.whole()) for a in self.answers]
        except ExceptionGroup as e:
            raise e.exceptions[0] from None
        wholes = [t.result() for t in tasks]
        return {**wholes[0], "choices": [w["choices"][0] for w in wholes], "usage": self.usage()}

    async def streamed(self) -> StreamingResponse:
        gens, firsts = await first_pieces(self.answers)
        return StreamingResponse(
            self.sse(gens, firsts), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    def sse(self, gens: list[AsyncIterator], firsts: list[tuple | None]) -> AsyncIterator[bytes]:
        return stream_choices(self.answers, gens, firsts, self.usage)


def answer_or_choices(body: _Common, chat: bool, ids: list[int], target: Target, sampling: SamplingParams, **kw):
    """The request's Answer, or its `n` choices' (Answer's arguments, `kw` its keywords). `n`
    choices take `n` places of the API key's (rate_limits.py Slot.widen) before any is asked for."""
    if body.n > 1 and kw.get("slot") is not None:
        kw["slot"].widen(body.n, sampling.max_tokens)
    first = Answer(body, chat, ids, target, sampling, **kw)
    if body.n == 1:
        return first
    more = [
        Answer(
            body,
            chat,
            ids,
            target,
            sampling if sampling.seed is None else sampling.model_copy(update={"seed": seeded(sampling.seed, i)}),
            **{**kw, "rid": first.rid, "index": i},
        )
        for i in range(1, body.n)
    ]
    return Choices([first, *more])
