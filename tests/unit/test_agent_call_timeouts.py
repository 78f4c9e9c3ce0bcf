"""Issue 43, H1's third part: every AgentClient call that is not a stream gives up on an agent
that takes the request and never answers (its event loop held, or the process wedged), with a
TransportError that names the call, as for an agent that cannot be reached. Before, the panel's
tokenize call to such an agent waited forever, and so did every later request for its model.

The agent here is a socket that reads the request and says nothing; the bounds are made short
(their values, and why each is what it is, are in tandem_protocol/client.py).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tandem_protocol import client as client_module
from tandem_protocol.client import AgentClient, TransportError

BOUND = 0.3  # seconds each call waits here
CALLS = {
    "healthz": lambda c: c.healthz(),
    "info": lambda c: c.info(),
    "status": lambda c: c.status(),
    "local_models": lambda c: c.local_models(),
    "tokenize": lambda c: c.tokenize(messages=[{"role": "user", "content": "hi"}]),
    "configure": lambda c: c.configure(engine="torch", model_path="/m", dry_run=True),
    "bench_link": lambda c: c.bench_link("http://127.0.0.1:9", 1),
    "create_handoff": lambda c: c.create_handoff(handoff_id="0" * 32, token_ids=[1], contract="x", wait_timeout=0),
    "cancel_handoff": lambda c: c.cancel_handoff("0" * 32),
}


@pytest.fixture
def short_bounds(monkeypatch):
    for name in ("CONTROL_SECONDS", "TOKENIZE_WAIT", "CONFIG_SECONDS"):
        monkeypatch.setattr(client_module, name, BOUND)
    monkeypatch.setattr(client_module, "LINK_SECONDS_PER_MB", 0.0)


async def _silent_agent_call(call) -> tuple[BaseException, float]:
    """`call` on a client of an agent that reads requests and never answers: what it raised, and
    after how long (given up at 10 s: the old client never raised)."""

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 20)
        await asyncio.Event().wait()  # no answer, ever

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = AgentClient(f"http://127.0.0.1:{port}", "k")
    start = time.perf_counter()
    try:
        await asyncio.wait_for(call(client), 10)
    except BaseException as e:  # what the call raised, whatever it is, is the subject
        return e, time.perf_counter() - start
    finally:
        await client.aclose()
        server.close()
    raise AssertionError("a silent agent answered")


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_call_to_an_agent_that_never_answers_gives_up(short_bounds, name):
    error, seconds = asyncio.run(_silent_agent_call(CALLS[name]))
    assert isinstance(error, httpx.ReadTimeout), repr(error)
    assert isinstance(error, TransportError) and "no answer within 0.3 s" in str(error), str(error)
    assert BOUND <= seconds < BOUND + 2.0, seconds  # its bound, not the 10 s the test waits at most


def test_each_bound_leaves_a_working_agent_its_time():
    """The agent fails a tokenize itself at TOKENIZE_SECONDS, with a 400 that says why: the client
    waits longer than that. A configuration may load two engines, each up to a server's 600 s
    start timeout. A handoff's creation waits for budget up to its own `wait_timeout`."""
    from engine_adapters.settings import EngineSettings
    from tandem_protocol.api import TOKENIZE_SECONDS

    starts = EngineSettings()
    assert client_module.TOKENIZE_WAIT > TOKENIZE_SECONDS
    assert client_module.CONFIG_SECONDS > 2 * max(starts.vllm_start_timeout, starts.sglang_start_timeout)
