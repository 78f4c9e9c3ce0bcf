"""Tandem's transfer backend for SGLang's PD disaggregation: runs inside SGLang's processes and
moves canonical pages between SGLang's KV pool and the Tandem agent that supervises this SGLang
(engine_adapters/sglang_adapter.py), over the agent's bridge (engine_adapters/bridge.py).

SGLang has no registry for out-of-tree transfer backends (ENGINE_NOTES.md): the backend list is
the closed enum `TransferBackend` and the function `get_kv_class`. Its plugin mechanism (entry
point group `sglang.srt.plugins`, loaded in every SGLang process before arguments are parsed)
is the supported way in; `register` below is that entry point. It adds "tandem" to the enum and
to the `--disaggregation-transfer-backend` choices and wraps `get_kv_class` so "tandem" resolves
to the classes here, the way SGLang's own backends are built: a manager per scheduler, a sender
per prefill request, a receiver per decode request (SGLang's base classes, disaggregation/base).

    prefill  SGLang (`--disaggregation-mode prefill`) calls `send(page_indices)` as chunks of the
             prompt finish; send only queues the pages for the sender's thread, which reads
             each page out of its pool slots and writes it to the agent as a frame, in order.
             The agent reads a frame only when its staging window has room, so a write may
             block for long: on that thread, never on SGLang's scheduler loop. The slots stay
             the request's until the last page is written: SGLang frees a prefill's KV only
             once its sender's poll is Success (or Failed), which the thread reports after its
             last read of the pool. The whole prompt's KV leaves (the agent trims it for a
             recompute-last decoder); the first token comes back in SGLang's HTTP answer.
    decode   SGLang (`--disaggregation-mode decode`) allocates slots for the whole prompt and
             calls `send_metadata(page_indices, aux_index)`; a worker thread pulls pages from
             the agent as they arrive from the prefiller, writes them into those slots, then
             writes the prefiller's first token (and the room, which SGLang checks) into the
             metadata row, and only then reports Success. SGLang continues from that token and
             never recomputes (commit-first).

The bootstrap room (SGLang's 63-bit transfer id, sent in the /generate request) names the bridge
room. Any failure — the agent gone or closing the room (a cancel), a damaged page, a page that
does not fit — is a Failed poll with the reason, which SGLang turns into an aborted request and
freed slots. `abort` waits for a thread still reading or writing the pool (a sender's, a
receiver's), so slots are never reclaimed under a copy in flight.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
)

from engine_adapters import bridge
from engine_adapters.sglang_pool import MetadataRows, PoolPages
from tandem_protocol.model_dir import inspect_model
from tandem_protocol.pages import KVPage, make_page

logger = logging.getLogger("sglang.tandem_backend")

BRIDGE_ENV = bridge.SGLANG_BRIDGE_ENV
BACKEND = "tandem"


# ---- registration (the plugin entry point) --------------------------------------------------
def register() -> None:
    """Entry point `sglang.srt.plugins: tandem`: make `--disaggregation-transfer-backend tandem` work."""
    from sglang.srt.arg_groups.choices import add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    enum = utils.TransferBackend
    if BACKEND not in enum._value2member_map_:
        # Enums are closed by design; this adds one member the way Enum builds its own.
        member = object.__new__(enum)
        member._name_, member._value_ = "TANDEM", BACKEND
        type.__setattr__(enum, "TANDEM", member)
        enum._member_map_["TANDEM"] = member
        enum._value2member_map_[BACKEND] = member
        enum._member_names_.append("TANDEM")
        add_disagg_transfer_backend_choices([BACKEND])

    classes = {
        utils.KVClassType.MANAGER: TandemKVManager,
        utils.KVClassType.SENDER: TandemKVSender,
        utils.KVClassType.RECEIVER: TandemKVReceiver,
        utils.KVClassType.BOOTSTRAP_SERVER: TandemBootstrapServer,
    }

    def get_kv_class(original, transfer_backend, class_type):
        if getattr(transfer_backend, "value", transfer_backend) == BACKEND and class_type in classes:
            return classes[class_type]
        return original(transfer_backend, class_type)

    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", get_kv_class, HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.on_idle", on_idle, HookType.AROUND)


# ---- waiting for transfers without spinning -------------------------------------------------------
# SGLang's scheduler loop has no batch to run while a decode request waits for its pages (or a
# prefill's pages wait for the agent to take them), and is not idle either, so it loops at once
# (`time.sleep(0)`): a core spent polling, taken from the prefiller beside it on a small machine
# (a torch prefill of 2,360 tokens took 14.7 s instead of 8.1 s next to a waiting SGLang
# decoder). While a receiver or a sender is at work, the loop sleeps instead on SGLang's own
# request sockets and on a pipe each of them writes to when it ends.
IDLE_WAIT_MS = 20
_transferring: set = set()  # the receivers and senders at work in this process
_wake_r, _wake_w = os.pipe()
os.set_blocking(_wake_r, False)
os.set_blocking(_wake_w, False)


def on_idle(original, scheduler, *args, **kwargs):
    sleeper = getattr(scheduler, "idle_sleeper", None)
    if _transferring and sleeper is not None and not scheduler.is_fully_idle():
        poller = getattr(scheduler, "_tandem_poller", None)
        if poller is None:
            import zmq

            poller = scheduler._tandem_poller = zmq.Poller()
            for sock, flags in sleeper.poller.sockets:
                poller.register(sock, flags)
            poller.register(_wake_r, zmq.POLLIN)
        poller.poll(IDLE_WAIT_MS)
        try:
            os.read(_wake_r, 4096)
        except BlockingIOError:
            pass
    return original(scheduler, *args, **kwargs)


def _woken() -> None:
    try:
        os.write(_wake_w, b"\0")
    except BlockingIOError:  # the pipe is full: the scheduler is awake anyway
        pass


# ---- SGLang's backend classes -----------------------------------------------------------------
class TandemKVManager(BaseKVManager):
    """One per scheduler: the pool view and the bridge's address. There is no SGLang peer to
    discover: the peer is this machine's Tandem agent."""

    supports_role_switch = True
    supports_host_destination = False
    enable_staging = False
    enable_all_cp_ranks_for_transfer = False
    enable_deferred_decode_kv_release = False
    is_dummy_cp_rank = False
    attn_cp_size, attn_cp_rank = 1, 0

    def __init__(self, args: KVArgs, disaggregation_mode, server_args, is_mla_backend: bool | None = False):
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if is_mla_backend:
            raise ValueError("Tandem pages carry per-head K and V; MLA models are not supported")
        self.kv_args = args
        self.mode = getattr(disaggregation_mode, "value", str(disaggregation_mode))
        self.bridge_path = os.environ.get(BRIDGE_ENV, "")
        if not self.bridge_path:
            raise ValueError(f"the Tandem transfer backend needs {BRIDGE_ENV} (SGLang is started by a Tandem agent)")
        # the canonical geometry, read from the model's config as every Tandem engine does
        geometry = inspect_model(server_args.model_path).geometry
        self.pool = PoolPages(args, server_args.device, geometry)
        self.rows = MetadataRows(args, bool(getattr(server_args, "disaggregation_enable_kv_checksum", False)))
        # SGLang's decode queue asks each prefill address for its parallel layout; the agent is
        # one rank with no data parallelism.
        info = SimpleNamespace(dp_size=1, follow_bootstrap_room=True)
        self.prefill_info_table = _EveryAddress(info)
        self.transfer_infos: dict = {}
        logger.info(
            "Tandem backend (%s): %d layers, %d KV heads, head dim %d, pool on %s, bridge %s",
            self.mode,
            self.pool.layers,
            self.pool.heads,
            self.pool.head_dim,
            self.pool.device,
            self.bridge_path,
        )

    def register_to_bootstrap(self):
        pass

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        return True

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        return False  # every Tandem page is checksummed on the wire and on the bridge

    def clear_deferred_abort_state(self, *args, **kwargs) -> None:
        pass

    def teardown(self) -> None:
        pass


