"""Shared fixtures: the embedded model, loaded engines, tiny checkpoints and prompts of exact lengths."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

# Before torch loads (here, and in every agent and engine server the tests start, which inherit
# the environment): OpenMP threads that wait sleep instead of spinning. The suite runs many
# engines on two cores; spinning threads steal them from each other. A 16-token torch generate
# beside a loaded machine: 16-23 s with the default policy, 2.2-2.4 s passive, the same tokens.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from engine_adapters.embedded_model import fetch
from tandem_protocol.settings import data_dir

from . import prerequisites
from .seed import run_seed

REPORTS = Path(__file__).resolve().parent.parent / "reports"

# SGLang's CPU test recipe (tests/sglang_cpu/, `make sglang-cpu-test`) has an environment of its
# own that only the tests point agents at: a user's agent never takes the stand-in for SGLang.
SGLANG_CPU_PYTHON = Path(__file__).resolve().parent / "sglang_cpu" / ".venv" / "bin" / "python"
if SGLANG_CPU_PYTHON.exists():
    os.environ.setdefault("TANDEM_SGLANG_PYTHON", str(SGLANG_CPU_PYTHON))

# A long, varied text: prompts of exact token lengths are cut from its chat-templated ids.
LONG_TEXT = (
    "Tandem turns a gaming PC and a laptop into one model server. Explain, step by step, how a "
    "river delta forms, why the Moon always shows the same face to the Earth, what a hash table "
    "does when two keys collide, and how bread rises in a warm kitchen. Then list five capital "
    "cities in Europe with one fact about each, write a haiku about autumn rain, translate 'good "
    "morning' into French, German and Japanese, and finally summarise the causes of the First "
    "World War in plain words for a twelve-year-old reader who likes trains and chess puzzles. "
    "After that, compare the water cycle with the carbon cycle, describe how a bicycle gear works, "
    "give three tips for growing tomatoes on a balcony, explain what inflation means for savings, "
    "and tell a short story about a lighthouse keeper who finds a message in a bottle that was "
    "written by her grandmother sixty years earlier, ending with a question for the reader."
)


# The lane that holds vLLM and SGLang servers: the integration tier (its one cluster), then the
# system files that start servers of their own. One xdist worker runs a lane, in collection
# order, so these files start only after the cluster is torn down: 24 GiB holds one set of
# engine servers, never two (`make test`, tests/suite.py).
ENGINE_SERVER_LANE = "engine-servers"
SERVER_FILES = {
    "tests/system/test_decoders_consume_pages.py",
    "tests/system/test_prefix_cache_servers.py",
    "tests/system/test_sglang_window.py",
    "tests/system/test_vllm_window.py",
}


# Files that start three or more agents of the embedded model (or a browser beside two): beside
# the cluster's agents and engine servers they would pass 24 GiB. They come last in their lane
# and start only once no cluster is up (CLUSTER_LOCK: the cluster holds it exclusively, these
# share it), so they run beside the engine-server lane's later files instead.
APART_FILES = {
    "tests/system/test_agent_budget.py",
    "tests/system/test_discovery.py",
    "tests/system/test_panel_ui.py",
    "tests/system/test_pools.py",
    "tests/system/test_up_restart.py",
}
CLUSTER_LOCK = Path(tempfile.gettempdir()) / f"tandem-test-cluster-{os.getuid()}.lock"
_apart_lock = None  # this process's shared hold on CLUSTER_LOCK, once it runs an apart file

# The engine-server lane is the suite's critical path; the other lane has minutes to spare (it
# waits out the cluster before APART_FILES). While the engine-server lane runs a step that keeps
# both cores busy (the cluster's start, four engine servers loading at once: 88 s on a quiet
# machine, 195 s beside the other lane's tests; test_directions's and test_agreement's decoders
# asked side by side), it holds FIRST_LOCK, and the other lane starts no new test meanwhile. Only
# these: each wait moves the other lane's files later, and 24 GiB holds the cluster, test_faults's
# peer kills (two more agents of the embedded model) and one such file of the other lane, not
# two: a run that held test_load's and test_faults's steps too overlapped them and the machine
# stalled for 5 minutes. make test's summary says when each lane ended.
# One lock per run (xdist's run id): another run's lanes, or a test run by hand beside them, never wait.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
FIRST_LOCK = Path(tempfile.gettempdir()) / f"tandem-test-first-{os.getuid()}-{_RUN}.lock" if _RUN else None


@contextmanager
def lane_first():
    """The block runs with the other lane between tests (see FIRST_LOCK); outside xdist, as is."""
    if FIRST_LOCK is None:
        yield
        return
    with FIRST_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file lets go


def wait_while_a_lane_goes_first() -> None:
    if FIRST_LOCK is not None:
        with FIRST_LOCK.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # blocks while lane_first() holds it; let go at once


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] in APART_FILES)  # stable: otherwise as collected


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outside pytest-timeout's wrapper: the wait is not the test's
def pytest_runtest_protocol(item, nextitem):
    global _apart_lock
    path = item.nodeid.split("::", 1)[0]
    if lane_of(path) != ENGINE_SERVER_LANE:
        wait_while_a_lane_goes_first()
    if _apart_lock is None and path in APART_FILES:
        _apart_lock = CLUSTER_LOCK.open("a")
        fcntl.flock(_apart_lock, fcntl.LOCK_SH)  # blocks while a cluster is up; held until this process ends
    return (yield)


def pytest_configure(config):
    config.addinivalue_line("markers", "prerequisite(available, reason): tests/prerequisites.py requires()")
    config.addinivalue_line(
        "markers", "quiet: times the machine itself; runs in the serial pass after the lanes (tests/suite.py)"
    )
    if not hasattr(config, "workerinput"):  # the controller: xdist's workers inherit the run's one seed
        os.environ["FUZZ_SEED"] = str(run_seed())


@pytest.hookimpl(trylast=True)  # after --durations' table, so it sits just above the short summary
def pytest_terminal_summary(terminalreporter):
    """A failed test's account of the processes it used (tests/integration/conftest.py adds the
    cluster's), again at the end: CI shows only the head and the tail of pytest's output, and a
    failure's own report sits in between. Read from the reports, which xdist's workers send to
    the controller with their sections."""
    for report in terminalreporter.stats.get("failed", []):
        for title, text in report.sections:
            if title.endswith("when it failed"):
                terminalreporter.write_sep("-", f"{title.removesuffix(' when it failed')} when {report.nodeid} failed")
                terminalreporter.write_line(text)


def lane_of(path: str) -> str:
    """The unit of work one xdist worker takes whole: the engine-server lane, or the file itself
    (its module fixtures start once, on one worker)."""
    if path.startswith("tests/integration/") or path in SERVER_FILES:
        return ENGINE_SERVER_LANE
    return path


def pytest_xdist_make_scheduler(config, log):
    """xdist's loadscope scheduling with lane_of as the scope, the units handed out in collection
    order: the engine-server lane first, APART_FILES last (pytest_collection_modifyitems). xdist
    otherwise hands out the units with the most tests first, which put test_agent_budget early:
    its worker then waited out the whole cluster on CLUSTER_LOCK, one lane idle for 34 minutes.
    (Not `--dist loadgroup` with xdist_group marks: xdist 3.8 groups by rewriting an item's
    `_nodeid`, which pytest 9 no longer reads, so every test went to whichever worker was free,
    the integration tier's with it: two clusters, out of memory.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid.split("::", 1)[0])

    config.option.loadscopereorder = False
    return Lanes(config, log)


def pytest_report_header(config):
    return f"fuzz seed: {run_seed()} (FUZZ_SEED={run_seed()} reproduces this run)"


def pytest_runtest_logfinish(nodeid, location):
    """When each test ended, per xdist worker (reports/lane-gw0.log …): tests/suite.py's summary
    tells from them when each lane ended, so how far apart the lanes finished."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and REPORTS.is_dir():
        with (REPORTS / f"lane-{worker}.log").open("a") as log:
            log.write(f"{time.time():.1f} {nodeid}\n")


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures are set up
def pytest_runtest_setup(item):
    prerequisites.check(item)


def run(coro):
    return asyncio.run(coro)


async def collect(agen) -> list:
    return [item async for item in agen]


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    path, _ = fetch(data_dir())
    return path


def in_process_engines(model: Path, **load):
    """Both in-process engines on `model`, prefix caches off (tests that compare pages and outputs
    across runs see every run compute what it claims to; test_prefix_cache.py turns them on);
    closed after. For a fixture to `yield from`."""
    from engine_adapters import load_adapter

    loaded = {name: load_adapter(name, model, **load) for name in ("torch", "mlx")}
    for adapter in loaded.values():
        adapter.set_prefix_cache_bytes(0)
    yield loaded
    for adapter in loaded.values():
        adapter.close()


@pytest.fixture(scope="session")
def engines(smol_dir):
    """Both in-process engines on the embedded model, loaded once per test session."""
    yield from in_process_engines(smol_dir)


@pytest.fixture(scope="session")
def long_ids(engines) -> list[int]:
    ids = engines["torch"].chat_token_ids([{"role": "user", "content": LONG_TEXT}])
    assert len(ids) >= 193, len(ids)
    return ids


_OWN_GREEDY: dict = {}


def own_greedy(engine, ids: list[int], max_tokens: int = 32) -> list[int]:
    """An in-process engine's own greedy output (EOS ignored), computed once per session: the
    cross-engine tests of torch, MLX, vLLM and SGLang all compare P/D against the same runs."""
    key = (engine.name, tuple(ids), max_tokens)
    if key not in _OWN_GREEDY:
        from engine_adapters.base import EngineRequest
        from tandem_protocol.sampling import SamplingParams

        request = EngineRequest(
            f"own-{len(_OWN_GREEDY)}", list(ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
        _OWN_GREEDY[key] = run(collect(engine.generate(request)))
    return _OWN_GREEDY[key]


def write_report(name: str, data: dict) -> Path:
    REPORTS.mkdir(exist_ok=True)
    path = REPORTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


# A tiny Llama with SmolLM2-135M's head_dim (64) and 3 query heads per KV head: 4 layers of one KV
# head, not 30 of 3. For tests that compare an engine with itself bit for bit.
TINY_LLAMA = dict(
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=64,
)


@pytest.fixture(scope="session")
def tiny_dir(smol_dir, tmp_path_factory) -> Path:
    """One tiny random-weight Llama (TINY_LLAMA, SmolLM2's tokenizer and chat template), seeded:
    the same weights, so the same answers, every run. A SmolLM2 token costs 30 layers of 3 KV
    heads; this one, 4 of 1. For tests whose assertions hold whatever the weights (no text, no
    calibrated tolerance, no timing of the model's own compute): `tiny_engines` in process, and
    the agents of system tests that assert routes, bytes on the wire, pins and budgets."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny") / "tiny", "llama", smol_dir, seed=5, max_position_embeddings=2048, **TINY_LLAMA
    )


@pytest.fixture(scope="session")
def tiny_engines(tiny_dir):
    """Both in-process engines on `tiny_dir`, loaded once per session: for the tests whose
    assertion is one engine equal to itself bit for bit (same-engine P/D, prefix caches), which
    depends on the page plumbing, not on the weights."""
    yield from in_process_engines(tiny_dir, context_length=2048)


def make_tiny_checkpoint(path: Path, model_type: str, tokenizer_from: Path, seed: int = 0, **overrides) -> Path:
    """A small random-weight checkpoint that transformers and mlx-lm both load (FP16 safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=49152,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        initializer_range=0.2,
    )
    settings.update(overrides)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float16)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, path / name)
    return path


def prompt(ids: list[int], n: int) -> list[int]:
    """The first n ids of a long prompt (n <= len(ids))."""
    assert n <= len(ids)
    return list(ids[:n])


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
