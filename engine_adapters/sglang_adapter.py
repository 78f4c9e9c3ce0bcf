"""SGLang as a Tandem engine: the adapter starts and supervises an SGLang server (its own process,
in its own virtual environment) in PD-disaggregation mode with Tandem's transfer backend
(engine_adapters/sglang_backend.py), and moves pages between the agent and that backend over
the bridge (engine_adapters/bridge.py).

    prefill  POST /generate {input_ids, sampling_params: {max_new_tokens: 1, …}, bootstrap_room}
             on SGLang in its prefill role: the backend sends each page as SGLang hands its
             chunk over; the answer carries SGLang's first token. SGLang exports the whole
             prompt; for a recompute-last decoder (vLLM) the adapter drops the last token.
    decode   POST /generate (streaming) on SGLang in its decode role, with the same room:
             SGLang allocates slots for the whole prompt, the backend fills them from the pages
             the prefiller sends, then hands SGLang the prefiller's first token; SGLang
             continues from it (commit-first: SGLang never recomputes a prompt token).
    generate the engine alone: a prefill on SGLang, then a decode on SGLang from those pages.

SGLang serves one PD role at a time; one server switches between them at run time
(`/pd_role_switch`, which needs the server idle). `RoleGate` lets requests of the current role
run together and makes a request of the other role wait, in arrival order, until those have
finished; then it switches (milliseconds: the KV pool is kept). A pair's node serves one role,
so switches are rare outside the engine-alone path.

Where SGLang comes from: the `sglang_python` setting (TANDEM_SGLANG_PYTHON, an interpreter with
sglang and this package installed), else the repository's `.venv-sglang` (`make sglang`).
"""

from __future__ import annotations

import asyncio
import collections
import json
import secrets
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from tandem_protocol.errors import TandemError
from tandem_protocol.handoff import FirstTokenMode, PrefillDone
from tandem_protocol.sampling import SERVER_FIELDS, TokenLogprobs

from .base import EngineRequest
from .bridge import END, SGLANG_BRIDGE_ENV, Room, first_token_frame
from .server_engine import ServerEngine, Transfer
from .server_process import ServerProcess, engine_python, free_port
from .settings import EngineSettings

SGLANG_VERSION = "0.5.23"  # the release the transfer backend was written against


def sglang_python(settings: EngineSettings) -> Path:
    return engine_python("SGLang", settings.sglang_python, "TANDEM_SGLANG_PYTHON", ".venv-sglang", "sglang")


def on_cpu(settings: EngineSettings) -> bool:
    """SGLang runs on an NVIDIA GPU where a driver answers, else on its CPU engine."""
    return (settings.sglang_device or ("cuda" if shutil.which("nvidia-smi") else "cpu")) == "cpu"


def sglang_environment(settings: EngineSettings) -> str:
    """'ok' text when SGLang's interpreter has the pinned release and sees Tandem's backend
    plugin, else what is wrong (the doctor)."""
    python = sglang_python(settings)
    code = (
        "import importlib.metadata as m\nprint(m.version('sglang'))\n"
        "print(any(e.name == 'tandem' for e in m.entry_points(group='sglang.srt.plugins')))"
    )
    run = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    out = run.stdout.split()
    if len(out) != 2:
        raise TandemError(
            f"{python} has no sglang installed (run `make sglang` on an NVIDIA machine; without one SGLang runs "
            "only as the tests' stand-in: `make sglang-cpu-test`, TANDEM_SGLANG_PYTHON=tests/sglang_cpu/.venv/bin/python)"
        )
    version, plugin = out
    if version != SGLANG_VERSION:
        raise TandemError(f"sglang {version} at {python}, but Tandem's backend is pinned to {SGLANG_VERSION}")
    if plugin != "True":
        raise TandemError(f"sglang at {python} does not see Tandem's transfer backend (run `make sglang`)")
    return f"sglang {version} (pinned) with Tandem's transfer backend at {python}"