class _EveryAddress(dict):
    def __init__(self, info):
        super().__init__()
        self._info = info

    def get(self, key, default=None):
        return self._info

    def __getitem__(self, key):
        return self._info

    def __contains__(self, key):
        return True


class _Transfer:
    """What a sender and a receiver both report to SGLang: their state, and why they failed."""

    room: int
    state: int
    reason: str

    def poll(self) -> KVPoll:
        return self.state

    def poll_pp_consensus(self) -> KVPoll:
        return self.state

    def failure_exception(self):
        raise RuntimeError(f"Tandem transfer of room {self.room} failed: {self.reason or 'aborted'}")


_STOP = None  # ends a sender's queue of pages


class TandemKVSender(_Transfer, BaseKVSender):
    """Prefill side: SGLang hands pages over as chunks finish; a thread of the sender's own
    writes them to the agent, so a write the agent holds back blocks no one but this request."""

    def __init__(
        self,
        mgr: TandemKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
        *args,
        **kwargs,
    ):
        self.kv_mgr, self.room = mgr, bootstrap_room
        self.state, self.reason = KVPoll.WaitingForInput, ""
        self.pages_total: int | None = None
        self.pages_queued = self.pages_sent = self.bytes_sent = 0
        self.conn: socket.socket | None = None
        self._pages: queue.SimpleQueue = queue.SimpleQueue()  # (slot page, valid tokens), then _STOP
        self._aborted = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self.conn = bridge.connect(mgr.bridge_path, "export", str(bootstrap_room))
        except OSError as e:
            self._fail(f"cannot reach the Tandem agent's bridge: {e}")

    def _fail(self, reason: str) -> None:
        self.reason = reason
        self.state = KVPoll.Failed
        logger.warning("Tandem export of room %s failed: %s", self.room, reason)

    def init(self, num_kv_indices: int, aux_index: int | None = None):
        self.pages_total = num_kv_indices

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk

    def send(self, kv_indices, state_indices=None, num_kv_tokens: int | None = None, **kwargs):
        """Queue the pages for the sender's thread and return at once: SGLang's scheduler loop
        goes on with other requests while the agent takes these pages at its own pace."""
        if self.state == KVPoll.Failed:
            return
        indices = [int(i) for i in np.asarray(kv_indices).reshape(-1)]
        P = self.kv_mgr.pool.page_tokens
        tokens = num_kv_tokens if num_kv_tokens is not None else len(indices) * P
        for j, page in enumerate(indices):
            self._pages.put((page, min(P, tokens - j * P)))
        self.pages_queued += len(indices)
        if self.pages_total is not None and self.pages_queued >= self.pages_total:
            self._pages.put(_STOP)
        if self._thread is None:
            _transferring.add(self)
            self._thread = threading.Thread(target=self._write, daemon=True, name=f"tandem-send-{self.room}")
            self._thread.start()

    def _write(self) -> None:
        """Read each queued page from its slots and write it to the agent (blocking while the agent
        holds back); Success once the last page is written, after the last read of the pool."""
        pool = self.kv_mgr.pool
        try:
            while (item := self._pages.get()) is not _STOP and not self._aborted.is_set():
                page, valid = item
                frame = bridge.page_frame(make_page(pool.geometry, self.pages_sent, pool.read(page, valid)))
                self.conn.sendall(frame)
                self.pages_sent += 1
                self.bytes_sent += len(frame)
            if self._aborted.is_set():
                raise RuntimeError("aborted by SGLang")
            self._close()
            self.state = KVPoll.Success
        except Exception as e:  # the agent closed the room (a cancel) or went away; an abort
            self._close()
            self._fail("aborted by SGLang" if self._aborted.is_set() else f"the Tandem agent stopped reading: {e}")
        finally:
            _transferring.discard(self)
            _woken()  # SGLang polls its inflight queue at once, and frees the slots

    def _close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def mark_prefill_complete(self) -> None:
        pass

    def pop_decode_prefix_len(self) -> int:
        return 0

    def get_max_transfer_tokens(self) -> int | None:
        return None

    def get_transfer_metric(self):
        from sglang.srt.disaggregation.base.conn import KVTransferMetric

        return KVTransferMetric(transfer_total_bytes=self.bytes_sent)

    def abort(self):
        """Stop the thread and wait until it has stopped reading the pool: SGLang frees the slots
        next. A write the agent holds back is broken off at once (the socket is shut down)."""
        self._aborted.set()
        if self._thread is None:
            self._close()
        else:
            conn = self.conn
            if conn is not None:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._pages.put(_STOP)  # a thread waiting for the next chunk's pages
            self._thread.join()
        if self.state not in (KVPoll.Success, KVPoll.Failed):  # (the thread reported its own end)
            self._fail("aborted by SGLang")

    def clear(self):
        if self._thread is None:
            self._close()


