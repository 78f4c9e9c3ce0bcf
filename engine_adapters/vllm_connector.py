"""Tandem's KV connector for vLLM: runs inside vLLM's processes and moves canonical pages between
vLLM's paged KV cache and the Tandem agent that supervises this vLLM (engine_adapters/vllm_adapter.py).

Loaded by vLLM through `kv_transfer_config = {"kv_connector": "TandemConnector",
"kv_connector_module_path": "engine_adapters.vllm_connector", "kv_role": "kv_both"}` (vLLM's
documented out-of-tree connector contract, `KVConnectorBase_V1`). It imports only vLLM, torch and
the page format (engine_adapters/pages.py: numpy + xxhash), never the agent.

Requests opt in through `kv_transfer_params` (the transfer id is Tandem's room, since vLLM rewrites
request ids):

    {"tandem_room": R, "tandem_save": N}   prefiller: export the KV of prompt tokens [0, N) as
                                           pages, each as soon as the step that completes it ends
    {"tandem_room": R, "tandem_load": N}   decoder: load prompt tokens [0, N) from pages
                                           (N = prompt length - 1: vLLM computes the last token),
                                           but those vLLM's own prefix cache holds

A prefiller's pages leave from a sender thread of the worker, one per export, that copies each
finished page out of its block and writes it with a blocking `sendall`: the agent reads a room's
next page only when its handoff's staging window has room, so a write may wait for seconds (a slow
link to the decoder), and vLLM's step loop, which computes every other request, must never wait
with it. The step loop only says which pages are ready (`wait_for_save`, at the end of each step:
they are in the cache then). The request's blocks stay allocated until its pages are written, as
vLLM's own P/D connectors keep theirs: `request_finished` delays their freeing, and the worker
reports the request in `finished_sending` (`get_finished`) once the thread will read no block more.
vLLM keeps stepping while such a request remains (`Scheduler.has_finished_requests`), with nothing
to compute: those steps sleep on the threads' wake-up pipe (and the loads' sockets, below) instead
of spinning. An export stops at once, its request reported as soon as vLLM finished it, when the
agent closes the room's connection (a cancel: the write fails), when vLLM aborts the request (the
connection is shut, which wakes a blocked write) and when vLLM preempts it (its blocks are taken
back at once: the export is cut short, the agent sees a truncated room).

A decoder's prefix: when vLLM first schedules a load, the scheduler side tells the agent how many
leading prompt tokens vLLM's prefix cache holds (a `matched` connection: whole 64-token blocks),
so the agent asks the prefiller only for the pages after them (a delta handoff). vLLM loads from
where its cache ends; pages before that (the agent sends from where it was told) are read and
dropped. Should vLLM evict part of that prefix before the request gets its blocks, pages between
would never come: then it loads nothing and computes past what it still holds itself.

The agent side of the bridge (engine_adapters/bridge.py) is a unix socket (path in
TANDEM_VLLM_BRIDGE). Per room, one connection: a JSON line `{"op": "export"|"import", "room": R,
"tokens": N}`, then page frames in order (engine_adapters/pages.py framing, checksummed). An
export connection ends after its last page, or early when its export stopped; an import
connection that ends early is a failed load: its blocks are reported to vLLM, whose
`kv_load_failure_policy` ("fail", the default) fails the request — no silent recompute.

Layouts: on CPU, detected at start-up by writing a probe through vLLM's own cache-writing kernel
and reading it back (`CacheLayout`); on GPUs, the strided [blocks, heads, tokens, K|V] views of
vLLM 0.32 (`StridedLayout`). Anything else is refused with a clear error.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from engine_adapters import bridge
from tandem_protocol.pages import KVPage, PageGeometry, make_page

logger = init_logger("vllm.tandem_connector")  # a vllm.* logger, so worker processes' lines show

BRIDGE_ENV = bridge.VLLM_BRIDGE_ENV
# How long a step that computes nothing waits for pages before it lets vLLM look for new requests.
IDLE_WAIT_SECONDS = 0.02


# ---- what the scheduler tells the workers each step ------------------------------------------
@dataclass
class SaveItem:
    req_id: str
    room: str
    block_ids: list[int]
    computed: int  # prompt tokens whose KV is in the cache once this step ends
    tokens: int  # how many tokens to export in all


@dataclass
class LoadItem:
    req_id: str
    room: str
    block_ids: list[int]
    tokens: int
    first: int = 0  # the first page to write: vLLM's own cache holds the ones before it


@dataclass
class TandemMeta(KVConnectorMetadata):
    saves: list[SaveItem] = field(default_factory=list)
    loads: list[LoadItem] = field(default_factory=list)
    # prefills vLLM finished, whose blocks wait for their pages to be written (True: cut short,
    # an abort or an error: the export stops where it is)
    finished: dict[str, bool] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)  # prefills whose blocks vLLM took back
    idle: bool = False  # the step computes nothing: the worker may wait for pages


class PageLoad:
    """One request's pages coming in over its bridge connection, written into the blocks vLLM
    allocated as each one completes."""

    def __init__(self, item: LoadItem, conn: socket.socket, block_size: int):
        self.item, self.reader = item, bridge.ItemReader(conn)
        self.written, self.pages = item.first, -(-item.tokens // block_size)

    def fileno(self) -> int:
        return self.reader.fileno()

    @property
    def done(self) -> bool:
        return self.written == self.pages


class PageExport:
    """One prefill's pages leaving over its bridge connection, in order, from a thread of its own
    (the module docstring says why). The step loop offers the pages that are ready; the thread
    copies each out of its block under the lock and writes it outside it, so `stop` waits for at
    most one copy, and once `stopped` is set no block of the request is read again."""

    def __init__(self, connector: TandemConnector, item: SaveItem):
        self.connector, self.req_id, self.room, self.tokens = connector, item.req_id, item.room, item.tokens
        self.pages = -(-item.tokens // connector.block_size)
        self.block_ids: list[int] = []
        self.ready = self.sent = 0  # pages in the cache / written to the socket
        self.step_done: Any = None  # GPU: an event recorded after the step that made them ready
        self.finished = False  # vLLM finished the request: its blocks wait for this export
        self.stopped = False  # no block is read any more: every page written, or the export ended
        self.conn: socket.socket | None = None
        self.lock = threading.Condition()
        threading.Thread(target=self._run, name=f"tandem-export-{self.room[:8]}", daemon=True).start()

    def offer(self, block_ids: list[int], ready: int, step_done: Any) -> None:
        with self.lock:
            self.block_ids, self.ready, self.step_done = block_ids, ready, step_done
            self.lock.notify()

    def stop(self) -> None:
        """End the export now: no page more is read, and a write waiting on the agent fails."""
        with self.lock:
            self.stopped = True
            self.lock.notify()
            if self.conn is not None:
                try:
                    self.conn.shutdown(socket.SHUT_RDWR)  # wakes a sendall blocked in the thread
                except OSError:
                    pass

    def _next_frame(self) -> bytes | None:
        with self.lock:
            while not self.stopped and self.sent == self.ready:
                self.lock.wait()
            if self.stopped:
                return None
            if self.step_done is not None:
                self.step_done.synchronize()  # the step's kernels have written the pages
            P, index = self.connector.block_size, self.sent
            return self.connector._page_frame(self.block_ids[index], index, min(P, self.tokens - index * P))

    def _run(self) -> None:
        conn = None
        try:
            conn = self.connector._connect("export", self.room, self.tokens)
            with self.lock:
                self.conn = conn
            while self.sent < self.pages and (frame := self._next_frame()) is not None:
                conn.sendall(frame)  # blocks while the agent's window is full
                with self.lock:
                    self.sent += 1
        except OSError as e:  # the agent closed the room (a cancel), or is gone
            if not self.stopped:
                logger.warning("Tandem export of room %s stopped at page %d: %s", self.room, self.sent, e)
        except Exception:
            logger.exception("Tandem export of room %s failed", self.room)
        finally:
            with self.lock:
                self.stopped, self.conn = True, None
            if conn is not None:
                conn.close()
            self.connector._wake()


# ---- cache layouts -----------------------------------------------------------------------------
def cache_layout(tensor: torch.Tensor, block_size: int):
    """The reader/writer for this vLLM's per-layer cache views, or a clear refusal."""
    if tensor.device.type == "cpu":
        return CacheLayout(tensor, block_size)
    return StridedLayout(tensor, block_size)


