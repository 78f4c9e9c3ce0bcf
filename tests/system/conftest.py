"""The vLLM and SGLang servers of the system files that drive those engines themselves
(test_decoders_consume_pages, test_prefix_cache_servers, test_sglang_window, test_vllm_window): each
started once per session, side by side, and shared by every file whose settings agree.

A server starts at its first user (or at the first test of a module that calls
`server_pool.start_now`), together with every other server the session's remaining tests ask
for, the soonest needed first (a start is the better part of a minute of one core: side by side
they overlap, and beside the in-process tests before them), and stops after the last test that
asks for it, so that no more than four are ever alive (24 GiB; these files run after the
integration cluster is torn down, never beside it). A test asks for a server by its fixture, or
by naming the fixture in its parameters (test_prefix_cache_servers takes its pair of servers by
`request.getfixturevalue`, so that each case waits only for its own).

Four starts in all, in one wave: vllm_server, sglang_server, plain_sglang_server and
vllm_agent_server with test_decoders_consume_pages's in-process tests.

The servers, and why each is its own:

- `vllm_server`: vLLM, prefix cache on, chunks of 128 tokens (a 517-token prefill takes five
  steps, so a cancel lands while vLLM still computes it: test_vllm_window), one thread. Shared by
  test_decoders_consume_pages, test_vllm_window and test_prefix_cache_servers.
- `sglang_server`: SGLang in its decode role, radix cache on, prefill chunks of 1,024 tokens
  (test_sglang_window's held prompt is one chunk), one thread. test_sglang_window prefills on
  it (the adapter switches the server to its prefill role, in milliseconds, and back for a
  decode). Shared by test_decoders_consume_pages, test_sglang_window and test_prefix_cache_servers.
- `plain_sglang_server`: SGLang as a user runs it alone (no disaggregation, radix cache off), the
  reference of test_decoders_consume_pages.
- `vllm_agent_server`: a vLLM agent with its prefix cache at the agent's default, for
  test_prefix_cache_servers's test through the panel (counted as one server: it runs its own vLLM).

One server serves both a cache and no cache: vLLM and SGLang key their prefix caches by a
request's `cache_salt` (EngineRequest.cache_salt, the adapters' request bodies), so a request
with a salt of its own (`fresh_salt`) is served nothing from the cache and computes everything,
as with the cache off. Every request of these files that must compute everything carries one;
only test_prefix_cache_servers's conversation with a cache (and what it then asks of the cache)
goes without. (A cache is a start-up option: a twin of each server with it on cost two starts.)
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from engine_adapters.settings import EngineSettings
from engine_adapters.sglang_adapter import SGLangProcess

CONTEXT = 8192  # the model's, as the in-process engines load it: a pair's contracts must agree
# Servers alive at once. These files run beside the other lane's APART_FILES (tests/conftest.py):
# with five, the machine reached 22.6 of 23.5 GiB used (test_panel_ui beside
# test_prefix_cache_servers); with four, 19.1 GiB at most, for about 30 s more.
MAX_ALIVE = 4

# every server runs on one thread: several share two cores; caches on, requests salted (above)
VLLM = EngineSettings(prefix_caching=True, vllm_threads=1, vllm_chunk_tokens=128)
SGLANG = EngineSettings(prefix_caching=True, sglang_role="decode", sglang_threads=1, sglang_chunk_tokens=1024)


class PlainSGLangServer(SGLangProcess):
    """SGLang as a user runs it alone: Tandem's command line for the same model and CPU recipe,
    less everything of PD disaggregation."""

    WITH_VALUE = {
        "--disaggregation-mode",
        "--disaggregation-transfer-backend",
        "--disaggregation-bootstrap-port",
        "--disaggregation-decode-retraction-backup",
    }

    def __init__(self, model_dir: Path, log_path: Path, settings: EngineSettings):
        super().__init__(model_dir, CONTEXT, log_path.with_suffix(".sock"), log_path, lambda: "null", settings)

    def command(self) -> list[str]:
        cmd, plain = iter(super().command()), []
        for arg in cmd:
            if arg in self.WITH_VALUE:
                next(cmd)
            elif arg != "--enable-pd-role-switch":
                plain.append(arg)
        return plain

    def close(self) -> None:
        self.stop()


def _adapter(engine: str, settings: EngineSettings):
    def start(model_dir: Path, _run_dir: Path):
        from engine_adapters import load_adapter

        return load_adapter(engine, model_dir, CONTEXT, settings)

    return start


def _plain(model_dir: Path, run_dir: Path) -> PlainSGLangServer:
    plain = SGLANG.model_copy(update={"sglang_role": "prefill", "prefix_caching": False})
    server = PlainSGLangServer(model_dir, run_dir / "sglang.log", plain)
    server.start()
    return server


def _vllm_agent(model_dir: Path, run_dir: Path):
    """A vLLM agent (`tandem agent serve`, its own vLLM server) with its prefix cache at the
    agent's default (on): test_prefix_cache_servers's through-the-panel test."""
    from ..agents import AgentProcess

    agent = AgentProcess("vllm", model_dir, run_dir / "home", prefix_cache="default", env={"TANDEM_VLLM_THREADS": "1"})
    try:
        agent.wait_ready(600)  # started beside others: allow more than one start alone takes
    except BaseException:
        agent.stop()
        raise
    agent.close = agent.stop
    return agent


# fixture name -> how its server starts (the model's directory, a directory of its own)
SERVERS = {
    "vllm_agent_server": _vllm_agent,
    "vllm_server": _adapter("vllm", VLLM),
    "sglang_server": _adapter("sglang", SGLANG),
    "plain_sglang_server": _plain,
}


def fresh_salt(tag: str) -> str:
    """A cache salt no request had before: the engine's prefix cache serves nothing to a
    request that carries it, so it computes (or imports) every token, as with no cache."""
    return f"{tag}-{uuid.uuid4().hex}"


class ServerPool:
    """The servers of SERVERS, started on first use with every other one the session's tests
    still ask for (started side by side), each stopped after the last test that asks for it."""

    def __init__(self, model_dir: Path, run_dir: Path, items: list[pytest.Item]):
        self.model_dir, self.run_dir, self.items = model_dir, run_dir, items
        self.jobs: dict[str, Future] = {}
        self.lock = threading.Lock()
        self.starter = ThreadPoolExecutor(len(SERVERS), thread_name_prefix="server-start")

    def wanted(self, after: int) -> dict[str, int]:
        """The servers the tests from index `after` of the session's items ask for, each with the
        index of the first of them."""
        first: dict[str, int] = {}
        for index, item in enumerate(self.items[after:], after):
            for name in asked(item):
                first.setdefault(name, index)
        return first

    def _start(self, name: str | None, after: int) -> None:
        """Start `name` and, while fewer than MAX_ALIVE are alive, the other servers the tests
        from `after` on ask for, the soonest needed first (called holding the lock)."""
        wanted = self.wanted(after)
        waiting = sorted(set(wanted) - set(self.jobs), key=lambda n: (n != name, wanted[n]))
        if name is not None and name not in waiting and name not in self.jobs:
            waiting.insert(0, name)
        for other in waiting[: max(MAX_ALIVE - len(self.jobs), 1 if name is not None else 0)]:
            run_dir = self.run_dir / other
            run_dir.mkdir(parents=True, exist_ok=True)
            self.jobs[other] = self.starter.submit(SERVERS[other], self.model_dir, run_dir)

    def start_now(self, index: int) -> None:
        """Start, side by side, the servers the tests from `index` on ask for (as many as may be
        alive), before any of them is needed."""
        with self.lock:
            self._start(None, index)

    def get(self, name: str, index: int):
        with self.lock:
            if name not in self.jobs:
                self._start(name, index)
            job = self.jobs[name]
        return job.result()

    def release_unwanted(self, after: int) -> None:
        """Stop the servers no test from index `after` on asks for, and start those that waited
        for the room."""
        with self.lock:
            unwanted = set(self.jobs) - set(self.wanted(after))
            jobs = [self.jobs.pop(name) for name in unwanted]
        for job in jobs:
            close(job)
        if jobs:
            with self.lock:
                self._start(None, after)

    def close(self) -> None:
        with self.lock:
            jobs, self.jobs = list(self.jobs.values()), {}
        for job in jobs:
            close(job)
        self.starter.shutdown(wait=False)


def asked(item: pytest.Item) -> list[str]:
    """The servers a test asks for: its fixtures, and fixture names among its parameters (taken
    with request.getfixturevalue)."""
    callspec = getattr(item, "callspec", None)
    params = [v for v in (callspec.params.values() if callspec else ()) for v in (v if isinstance(v, tuple) else (v,))]
    return [name for name in [*item.fixturenames, *params] if isinstance(name, str) and name in SERVERS]


def close(job: Future) -> None:
    """Stop a server once its start has ended, one way or the other."""
    if job.exception() is None:
        job.result().close()


@pytest.fixture(scope="session")
def server_pool(request, smol_dir, tmp_path_factory):
    pool = ServerPool(smol_dir, tmp_path_factory.mktemp("engine-servers"), request.session.items)
    request.config.stash[POOL] = pool
    yield pool
    request.config.stash[POOL] = None
    pool.close()


POOL = pytest.StashKey[ServerPool | None]()
CURRENT = pytest.StashKey[int]()  # the index in the session's items of the test being set up


@pytest.fixture(scope="module")
def servers_start_now(request, server_pool):
    """For a module whose first tests need no server (usefixtures): the servers of the tests to
    come start at its first test, beside those that run in process."""
    server_pool.start_now(request.config.stash.get(CURRENT, 0))


def _server_fixture(name: str):
    # module-scoped, so that a module's own fixtures may use it; stopped only once no later
    # test asks for it
    @pytest.fixture(name=name, scope="module")
    def fixture(request, server_pool):
        return server_pool.get(name, request.config.stash.get(CURRENT, 0))

    return fixture


for _name in SERVERS:
    globals()[_name] = _server_fixture(_name)


def _position(item: pytest.Item) -> int:
    items = item.session.items
    return items.index(item) if item in items else len(items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.config.stash[CURRENT] = _position(item)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test, stop the servers no later test asks for."""
    pool = item.config.stash.get(POOL, None)
    if pool is not None:
        pool.release_unwanted(_position(item) + 1)


@pytest.fixture
def cache_bytes():
    """Set an engine's prefix cache budget for one test; the budget it had comes back after."""
    before: dict = {}

    def set_budget(adapter, capacity: int) -> None:
        before.setdefault(adapter, adapter.prefix_cache.capacity)
        adapter.set_prefix_cache_bytes(capacity)

    yield set_budget
    for adapter, capacity in before.items():
        adapter.set_prefix_cache_bytes(capacity)