class TandemKVReceiver(_Transfer, BaseKVReceiver):
    """Decode side: a worker thread fills the slots SGLang allocated, page by page as they arrive."""

    def __init__(self, mgr: TandemKVManager, bootstrap_addr: str, bootstrap_room: int | None = None, *args, **kwargs):
        self.kv_mgr, self.room = mgr, bootstrap_room
        self.state, self.reason = KVPoll.Bootstrapping, ""
        self.conclude_state: KVPoll | None = None
        self.abort_notified = False
        self.require_staging = False
        self.bootstrap_infos = None
        self._aborted = threading.Event()
        self._conn: socket.socket | None = None
        self._worker: threading.Thread | None = None

    @property
    def is_abort_release_safe(self) -> bool:
        return self._worker is None or not self._worker.is_alive()

    @property
    def supports_host_destination(self) -> bool:
        return False

    def init(self, prefill_dp_rank: int = 0, *args, **kwargs):
        if self.state == KVPoll.Bootstrapping:
            self.state = KVPoll.WaitingForInput

    def send_metadata(
        self, kv_indices, aux_index: int | None = None, state_indices=None, decode_prefix_len: int = 0, **kwargs
    ):
        """`kv_indices`: the slots of the pages after `decode_prefix_len` prompt tokens, which the
        decode-side radix cache holds (whole pages: the page size is Tandem's). The agent hears
        how many (a `matched` connection) and asks the prefiller only for the pages after them."""
        if self.state == KVPoll.Failed:
            return
        pages = [int(i) for i in np.asarray(kv_indices).reshape(-1)]
        first = int(decode_prefix_len) // self.kv_mgr.pool.geometry.page_tokens
        try:
            bridge.connect(self.kv_mgr.bridge_path, "matched", str(self.room), tokens=int(decode_prefix_len)).close()
        except OSError:
            pass  # the agent is gone: the import's own connection fails the request
        self.state = KVPoll.Transferring
        _transferring.add(self)
        self._worker = threading.Thread(
            target=self._receive, args=(pages, aux_index, first), daemon=True, name=f"tandem-receive-{self.room}"
        )
        self._worker.start()

    def _receive(self, pages: list[int], aux_index: int, first: int) -> None:
        pool = self.kv_mgr.pool
        try:
            self._conn = bridge.connect(self.kv_mgr.bridge_path, "import", str(self.room))
            stream = self._conn.makefile("rb")
            for index, slot_page in enumerate(pages, start=first):
                item = bridge.read_item(stream)
                while isinstance(item, KVPage) and item.index < first:  # the radix cache holds it
                    item = bridge.read_item(stream)
                if self._aborted.is_set():
                    raise RuntimeError("aborted by SGLang")
                if item is None or isinstance(item, int):
                    raise RuntimeError(f"the Tandem agent ended the pages at {index} of {first + len(pages)}")
                if item.index != index or item.data.shape != pool.geometry.page_shape:
                    raise RuntimeError(
                        f"page {item.index} of shape {item.data.shape} does not fit slot {index} "
                        f"(expected {pool.geometry.page_shape})"
                    )
                pool.write(slot_page, item.kv)
            self._conn.sendall(bridge.imported_frame(time.time()))
            first = bridge.read_item(stream)
            if not isinstance(first, int):
                raise RuntimeError("the Tandem agent sent no first token after the pages")
            if self._aborted.is_set():
                raise RuntimeError("aborted by SGLang")
            self.kv_mgr.rows.commit(aux_index, first, self.room)
            self.state = KVPoll.Success
        except Exception as e:  # any failure fails the request; SGLang frees its slots
            self.reason = str(e)
            logger.warning("Tandem import of room %s failed: %s", self.room, e)
            self.state = KVPoll.Failed
        finally:
            if self._conn is not None:
                self._conn.close()
            _transferring.discard(self)
            _woken()

    def abort(self):
        """Stop the worker and wait until it has stopped writing: SGLang frees the slots next."""
        self._aborted.set()
        if self._conn is not None:
            try:
                self._conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._worker is not None:
            self._worker.join()
        if self.state != KVPoll.Success:
            self.state = KVPoll.Failed
            self.reason = self.reason or "aborted by SGLang"
        self.conclude_state = self.state

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        pass

    def clear(self):
        pass


class TandemBootstrapServer(BaseKVBootstrapServer):
    """SGLang starts a bootstrap server on prefill nodes so decoders can find them; with Tandem
    the agent is every server's peer, so there is nothing to serve."""

    def __init__(self, host: str, port: int, *args, **kwargs):
        self.host, self.port = host, port

    def run(self):
        pass

    def close(self):
        pass