class StridedLayout:
    """vLLM 0.32 GPU backends (FlashAttention, FlashInfer, ...): every layer is a logical
    [blocks, kv_heads, block_size, 2*head_dim] view, K then V in the last dim, with the physical
    axis order of the chosen KVCacheLayout carried by the view's strides (FlashAttention's own
    split: `kv_cache.transpose(1, 2).split(head_size, dim=-1)`). Reads and writes go through the
    view, so every stride order vLLM can choose is handled the same way."""

    isa = "strided"

    def __init__(self, tensor: torch.Tensor, block_size: int):
        if tensor.dim() != 4 or tensor.shape[2] != block_size or tensor.shape[3] % 2:
            raise RuntimeError(
                f"unknown vLLM KV cache view {tuple(tensor.shape)} (expected [blocks, heads, "
                f"{block_size}, 2*head_dim]): this vLLM version is not supported"
            )
        if tensor.dtype != torch.float16:
            raise RuntimeError(
                f"Tandem moves FP16 pages; this vLLM caches KV as {tensor.dtype} "
                "(start it with --dtype float16 and no KV quantization)"
            )
        self.heads, self.block_size, self.head_dim = tensor.shape[1], block_size, tensor.shape[3] // 2

    def read(self, cache: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.head_dim
        return cache[block, :, :, :d].permute(1, 0, 2).cpu(), cache[block, :, :, d:].permute(1, 0, 2).cpu()

    def write(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        d = self.head_dim
        slots = slots.to(cache.device)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        cache[blocks, :, offsets, :d] = k.to(cache.device)
        cache[blocks, :, offsets, d:] = v.to(cache.device)


class CacheLayout:
    """vLLM CPU_ATTN, "vec" ISA: per layer [blocks, kv_heads, block_size, 2*head_dim] FP16; per
    (block, head) the first half is K transposed [head_dim][block_size], the second V
    [block_size][head_dim]. Writes go through vLLM's `cpu_attn_reshape_and_cache`."""

    def __init__(self, tensor: torch.Tensor, block_size: int):
        nb, heads, bs, two_d = tensor.shape
        if tensor.dtype != torch.float16 or tensor.device.type != "cpu" or bs != block_size or two_d % 2:
            raise RuntimeError(
                f"Tandem's vLLM connector reads FP16 CPU_ATTN caches [blocks, heads, {block_size}, "
                f"2*head_dim]; this cache is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"
            )
        self.heads, self.block_size, self.head_dim = heads, bs, two_d // 2
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.isa = _get_attn_isa(torch.float16, bs, self.head_dim)
        if self.isa != "vec":
            raise RuntimeError(
                f"vLLM packs this CPU's KV cache with the {self.isa!r} kernel layout, which Tandem "
                "cannot read yet (only 'vec', AVX2/AVX-512 FP16); refusing rather than moving garbage"
            )
        self._probe()

    def read(self, cache: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one block as [block_size, heads, head_dim]."""
        flat = cache.view(cache.shape[0], self.heads, -1)[block]
        half = self.block_size * self.head_dim
        k = flat[:, :half].view(self.heads, self.head_dim, self.block_size).permute(2, 0, 1)
        v = flat[:, half:].view(self.heads, self.block_size, self.head_dim).permute(1, 0, 2)
        return k, v

    def write(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write K, V [tokens, heads, head_dim] at `slots` with vLLM's own kernel."""
        import vllm._custom_ops as ops

        nb = cache.shape[0]
        key_cache, value_cache = cache.view(nb, self.heads, self.block_size * 2, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), key_cache, value_cache, slots, self.isa)

    def write_block(self, caches: list[torch.Tensor], block: int, kv: torch.Tensor) -> None:
        """A whole page, kv [layers][K,V][block_size][heads][head_dim], into `block` of every
        layer: packed into the kernel's layout on the host in one copy, then one copy per layer.
        The kernel writes slot by slot, three calls a layer: 90 a page, most of its import time."""
        n, _, bs, h, d = kv.shape
        k_t = kv[:, 0].permute(0, 2, 3, 1).reshape(n, h, d * bs)  # K transposed per (block, head)
        v = kv[:, 1].permute(0, 2, 1, 3).reshape(n, h, bs * d)
        packed = torch.cat([k_t, v], dim=2)
        for i, cache in enumerate(caches):
            cache.view(cache.shape[0], h, -1)[block].copy_(packed[i])

    def _probe(self) -> None:
        """Write random K/V through the kernel into a scratch cache and read them back; write
        them again with `write_block` and compare the bytes."""
        scratch = torch.zeros(2, self.heads, self.block_size, 2 * self.head_dim, dtype=torch.float16)
        k = torch.randn(self.block_size, self.heads, self.head_dim).half()
        v = torch.randn(self.block_size, self.heads, self.head_dim).half()
        self.write(scratch, k, v, torch.arange(self.block_size, 2 * self.block_size, dtype=torch.long))
        rk, rv = self.read(scratch, 1)
        packed = torch.zeros_like(scratch)
        self.write_block([packed], 1, torch.stack([k, v])[None])
        if not (torch.equal(rk, k) and torch.equal(rv, v) and torch.equal(packed, scratch)):
            raise RuntimeError(
                "vLLM's CPU KV cache layout is not the one Tandem reads (probe mismatch): "
                "this vLLM version is not supported"
            )


# ---- the connector ---------------------------------------------------------------------------
class TandemConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.bridge = os.environ.get(BRIDGE_ENV, "")
        # scheduler side
        self._saves: dict[str, dict] = {}  # req_id -> {"room", "tokens", "blocks", "computed", "cut"}
        self._finished_saves: dict[str, bool] = {}  # req_id -> cut short, for the next step's workers
        self._matched: dict[str, int] = {}  # req_id -> the cached prompt tokens the agent was told of
        self._new_loads: list[LoadItem] = []
        # worker side
        self._layers: list[torch.Tensor] = []
        self._layout: CacheLayout | StridedLayout | None = None
        self._exports: dict[str, PageExport] = {}  # req_id -> its pages leaving
        self._wake_r, self._wake_w = -1, -1  # the export threads' wake-up pipe (register_kv_caches)
        self._loads: dict[str, PageLoad] = {}  # req_id -> its pages coming in
        self._loaded: set[str] = set()
        self._failed_blocks: set[int] = set()

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        tokens = int(params.get("tandem_load") or 0)
        if not tokens:
            return 0, False
        told = self._matched.get(request.request_id)
        if told is None:  # the first time vLLM looks at the request: the agent waits to hear this
            told = self._matched[request.request_id] = num_computed_tokens
            self._tell_matched(params["tandem_room"], num_computed_tokens)
        if num_computed_tokens < told:
            return 0, False  # evicted since: the pages in between never come, so vLLM computes
        if tokens - num_computed_tokens > 0:
            return tokens - num_computed_tokens, True  # loaded on vLLM's step loop, between steps
        return 0, False

    def _tell_matched(self, room: str, tokens: int) -> None:
        try:
            bridge.connect(self.bridge, "matched", room, tokens=tokens).close()
        except OSError as e:  # the agent is gone: its request ends with it
            logger.warning("Tandem could not tell room %s its cached prefix: %s", room, e)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        room = params.get("tandem_room")
        if not room:
            return
        if params.get("tandem_load") and num_external_tokens > 0:
            tokens = int(params["tandem_load"])
            first = (tokens - num_external_tokens) // self.block_size  # vLLM's own hit: whole blocks
            self._new_loads.append(LoadItem(request.request_id, room, list(blocks.get_block_ids()[0]), tokens, first))
        if params.get("tandem_save") and request.request_id not in self._saves:
            self._saves[request.request_id] = {"room": room, "tokens": int(params["tandem_save"]), "blocks": []}

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = TandemMeta(
            loads=self._new_loads,
            finished=self._finished_saves,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._new_loads, self._finished_saves = [], {}
        for req_id in scheduler_output.preempted_req_ids or ():
            save = self._saves.get(req_id)
            if save is not None and not save.get("cut"):  # its blocks are gone: the export ends
                save["cut"] = True  # and does not start again when the request resumes
                meta.preempted.append(req_id)
        steps = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            save = self._saves.get(new.req_id)
            if save is not None:
                save["blocks"] = list(new.block_ids[0])
                save["computed"] = new.num_computed_tokens + steps.get(new.req_id, 0)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            save = self._saves.get(req_id)
            if save is not None:
                if cached.new_block_ids[i] is not None:
                    save["blocks"] += list(cached.new_block_ids[i][0])
                save["computed"] = cached.num_computed_tokens[i] + steps.get(req_id, 0)
        for req_id, save in self._saves.items():
            if req_id in steps and "computed" in save and not save.get("cut"):
                meta.saves.append(
                    SaveItem(req_id, save["room"], list(save["blocks"]), save["computed"], save["tokens"])
                )
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        save = self._saves.pop(request.request_id, None)
        if save is None or save.get("cut"):
            return False, None
        # a prefill: its blocks are freed once the worker says (finished_sending) its pages are
        # written, or its export stopped
        complete = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        self._finished_saves[request.request_id] = not complete
        return True, None

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        def layer_index(name: str) -> int:
            return next(int(p) for p in name.split(".") if p.isdigit())

        names = sorted(kv_caches, key=layer_index)
        self._layers = [kv_caches[n] for n in names]
        self._layout = cache_layout(self._layers[0], self.block_size)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        logger.info("Tandem connector: %d layers, %s layout, bridge %s", len(names), self._layout.isa, self.bridge)

    @property
    def geometry(self) -> PageGeometry:
        return PageGeometry(len(self._layers), self._layout.heads, self._layout.head_dim, self.block_size)

    def _connect(self, op: str, room: str, tokens: int) -> socket.socket:
        return bridge.connect(self.bridge, op, room, tokens=tokens)

    def wait_for_save(self) -> None:
        """The pages this step completed are in the cache: offer them to their exports' threads."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, TandemMeta) or not meta.saves:
            return
        P, step_done = self.block_size, None
        if self._layers[0].is_cuda:  # the thread reads only once the step's kernels are done
            step_done = torch.cuda.Event()
            step_done.record()
        for item in meta.saves:
            export = self._exports.get(item.req_id)
            if export is None:
                export = self._exports[item.req_id] = PageExport(self, item)
            ready = min(item.computed, item.tokens)
            export.offer(item.block_ids, ready // P if ready < item.tokens else export.pages, step_done)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """A preempted prefill's blocks are vLLM's again before this step writes them: its export
        ends (the agent sees a truncated room) and is not reported, its request being unfinished."""
        if isinstance(kv_connector_metadata, TandemMeta):
            for req_id in kv_connector_metadata.preempted:
                export = self._exports.pop(req_id, None)
                if export is not None:
                    export.stop()

    def _wake(self) -> None:
        """An export ended: a step waiting for it (`_receive`) goes on."""
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: the step loop is awake anyway
            pass

    def _page_frame(self, block: int, index: int, valid: int) -> bytes:
        kv = np.empty((len(self._layers), 2, valid, self._layout.heads, self._layout.head_dim), dtype="<f2")
        for i, cache in enumerate(self._layers):
            k, v = self._layout.read(cache, block)
            kv[i, 0] = k[:valid].numpy()
            kv[i, 1] = v[:valid].numpy()
        return bridge.page_frame(make_page(self.geometry, index, kv))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, TandemMeta):
            return
        for item in meta.loads:
            try:
                self._loads[item.req_id] = PageLoad(
                    item, self._connect("import", item.room, item.tokens), self.block_size
                )
            except OSError as e:
                self._end_load(item, f"cannot reach the Tandem agent's bridge: {e}")

    def _receive(self, wait: bool) -> None:
        """Write the pages that have come in. The loads run on vLLM's own step loop, not a thread
        of their own that had to win the GIL back from that loop after every socket read and
        kernel call. `wait`: the step computes nothing, so rather than step again at once (which
        spun a core while a request waited for its pages, or a finished prefill for its export),
        sleep until a page arrives or an export ends (or a short while, for new requests)."""
        deadline = time.monotonic() + IDLE_WAIT_SECONDS
        while True:
            for load in list(self._loads.values()):
                try:
                    self._write_arrived(load)
                except Exception as e:  # any failure fails the request (kv_load_failure_policy "fail")
                    self._end_load(load.item, str(e))
            left = deadline - time.monotonic()
            ended = any(e.finished and e.stopped for e in self._exports.values())
            if not wait or not (self._loads or self._exports) or self._loaded or ended or left <= 0:
                return
            ready, _, _ = select.select([*self._loads.values(), self._wake_r], [], [], left)
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)

    def _write_arrived(self, load: PageLoad) -> None:
        P, item = self.block_size, load.item
        for page in load.reader.read():
            index = load.written
            if isinstance(page, KVPage) and page.index < item.first:
                continue  # vLLM's own cache holds it
            if not isinstance(page, KVPage) or index == load.pages:
                raise ValueError(f"the agent sent more than room {item.room}'s {load.pages} pages")
            if (
                page.index != index
                or page.valid_tokens != min(P, item.tokens - index * P)
                or page.data.shape != self.geometry.page_shape
            ):
                raise ValueError(
                    f"page {page.index} ({page.valid_tokens} tokens, shape {page.data.shape}) "
                    f"does not fit slot {index} of a {item.tokens}-token load"
                )
            kv = torch.from_numpy(page.kv)  # [layers, 2, valid, heads, dim]
            block = item.block_ids[index]
            if page.valid_tokens == P and isinstance(self._layout, CacheLayout):
                self._layout.write_block(self._layers, block, kv)
            else:  # the last page of a prompt, or a GPU's layout: slot by slot
                slots = torch.arange(block * P, block * P + page.valid_tokens, dtype=torch.long)
                for i, cache in enumerate(self._layers):
                    self._layout.write(cache, kv[i, 0], kv[i, 1], slots)
            load.written += 1
        if load.done:
            try:
                load.reader.conn.sendall(bridge.imported_frame(time.time()))
            except OSError:
                pass  # the agent is gone: the request ends with it
            self._end_load(item)
        elif load.reader.ended:
            raise ConnectionError(f"the agent ended room {item.room}'s pages at {load.written} of {load.pages}")

    def _end_load(self, item: LoadItem, failure: str | None = None) -> None:
        """The load is over; a failed one's blocks are reported no later than its request id."""
        load = self._loads.pop(item.req_id, None)
        if load is not None:
            load.reader.conn.close()
        if failure is not None:
            logger.warning("Tandem load of room %s failed: %s", item.room, failure)
            self._failed_blocks.update(item.block_ids[item.first :])  # not the cached ones before
        self._loaded.add(item.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # whole pages leave in wait_for_save, after every layer of the step is written

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._get_connector_metadata()
        meta = meta if isinstance(meta, TandemMeta) else TandemMeta()
        sent = set()
        for req_id, cut in meta.finished.items():
            export = self._exports.get(req_id)
            if export is None:  # vLLM finished it before any page was offered
                sent.add(req_id)
            else:
                export.finished = True
                if cut:
                    export.stop()
        self._receive(wait=meta.idle)
        for req_id, export in list(self._exports.items()):
            if export.finished and export.stopped:  # no block of it is read again: they may go
                sent.add(req_id)
                del self._exports[req_id]
        done, self._loaded = self._loaded, set()
        return (sent or None), (done or None)

    def shutdown(self) -> None:
        for export in self._exports.values():
            export.stop()

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
