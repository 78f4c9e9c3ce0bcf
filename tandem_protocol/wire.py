"""The handoff stream: how pages travel from a prefiller agent to a decoder agent.

The body of `GET /v1/handoffs/{handoff_id}/pages` (HTTP/1.1 chunked transfer) is a sequence of frames:

    page frame   b"TKVP" + 84 more header bytes + payload     (engine_adapters/pages.py)
    final frame  b"TKVD" + u32 length + JSON {"first_token", "kv_tokens", "pages", "prefill_seconds",
                                              "finished_at", "cached_tokens", "first_logprobs"}
    error frame  b"TKVE" + u32 length + JSON {"code", "message"}
    heartbeat    b"TKVH" + u32 0         (P is still prefilling: the link is alive)

Page frames come in page order as prefill produces them; the stream ends after exactly one
final frame or one error frame. While P computes and has nothing to send it sends a heartbeat
every HEARTBEAT_SECONDS, so the decoder's stall timeout measures the link and P's agent, not
how long a prefill chunk takes (a server engine's can take longer than any sane timeout). A stream that stops before either is truncated, and the
decoder fails the request. `FrameReader` reassembles frames from arbitrary chunk boundaries,
copying each byte once, straight into the buffer that becomes the page.
"""

from __future__ import annotations

import json
import struct
from concurrent.futures import Executor

import numpy as np
import xxhash

from .errors import FrameError, TandemError
from .handoff import PrefillDone
from .pages import (
    HEADER_SIZE,
    MAGIC,
    RAW,
    FrameExpectation,
    FrameHeader,
    KVPage,
    check_expectation,
    checksum_finish,
    decode_payload,
    keeps_coded,
    parse_header,
)
from .sampling import TokenLogprobs

DONE_MAGIC = b"TKVD"
ERROR_MAGIC = b"TKVE"
HEARTBEAT_MAGIC = b"TKVH"
HEARTBEAT_SECONDS = 1.0  # the stall timeout's floor is twice this (node_agent/cli.py)
_LEN = struct.Struct("<I")
_MAX_JSON = 64 * 1024