class SGLangProcess(ServerProcess):
    """SGLang's HTTP server in PD-disaggregation mode with Tandem's transfer backend."""

    engine = "SGLang"

    def __init__(
        self,
        model_dir: Path,
        context_length: int,
        bridge: Path,
        log_path: Path,
        role: Callable[[], str],
        settings: EngineSettings,
    ):
        self.settings = settings
        super().__init__(log_path, settings.sglang_start_timeout)
        self.model_dir, self.context_length, self.bridge = model_dir, context_length, bridge
        self.role = role  # the role to start in: the one it last had, so a restart keeps it

    def pick_ports(self) -> None:
        super().pick_ports()
        self.bootstrap_port = free_port()  # SGLang binds a bootstrap port even when it serves nobody

    def command(self) -> list[str]:
        cmd = [
            str(sglang_python(self.settings)),
            "-m",
            "engine_adapters.sglang_launch",  # sglang.launch_server, given its key from the environment
            "--model-path",
            str(self.model_dir),
            "--served-model-name",
            "tandem",
            "--load-format",
            "safetensors",  # weights as data only, never a pickle
            "--dtype",
            "float16",
            "--page-size",
            "64",
            "--context-length",
            str(self.context_length),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disaggregation-mode",
            self.role(),
            "--disaggregation-transfer-backend",
            "tandem",
            "--disaggregation-bootstrap-port",
            str(self.bootstrap_port),
            "--enable-pd-role-switch",
            # the decode role keeps what its requests computed or imported (a radix cache), and
            # the prefiller is asked only for the pages past it; else nothing is shared
            *(
                ["--disaggregation-decode-enable-radix-cache"]
                if self.settings.prefix_caching
                else ["--disable-radix-cache"]
            ),
            "--enable-metrics",
            "--skip-server-warmup",
            # structured outputs with llguidance, as the in-process engines and vLLM (tandem_protocol/grammar.py)
            "--grammar-backend",
            "llguidance",
            "--constrained-json-disable-any-whitespace",
            # prefill in chunks of this many tokens, so pages leave while later chunks compute
            "--chunked-prefill-size",
            str(self.settings.sglang_chunk_tokens),
        ]
        if on_cpu(self.settings):
            cmd += [
                "--device",
                "cpu",
                "--attention-backend",
                "torch_native",
                "--disable-cuda-graph",
                "--sleep-on-idle",
                "--max-total-tokens",
                str(self.settings.sglang_kv_tokens),
                # a decoder's retraction backup otherwise pins a host pool with CUDA calls
                "--disaggregation-decode-retraction-backup",
                "cpu_tensor",
                # the overlap scheduler processes a chunk's result (and sends its pages) after the
                # next chunk's forward, which on a CPU runs before it returns: every chunk's
                # pages left one chunk late, a 512-token prompt's all at the end
                "--disable-overlap-schedule",
            ]
        return cmd

    def environment(self) -> dict[str, str]:
        env = {
            **super().environment(),
            SGLANG_BRIDGE_ENV: str(self.bridge),
            "SGLANG_PLUGINS": "tandem",
            # SGLang's decoder waits this long for a transfer to begin before failing it
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(self.settings.sglang_wait_s),
        }
        if on_cpu(self.settings):
            # the CPU engine; and no early send of a chunked prompt's cached prefix, which waits
            # on a CUDA event (the regular per-chunk send moves the same pages)
            env.update(SGLANG_USE_CPU_ENGINE="1", SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX="0")
        if self.settings.sglang_threads:
            env["OMP_NUM_THREADS"] = str(self.settings.sglang_threads)
        return env


class RoleGate:
    """Requests of the engine's current role run together; a request for the other role waits
    (and holds back later arrivals, so it is not starved) until the engine is idle, then the
    role is switched."""

    def __init__(self, role: str, switch):
        self.role, self._switch = role, switch
        self.active = 0
        self._waiting: collections.deque[object] = collections.deque()
        self._changed: asyncio.Condition | None = None
        self.switches = 0

    @asynccontextmanager
    async def hold(self, role: str):
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            token = object()
            self._waiting.append(token)
            try:
                await self._changed.wait_for(
                    lambda: self._waiting[0] is token and (self.role == role or self.active == 0)
                )
                if self.role != role:
                    await self._switch(role)
                    self.role = role
                    self.switches += 1
            finally:
                self._waiting.remove(token)
                self._changed.notify_all()
            self.active += 1
        try:
            yield
        finally:
            async with self._changed:
                self.active -= 1
                self._changed.notify_all()


