"""The bridge: canonical pages between the agent's process and an engine running in its own
process (vLLM's connector, SGLang's transfer backend), over a private unix socket.

One connection per room. The engine side opens it with a JSON line
`{"op": "export"|"import", "room": R, ...}`, then:

    export  the engine writes page frames in order (engine_adapters/pages.py framing,
            checksummed) and closes the connection after its last page. The agent reads a
            page only once the request's staging window has room for it (`Room.grant`), so
            the engine's writes may wait for seconds: its plugin writes from a thread of its
            own and keeps the request's KV until each page is written;
    import  the agent writes page frames in order, then (for engines that continue from the
            prefiller's first token) one first-token frame, then shuts its side for writing.
            A connection that ends early is a failed load. Once every page is in its KV cache
            the engine writes back one imported frame (when, by its clock): the decoder's
            "last page imported" stage, which the agent cannot see from its side.
    matched an engine with a prefix cache of its own (vLLM, SGLang) says, once it schedules an import
            room's request, how many leading prompt tokens its cache holds (`"tokens": N`), and
            closes: the agent asks the prefiller only for the pages after them.

The ids in the frames (contract, room, token digest) are zero on this hop: the agent checked
them on the wire before a page gets here. This module imports no engine and no agent, so both
sides of the socket can use it.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import socket
import struct
import threading
from pathlib import Path

import numpy as np

from tandem_protocol.errors import FrameError
from tandem_protocol.pages import HEADER_SIZE, KVPage, decode_frame, decode_payload, encode_frame, parse_header

# The variables an adapter sets in its engine server's environment, where the engine's KV plugin
# (vllm_connector.py, sglang_backend.py) reads the bridge socket's path. Not settings: the
# adapter picks the path; they are how it tells its own child.
VLLM_BRIDGE_ENV = "TANDEM_VLLM_BRIDGE"
SGLANG_BRIDGE_ENV = "TANDEM_SGLANG_BRIDGE"

ZERO16 = b"\0" * 16
FIRST_TOKEN_MAGIC = b"TKVF"
_FIRST_TOKEN = struct.Struct("<4sq")
FIRST_TOKEN_SIZE = _FIRST_TOKEN.size
IMPORTED_MAGIC = b"TKVI"
_IMPORTED = struct.Struct("<4sd")
ACK_WAIT_SECONDS = 60  # an engine that neither acknowledges nor closes: the reader gives up
END = object()  # ends a room's queue


def page_frame_parts(page: KVPage) -> tuple[bytes, memoryview]:
    """A page as it crosses the bridge: the header, and a view of the page's own buffer (the
    agent's feeder sends both as they are, no copy of the payload on its event loop)."""
    return encode_frame(page, contract=ZERO16, handoff_id=ZERO16, tokens=ZERO16)


def page_frame(page: KVPage) -> bytes:
    """A page as it crosses the bridge, in one buffer."""
    return b"".join(page_frame_parts(page))


def first_token_frame(token: int) -> bytes:
    return _FIRST_TOKEN.pack(FIRST_TOKEN_MAGIC, token)


def imported_frame(at: float) -> bytes:
    """The engine's answer on an import connection: every page is in its cache, since `at`."""
    return _IMPORTED.pack(IMPORTED_MAGIC, at)


def read_item(stream) -> KVPage | int | None:
    """The next page or first token from a bridge connection's byte stream; None at its end.
    Raises FrameError on a damaged or truncated frame."""
    head = stream.read(4)
    if not head:
        return None
    if head == FIRST_TOKEN_MAGIC:
        rest = stream.read(FIRST_TOKEN_SIZE - 4)
        if len(rest) != FIRST_TOKEN_SIZE - 4:
            raise FrameError("the bridge ended inside a first-token frame")
        return _FIRST_TOKEN.unpack(head + rest)[1]
    head += stream.read(HEADER_SIZE - 4)
    if len(head) != HEADER_SIZE:
        raise FrameError("the bridge ended inside a page header")
    payload = stream.read(parse_header(head).payload_size)
    return decode_frame(head + payload)[1]


class ItemReader:
    """The pages and first token of a non-blocking bridge connection, as its bytes come: `read`
    takes what the socket holds now and returns the items that completed; `ended` once the agent
    closed it. For an engine's own step loop, which must not block on one request's pages. Bytes
    land straight in the part of the frame they belong to (`recv_into`): nothing is copied twice."""

    def __init__(self, conn: socket.socket):
        conn.setblocking(False)
        self.conn, self.ended = conn, False
        self._head = bytearray(HEADER_SIZE)
        self._expect("magic", memoryview(self._head)[:4])

    def fileno(self) -> int:  # for select()
        return self.conn.fileno()

    def _expect(self, part: str, target: memoryview, filled: int = 0) -> None:
        self._part, self._target, self._filled = part, target, filled

    def read(self) -> list[KVPage | int]:
        items = []
        while not self.ended:
            try:
                n = self.conn.recv_into(self._target[self._filled :])
            except (BlockingIOError, InterruptedError):
                break
            if n == 0:
                if self._part != "magic" or self._filled:
                    raise FrameError("the bridge ended inside a frame")
                self.ended = True
                break
            self._filled += n
            if self._filled == len(self._target) and (item := self._next_part()) is not None:
                items.append(item)
        return items

    def _next_part(self) -> KVPage | int | None:
        """The part being read is whole: expect the next one, or return the item it completes."""
        head = self._head
        if self._part == "magic":
            if head[:4] == FIRST_TOKEN_MAGIC:
                self._expect("first token", memoryview(head)[:FIRST_TOKEN_SIZE], 4)
            else:
                self._expect("header", memoryview(head), 4)
            return None
        if self._part == "header":
            self._header = parse_header(bytes(head))
            # np.empty, not bytearray: recv_into fills every byte, so zero-filling it is waste
            self._expect("payload", memoryview(np.empty(self._header.payload_size, np.uint8)))
            return None
        item = (
            _FIRST_TOKEN.unpack(bytes(head[:FIRST_TOKEN_SIZE]))[1]
            if self._part == "first token"
            else decode_payload(self._header, self._target)
        )
        self._expect("magic", memoryview(head)[:4])
        return item