class PeerError(TandemError):
    """The peer sent an error frame (or error line) instead of finishing."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _json_frame(magic: bytes, obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return magic + _LEN.pack(len(body)) + body


def done_frame(done: PrefillDone) -> bytes:
    return _json_frame(
        DONE_MAGIC,
        {
            "first_token": done.first_token,
            "kv_tokens": done.kv_tokens,
            "pages": done.pages,
            "prefill_seconds": done.prefill_seconds,
            "finished_at": done.finished_at,
            "cached_tokens": done.cached_tokens,
            # [logprob, [[token, logprob], ...]] when the request asked for log-probabilities
            "first_logprobs": None if done.first_logprobs is None else done.first_logprobs.to_json(),
        },
    )


def error_frame(code: str, message: str) -> bytes:
    return _json_frame(ERROR_MAGIC, {"code": code, "message": message})


HEARTBEAT_FRAME = HEARTBEAT_MAGIC + _LEN.pack(0)


class FrameReader:
    """Incremental parser: `feed(chunk)` returns the items completed by that chunk.

    `pool`: decode encoded pages (FP8, zstd) there; such a page is then returned as the
    `concurrent.futures.Future` of its KVPage, in its place among the items (raw pages, views of
    the received bytes, are always returned as pages)."""

    def __init__(self, expect: FrameExpectation | None, pool: Executor | None = None):
        self.expect = expect
        self.pool = pool
        self.finished = False
        self.bytes_read = 0
        self._head = bytearray()  # magic + header (or length + JSON) still being collected
        self._frame: np.ndarray | None = None  # the page frame being filled
        self._view: memoryview | None = None  # ... and a byte view of it
        self._header: FrameHeader | None = None  # ... and its parsed header
        self._filled = 0

    def _head_need(self) -> int:
        if len(self._head) < 4:
            return 4
        magic = bytes(self._head[:4])
        if magic == MAGIC:
            return HEADER_SIZE
        if magic in (DONE_MAGIC, ERROR_MAGIC, HEARTBEAT_MAGIC):
            if len(self._head) < 8:
                return 8
            length = _LEN.unpack_from(self._head, 4)[0]
            if length > _MAX_JSON:
                raise FrameError(f"control frame of {length} bytes is larger than {_MAX_JSON}")
            if magic == HEARTBEAT_MAGIC and length:
                raise FrameError(f"heartbeat frame with a {length}-byte body (it has none)")
            return 8 + length
        raise FrameError(f"unknown frame type {magic!r} in the page stream")

    def feed(self, chunk: bytes | memoryview) -> list[KVPage | PrefillDone]:
        """Take any piece of the stream (copied into place); returns the items it completed."""
        out: list[KVPage | PrefillDone] = []
        view, pos = memoryview(chunk), 0
        while pos < len(view):
            if self.finished:
                raise FrameError("data after the final frame of the page stream")
            space = self.payload_space()
            if space is not None:
                n = min(len(view) - pos, len(space))
                space[:n] = view[pos : pos + n]
                pos += n
                out.extend(self.payload_received(n))
                continue
            take = min(self.head_missing(), len(view) - pos)
            self._head += view[pos : pos + take]
            self.bytes_read += take
            pos += take
            if self.head_missing() == 0:
                out.extend(self._complete_head())
        return out

    # The zero-copy side of the reader (node_agent/page_receiver.py): the socket writes straight
    # into the page being received, then says how much it wrote.
    def payload_space(self) -> memoryview | None:
        """The rest of the page frame being received, to fill in place (None between frames)."""
        return None if self._frame is None else self._view[self._filled :]

    def payload_received(self, n: int) -> list[KVPage]:
        start = self._filled
        self._filled = end = start + n
        self.bytes_read += n
        self._hash.update(self._view[start:end])  # while it is still in cache
        if end < len(self._view):
            return []
        header, view, self._frame, self._view = self._header, self._view, None, None
        args = (header, view[HEADER_SIZE:], self.expect, checksum_finish(self._hash, header.raw))
        # an encoded page is decoded in the pool; a kept one is only checked (cheap: here)
        if self.pool is not None and header.encoding != RAW and not keeps_coded(header, self.expect):
            return [self.pool.submit(decode_payload, *args)]
        return [decode_payload(*args)]

    def head_missing(self) -> int:
        """How many more bytes the frame head being collected needs (0 when it is complete)."""
        return self._head_need() - len(self._head)

    def _complete_head(self) -> list[PrefillDone]:
        head, self._head = bytes(self._head), bytearray()
        magic = head[:4]
        if magic == MAGIC:
            self._header = header = parse_header(head)
            # what the header claims is checked against what this stream expects (its geometry
            # above all) before anything is allocated for it: a hostile peer's header claiming a
            # 1 GiB page ends the stream here
            if self.expect is not None:
                check_expectation(header, self.expect)
            # np.empty, not bytearray: the socket fills every byte, so zero-filling 1.5 MB per page
            # first (what bytearray does) was pure cost on the hot path
            self._frame = np.empty(HEADER_SIZE + header.payload_size, dtype=np.uint8)
            self._view = memoryview(self._frame)
            self._view[:HEADER_SIZE] = head
            self._hash = xxhash.xxh3_64()
            self._filled = HEADER_SIZE
            return []
        if magic == HEARTBEAT_MAGIC:
            return []
        try:
            obj = json.loads(head[8:])
        except ValueError as e:
            raise FrameError(f"malformed control frame: {e}") from e
        self.finished = True
        if magic == ERROR_MAGIC:
            raise PeerError(str(obj.get("code", "peer_error")), str(obj.get("message", "the peer failed")))
        try:
            done = PrefillDone(
                first_token=int(obj["first_token"]),
                kv_tokens=int(obj["kv_tokens"]),
                pages=int(obj["pages"]),
                prefill_seconds=float(obj["prefill_seconds"]),
                finished_at=float(obj.get("finished_at", 0.0)),
                cached_tokens=int(obj.get("cached_tokens", 0)),
                first_logprobs=None
                if obj.get("first_logprobs") is None
                else TokenLogprobs.from_json(obj["first_logprobs"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FrameError(f"malformed final frame: {type(e).__name__}: {e}") from e
        return [done]

    def close(self) -> None:
        if not self.finished:
            raise FrameError(
                f"the page stream was truncated after {self.bytes_read:,} bytes (no final frame): nothing was decoded"
            )