class SGLangAdapter(ServerEngine):
    name = "sglang"
    engine_label = "SGLang"
    generate_path = "/generate"
    exports_whole_prompt = True  # a recompute-last decoder's share is cut from it (_relay_prefill)
    decoder_modes = (FirstTokenMode.COMMIT_FIRST,)
    reports_prefix = True  # its decode-side radix cache (sglang_backend.py tells the agent)

    def kv_budget_bytes(self) -> int:
        if on_cpu(self.settings):  # SGLang's own CPU pool (it sizes a GPU's pool itself)
            return self.settings.sglang_kv_tokens * self.geometry.token_bytes
        return super().kv_budget_bytes()

    def _server(self, run_dir: Path) -> SGLangProcess:
        self.gate = RoleGate(self.settings.sglang_role, self._switch_role)
        return SGLangProcess(
            self.model_dir,
            self.context_length,
            self.bridge.path,
            run_dir / "sglang.log",
            lambda: self.gate.role,
            self.settings,
        )

    async def _switch_role(self, role: str) -> None:
        """Ask SGLang to flip roles. It refuses while a finished request is still being retired,
        so an "is not idle" answer is retried for a few seconds (there is no event to wait on)."""
        deadline = time.monotonic() + 30
        while True:
            # decode_cuda_graph_memory_gb: the headroom SGLang must find before capturing decode
            # graphs on a flip to decode; 0 asks for none beyond what it needs (CPU has no graphs)
            body = {"new_role": role, "decode_cuda_graph_memory_gb": 0}
            try:
                async with self.http().post(self.server.url + "/pd_role_switch", json=body) as r:
                    answer = await r.json(content_type=None)
            except (aiohttp.ClientError, OSError) as e:  # down or restarting: the agent brings it back
                raise self._not_answering(e) from e
            if answer.get("success"):
                return
            message = str(answer.get("message", answer))
            if "not idle" not in message or time.monotonic() > deadline:
                raise TandemError(f"SGLang could not switch to its {role} role: {message}")
            await asyncio.sleep(0.02)

    async def engine_stats(self) -> dict:
        """SGLang's role, its token pool in use (from its /metrics: slots held by running,
        preallocated and transferring requests) and how often its process was restarted."""
        stats = await self.server_stats(
            {
                "sglang:num_used_tokens": "kv_tokens_used",
                "sglang:token_usage": "kv_cache_usage",
                "sglang:num_running_reqs": "running",
                "sglang:num_queue_reqs": "waiting",
                "sglang:num_decode_prealloc_queue_reqs": "decode_prealloc",
                "sglang:num_decode_transfer_queue_reqs": "decode_transfer",
                "sglang:num_prefill_inflight_queue_reqs": "prefill_inflight",
            }
        )
        return {**stats, "role": self.gate.role, "role_switches": self.gate.switches}

    def accelerator(self) -> dict:
        info = super().accelerator()
        device = "CPU" if on_cpu(self.settings) else "CUDA"
        return {**info, "name": f"{info['name']} (SGLang {SGLANG_VERSION}, {device})"}

    # ---- talking to SGLang --------------------------------------------------------------------
    def _role(self, role: str):
        return self.gate.hold(role)

    def _new_room(self) -> str:
        """SGLang's bootstrap room: a non-zero 63-bit id (SGLang treats 0 as "no metadata yet")."""
        return str(secrets.randbits(63) or 1)

    def _hand_over(self, room: Room, done: PrefillDone) -> None:
        # SGLang continues from the prefiller's first token: it follows the pages
        room.outgoing.put(first_token_frame(done.first_token))
        room.outgoing.put(END)

    def _body(self, req: EngineRequest, max_tokens: int, stream: bool, transfer: Transfer | None) -> dict:
        s = req.sampling
        params = {
            "max_new_tokens": max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": self._top_k(s),
            "stop_token_ids": list(s.stop_token_ids),
            "ignore_eos": s.ignore_eos,
            "skip_special_tokens": False,
        }
        params.update({name: getattr(s, name) for name in SERVER_FIELDS})
        if s.seed is not None:
            params["sampling_seed"] = s.seed
        if s.json_schema is not None:
            params["json_schema"] = s.json_schema
        if s.logit_bias:
            params["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
        logprobs = {} if s.logprobs is None else {"return_logprob": True, "top_logprobs_num": s.logprobs}
        # SGLang keys its radix cache by the salt too (RadixKey.cache_salt): it serves this request
        # only what the same salt cached, on either role
        salt = {"cache_salt": req.cache_salt} if req.cache_salt else {}
        return {
            "input_ids": req.token_ids,
            "sampling_params": params,
            **logprobs,
            **salt,
            "stream": stream,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": self.server.bootstrap_port,
            "bootstrap_room": int(transfer.room),  # every SGLang request is a transfer (see generate)
        }

    async def _answer_tokens(
        self, response, stream: bool, counts: EngineRequest | None
    ) -> AsyncIterator[tuple[int, TokenLogprobs | None]]:
        if not stream:
            data = await response.json()
            check_finish(data)
            count_cached(data, counts)
            for item in answer_tokens(data, 0):
                yield item
            return
        seen = 0
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            check_finish(data)
            count_cached(data, counts)
            items = answer_tokens(data, seen)
            for item in items:
                yield item
            seen += len(items)

    async def generate(self, req: EngineRequest) -> AsyncIterator[int]:
        """The engine alone: SGLang prefills, then SGLang decodes from its own pages."""
        prefill_req = EngineRequest(
            f"{req.request_id}/prefill",
            req.token_ids,
            req.sampling,
            FirstTokenMode.COMMIT_FIRST,
            cache_salt=req.cache_salt,
        )
        decode_req = EngineRequest(
            req.request_id, req.token_ids, req.sampling, FirstTokenMode.COMMIT_FIRST, cache_salt=req.cache_salt
        )
        decode_req.token_logprobs = req.token_logprobs  # what the request reports, tokens and their logprobs
        self.validate(req, generates=True)
        items = [item async for item in self.prefill(prefill_req)]
        req.cached_tokens = prefill_req.cached_tokens

        async def replay():
            for item in items:
                yield item

        async for token in self.decode(decode_req, replay()):
            yield token

    def cancel(self, request_id: str) -> bool:
        # a generate's prefill half runs under its own id
        return super().cancel(request_id) | super().cancel(f"{request_id}/prefill")


def answer_tokens(data: dict, seen: int) -> list[tuple[int, TokenLogprobs | None]]:
    """The tokens of an SGLang answer (or stream chunk) after the first `seen`, each with its
    log-probabilities where asked: `output_ids` and the meta_info lists, whose entries are
    [logprob, token id, text] (the lists are cumulative, as output_ids)."""
    ids = data.get("output_ids") or []
    meta = data.get("meta_info") or {}
    chosen, top = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
    out = []
    for i in range(seen, len(ids)):
        logprobs = None
        if chosen is not None and i < len(chosen) and chosen[i] is not None and chosen[i][0] is not None:
            alternatives = (top[i] or []) if top is not None and i < len(top) else []
            logprobs = TokenLogprobs(float(chosen[i][0]), tuple((int(t), float(lp)) for lp, t, *_ in alternatives))
        out.append((ids[i], logprobs))
    return out


def count_cached(data: dict, counts: EngineRequest | None) -> None:
    """The prompt tokens SGLang's radix cache served (its answer's meta_info)."""
    cached = (data.get("meta_info") or {}).get("cached_tokens")
    if counts is not None and cached is not None:
        counts.cached_tokens = int(cached)


def check_finish(data: dict) -> None:
    """SGLang reports a failed or aborted request inside a normal-looking answer."""
    if "error" in data:
        raise TandemError(f"SGLang failed the request: {data['error']}")
    reason = (data.get("meta_info") or {}).get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("type") == "abort":
        raise TandemError(f"SGLang aborted the request: {reason.get('message', reason)}")