def connect(path: str, op: str, room: str, **extra) -> socket.socket:
    """Open a room's connection (engine side)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    conn.sendall(json.dumps({"op": op, "room": room, **extra}).encode() + b"\n")
    return conn


class Room:
    def __init__(self, kind: str, tokens: int, loop: asyncio.AbstractEventLoop | None):
        self.kind, self.tokens, self.loop = kind, tokens, loop
        # import rooms: frames (bytes, or header and payload) for the engine, then END
        self.outgoing: queue.Queue = queue.Queue()
        self.imported_at: float | None = None  # import rooms: when the engine had every page
        # import rooms: the prompt tokens the engine's own prefix cache holds, once it says
        self.matched: asyncio.Future | None = loop.create_future() if loop and kind == "import" else None
        self.incoming: asyncio.Queue = asyncio.Queue()  # export rooms: pages from the engine, then END
        # export rooms: pages the agent has room for and the reader may take off the socket
        self._granted = threading.Semaphore(0)
        self.closed = False
        self.granted = self.delivered = 0  # export rooms: pages granted, and read so far

    def grant(self, pages: int = 1) -> None:
        """Let the reader take `pages` more pages off the engine's export connection."""
        self.granted += pages
        self._granted.release(pages)

    @property
    def waiting_pages(self) -> bool:
        """Whether the agent has room for a page the engine has not sent yet."""
        return self.granted > self.delivered

    def close_export(self) -> None:
        """The agent reads no more: a reader waiting for room stops, and closes the connection."""
        self.closed = True
        self._granted.release()

    def _wait_grant(self) -> bool:
        """The reader's wait for room for the next page; False once the room is closed."""
        self._granted.acquire()
        return not self.closed


class Bridge:
    """The agent's side: a unix socket (mode 0600) the engine connects to, one connection per room."""

    def __init__(self, path: Path, engine: str):
        self.path, self.engine = path, engine
        self.rooms: dict[str, Room] = {}
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path.unlink(missing_ok=True)
        self._server.bind(str(path))
        os.chmod(path, 0o600)
        self._server.listen(64)
        threading.Thread(target=self._accept, name=f"tandem-{engine}-bridge", daemon=True).start()

    def open(self, kind: str, room: str, tokens: int) -> Room:
        r = Room(kind, tokens, asyncio.get_running_loop())
        self.rooms[room] = r
        return r

    def close_room(self, room: str) -> None:
        r = self.rooms.pop(room, None)
        if r is not None and r.kind == "import":
            r.outgoing.put(END)  # a loader still waiting gets an early end: its load fails
        elif r is not None:
            r.close_export()

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
            if hello.get("op") == "matched" and room is not None and room.matched is not None:
                self._matched(room, int(hello.get("tokens") or 0))
                return
            if room is None or room.kind != hello.get("op"):
                return  # unknown room: the engine's load or export fails
            if room.kind == "import":
                self._feed(conn, room)
            else:
                self._collect(stream, room)

    @staticmethod
    def _matched(room: Room, tokens: int) -> None:
        def tell() -> None:
            if not room.matched.done():
                room.matched.set_result(tokens)

        room.loop.call_soon_threadsafe(tell)

    @staticmethod
    def _feed(conn: socket.socket, room: Room) -> None:
        while (item := room.outgoing.get()) is not END:
            try:
                for part in item if isinstance(item, tuple) else (item,):
                    conn.sendall(part)
            except OSError:
                return
        conn.settimeout(ACK_WAIT_SECONDS)
        try:
            # the engine must see the end now, not when the acknowledgement wait is over: a room
            # closed early (a damaged stream, a cancel) is a load it fails and frees at once
            conn.shutdown(socket.SHUT_WR)
            ack = conn.recv(_IMPORTED.size, socket.MSG_WAITALL)
        except OSError:
            return  # a failed or cancelled load: its request reports that
        if len(ack) == _IMPORTED.size and ack[:4] == IMPORTED_MAGIC:
            room.imported_at = _IMPORTED.unpack(ack)[1]

    def _collect(self, stream, room: Room) -> None:
        def deliver(item) -> None:
            if room.closed:  # nobody reads the room any more
                return
            try:
                room.loop.call_soon_threadsafe(room.incoming.put_nowait, item)
            except RuntimeError:  # its event loop closed as the room did
                pass

        try:
            while room._wait_grant() and (item := read_item(stream)) is not None:
                room.delivered += 1
                deliver(item)
            deliver(END)
        except Exception as e:  # a damaged frame from the engine ends the room with the reason
            deliver(FrameError(f"{self.engine} sent a bad page: {e}"))
