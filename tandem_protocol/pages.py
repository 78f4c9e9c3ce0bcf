"""Canonical KV pages: the one format every Tandem engine speaks.

A **page** holds the KV cache of up to 64 consecutive prompt tokens for every layer:

    payload = FP16, little-endian, C order, shape [layers][2][64][kv_heads][head_dim]
              index 0 of the second axis is K (after RoPE), index 1 is V.
              Token slots past `valid_tokens` are zero.

Page `i` covers prompt positions [64*i, 64*i + valid_tokens). Every page but the last of a
prompt is full. One FP16 token of SmolLM2-135M (30 layers, 3 KV heads, head_dim 64) is
30*2*3*64*2 = 23,040 bytes, so a full page is 1,474,560 bytes.

A **frame** is one page on the wire: a fixed 88-byte little-endian header followed by the payload.

    offset size field
    0      4    magic            b"TKVP"
    4      2    version          PROTOCOL_VERSION
    6      2    header_size      88 (lets a later version grow the header)
    8      16   contract         first 16 bytes of the model contract fingerprint
    24     16   handoff_id       the handoff's id, a UUID's 16 bytes
    40     16   tokens           digest of the prompt's token ids (contract.token_digest)
    56     4    page_index
    60     2    valid_tokens     1..page_tokens
    62     2    page_tokens      64
    64     2    layers
    66     2    kv_heads
    68     2    head_dim
    70     2    reserved         0
    72     8    payload_size     layers*2*page_tokens*kv_heads*head_dim*2
    80     8    checksum         xxh3_64 of the payload, then header bytes 0..79

Encoding and decoding are whole-array numpy operations: a page is built with one vectorised
copy, and a received payload is viewed in place (`np.frombuffer`), never walked token by token.
xxhash is used for the checksum because it is a well-kept C library that hashes faster than
memory can be copied, so checking every page costs little.
"""

from __future__ import annotations

import functools
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import xxhash

from . import fp8, int8
from .errors import ContractMismatch, FrameError

PAGE_TOKENS = 64
PROTOCOL_VERSION = 3  # 3: delta handoffs (HandoffBody.have_pages)
MAGIC = b"TKVP"
KV_DTYPE = np.dtype("<f2")

_HEADER = struct.Struct("<4sHH16s16s16sIHHHHHHQQ")
HEADER_SIZE = _HEADER.size
_CHECKSUM_OFFSET = HEADER_SIZE - 8
assert HEADER_SIZE == 88


@dataclass(frozen=True)
class PageGeometry:
    """The shape of a model's KV cache, as far as pages are concerned."""

    layers: int
    kv_heads: int
    head_dim: int
    page_tokens: int = PAGE_TOKENS

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.page_tokens, self.kv_heads, self.head_dim)

    @property
    def token_bytes(self) -> int:
        """Bytes of FP16 K and V for one token across all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim * KV_DTYPE.itemsize

    @property
    def page_bytes(self) -> int:
        return self.token_bytes * self.page_tokens

    def pages_for(self, tokens: int) -> int:
        """How many pages hold `tokens` tokens."""
        return -(-tokens // self.page_tokens)


@dataclass
class KVPage:
    """One page: `data` has the full page shape; slots past `valid_tokens` are zero."""

    index: int
    valid_tokens: int
    # None only for a received lossy page left encoded for an engine that decodes it on its
    # device (FrameExpectation.keep_coded): then `coded` holds it.
    data: np.ndarray | None
    # The page's payload in a lossy encoding (`encoding`: FP8_E4M3 or INT8; fp8.py's or int8.py's
    # layout, byte for byte): encoded by the prefiller's engine itself (a GPU:
    # `engine_adapters/torch_adapter.py`; None: encode_frame encodes `data` when asked), or
    # received for the decoder's engine to decode.
    coded: np.ndarray | None = None
    encoding: int | None = None

    @property
    def start(self) -> int:
        """First prompt position this page covers."""
        return self.index * self.data.shape[2]

    @property
    def kv(self) -> np.ndarray:
        """View of the valid tokens: [layers][2][valid_tokens][kv_heads][head_dim]."""
        return self.data[:, :, : self.valid_tokens]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def make_page(geometry: PageGeometry, index: int, kv: np.ndarray, out: np.ndarray | None = None) -> KVPage:
    """Build page `index` from `kv` shaped [layers][2][n][kv_heads][head_dim], 1 <= n <= 64.

    Any float dtype is accepted and rounded to FP16 here, at the page boundary. `out` is an
    optional page-shaped FP16 buffer to fill (a sender's staging pool avoids fresh allocations).
    """
    n = kv.shape[2]
    expected = geometry.page_shape[:2] + (n,) + geometry.page_shape[3:]
    if kv.shape != expected:
        raise ValueError(f"KV block of shape {kv.shape} does not fit geometry {geometry} (want {expected})")
    if not 1 <= n <= geometry.page_tokens:
        raise ValueError(f"a page holds 1..{geometry.page_tokens} tokens, got {n}")
    data = np.empty(geometry.page_shape, dtype=KV_DTYPE) if out is None else out
    if data.shape != geometry.page_shape or data.dtype != KV_DTYPE or not data.flags.c_contiguous:
        raise ValueError(f"page buffer must be C-contiguous {KV_DTYPE} of shape {geometry.page_shape}")
    data[:, :, :n] = kv
    data[:, :, n:] = 0
    return KVPage(index=index, valid_tokens=n, data=data)


# ---- wire encodings of a payload ----------------------------------------------------------------
# FP16 stays the canonical form: an encoding only changes how a page's bytes travel, and the
# receiver restores canonical FP16 before any check of their content: the exact bytes (raw,
# zstd), or the nearest FP8 values with per-block scales (fp8: lossy, opt-in per model; fp8.py),
# or INT8 codes with per-channel K and per-token V scales (int8: lossy, opt-in; int8.py).
RAW, ZSTD_PLANES, FP8_E4M3, INT8 = 0, 1, 2, 3
# the name a pair asks for -> the header's code
ENCODINGS = {"raw": RAW, "zstd": ZSTD_PLANES, "fp8": FP8_E4M3, "int8": INT8}
LOSSY = {FP8_E4M3: fp8, INT8: int8}  # the lossy encodings' codecs
ZSTD_LEVEL = 1  # fastest: the point is to beat a slow link, not to save disk


def compress_planes(data: np.ndarray) -> bytes:
    """Lossless: split FP16 values into a plane of low bytes and a plane of high bytes (sign,
    exponent, top of the mantissa: these repeat a lot), then zstd. The high plane is what
    compresses; the low plane is close to noise."""
    import zstandard  # only nodes that send or receive compressed pages need it

    planes = np.ascontiguousarray(np.frombuffer(data, dtype=np.uint8).reshape(-1, 2).T)
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(planes)


def decompress_planes(payload: bytes | memoryview, page_bytes: int) -> np.ndarray:
    import zstandard

    try:
        planes = zstandard.ZstdDecompressor().decompress(payload, max_output_size=page_bytes)
    except zstandard.ZstdError as e:
        raise FrameError(f"compressed page does not decompress: {e}") from e
    if len(planes) != page_bytes:
        raise FrameError(f"compressed page holds {len(planes)} bytes, its geometry needs {page_bytes}")
    out = np.empty(page_bytes, dtype=np.uint8)
    out.reshape(-1, 2)[:] = np.frombuffer(planes, dtype=np.uint8).reshape(2, -1).T
    return out.view(KV_DTYPE)


def max_compressed(page_bytes: int) -> int:
    return page_bytes + page_bytes // 128 + 4096  # zstd's worst case for incompressible input, rounded up


@dataclass(frozen=True)
class FrameHeader:
    raw: bytes  # the header as received; the checksum covers it
    contract: bytes
    handoff_id: bytes
    tokens: bytes
    page_index: int
    valid_tokens: int
    geometry: PageGeometry
    payload_size: int
    checksum: int
    version: int = PROTOCOL_VERSION
    encoding: int = RAW


@dataclass(frozen=True)
class FrameExpectation:
    """What the receiver knows in advance; every field is checked against each frame."""

    contract: bytes
    handoff_id: bytes
    tokens: bytes
    geometry: PageGeometry
    # The lossy encodings the decoder's engine decodes on its own device (a GPU): such a page is
    # checked (checksum, scales, zeros past its valid tokens) and handed over still encoded, half
    # the bytes to copy to the device and no host codec in the stream's way.
    keep_coded: frozenset[int] = frozenset()


def _id16(value: bytes, what: str) -> bytes:
    if len(value) < 16:
        raise ValueError(f"{what} must be at least 16 bytes, got {len(value)}")
    return bytes(value[:16])


@functools.cache
def codec_pool() -> ThreadPoolExecutor:
    """The threads that encode and decode FP8 and zstd pages (numpy and zstd release the GIL):
    up to 4, the cores this process may run on. An FP8 page of an 8B model (8 MiB) costs ~25 ms
    of a core each way; on the event loop or in a prefill's path that was the whole stream's pace
    (H100, 8k tokens: prefill 0.49 -> 3.6 s), here pages are coded several at once, in order."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return ThreadPoolExecutor(max_workers=max(1, min(4, cores)), thread_name_prefix="tandem-page-codec")


def encode_frame(
    page: KVPage,
    *,
    contract: bytes,
    handoff_id: bytes,
    tokens: bytes,
    payload_state: xxhash.xxh3_64 | None = None,
    encoding: int = RAW,
) -> tuple[bytes, memoryview]:
    """Frame a page: returns (header, payload view). Write both; a raw payload is not copied.

    `payload_state`: `xxhash.xxh3_64(payload)` already computed, for a payload framed again.
    `encoding`: ZSTD_PLANES sends the page compressed, FP8_E4M3 as FP8, INT8 as INT8 (the checksum
    covers the bytes sent)."""
    data = page.data
    if data.dtype != KV_DTYPE or not data.flags.c_contiguous:
        raise ValueError("page data must be C-contiguous little-endian FP16")
    layers, two, page_tokens, kv_heads, head_dim = data.shape
    if encoding == ZSTD_PLANES:
        payload, payload_state = memoryview(compress_planes(data)), None
    elif encoding in LOSSY:
        if page.coded is not None and page.encoding != encoding:
            raise ValueError(f"page {page.index} was encoded as {page.encoding}, the stream sends {encoding}")
        payload = memoryview(LOSSY[encoding].encode(data) if page.coded is None else page.coded).cast("B")
        payload_state = None
    elif encoding == RAW:
        payload = memoryview(data).cast("B")
    else:
        raise ValueError(f"unknown page encoding {encoding}")
    fields = (
        MAGIC,
        PROTOCOL_VERSION,
        HEADER_SIZE,
        _id16(contract, "contract"),
        _id16(handoff_id, "handoff_id"),
        _id16(tokens, "tokens"),
        page.index,
        page.valid_tokens,
        page_tokens,
        layers,
        kv_heads,
        head_dim,
        encoding,
        payload.nbytes,
    )
    unsigned = _HEADER.pack(*fields, 0)
    state = xxhash.xxh3_64(payload) if payload_state is None else payload_state
    return _HEADER.pack(*fields, checksum_finish(state, unsigned)), payload


def _checksum(header: bytes | memoryview, payload: bytes | memoryview) -> int:
    """xxh3_64 over the payload and the header (less its checksum field): any flipped bit shows."""
    return checksum_finish(xxhash.xxh3_64(payload), header)


def checksum_finish(payload_state: xxhash.xxh3_64, header: bytes | memoryview) -> int:
    """The frame checksum from a running hash of the payload and the header.

    The payload comes first so that a receiver can hash it in pieces as they land (while they
    are still in cache) and a sender can frame one payload under many headers (the link
    benchmark) without hashing it again."""
    h = payload_state.copy()
    h.update(memoryview(header)[:_CHECKSUM_OFFSET])
    return h.intdigest()


def frame_bytes(page: KVPage, *, contract: bytes, handoff_id: bytes, tokens: bytes, encoding: int = RAW) -> bytes:
    """The whole frame as one bytes object (one copy; streaming writers use encode_frame)."""
    header, payload = encode_frame(page, contract=contract, handoff_id=handoff_id, tokens=tokens, encoding=encoding)
    return header + payload


def parse_header(buf: bytes | memoryview) -> FrameHeader:
    """Parse and sanity-check a frame header (the first HEADER_SIZE bytes of `buf`)."""
    if len(buf) < HEADER_SIZE:
        raise FrameError(f"truncated frame header: {len(buf)} of {HEADER_SIZE} bytes")
    (
        magic,
        version,
        header_size,
        contract,
        handoff_id,
        tokens,
        index,
        valid,
        page_tokens,
        layers,
        kv_heads,
        head_dim,
        encoding,
        payload_size,
        checksum,
    ) = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {magic!r} (expected {MAGIC!r}): not a Tandem page stream")
    if version != PROTOCOL_VERSION:
        raise FrameError(f"page protocol version {version} is not supported (this node speaks {PROTOCOL_VERSION})")
    if header_size != HEADER_SIZE or encoding not in ENCODINGS.values():
        raise FrameError(f"bad frame header (size {header_size}, encoding {encoding})")
    geometry = PageGeometry(layers, kv_heads, head_dim, page_tokens)
    if encoding == RAW:
        fits = payload_size == geometry.page_bytes
    elif encoding in LOSSY:
        fits = payload_size == LOSSY[encoding].payload_bytes(layers, kv_heads, head_dim, page_tokens)
    else:
        fits = 0 < payload_size <= max_compressed(geometry.page_bytes)
    if min(layers, kv_heads, head_dim, page_tokens) == 0 or not fits:
        raise FrameError(f"frame payload size {payload_size} does not match its geometry {geometry}")
    if not 1 <= valid <= page_tokens:
        raise FrameError(f"frame claims {valid} valid tokens in a {page_tokens}-token page")
    return FrameHeader(
        bytes(buf[:HEADER_SIZE]),
        contract,
        handoff_id,
        tokens,
        index,
        valid,
        geometry,
        payload_size,
        checksum,
        version,
        encoding,
    )


def decode_frame(
    buf: bytes | memoryview, expect: FrameExpectation | None = None, checksum: int | None = None
) -> tuple[FrameHeader, KVPage]:
    """Check a whole frame and return its header and page (a view into `buf`).

    `checksum`: the frame's checksum when the receiver computed it while receiving
    (`checksum_finish`); it is compared with the header's just as a fresh one would be."""
    header = parse_header(buf)
    end = HEADER_SIZE + header.payload_size
    if len(buf) != end:
        raise FrameError(f"frame of {len(buf)} bytes, header says {end}")
    payload = memoryview(buf)[HEADER_SIZE:end]
    return header, decode_payload(header, payload, expect, checksum)


def decode_payload(
    header: FrameHeader,
    payload: bytes | memoryview,
    expect: FrameExpectation | None = None,
    checksum: int | None = None,
) -> KVPage:
    """Verify a payload against its header (and the receiver's expectation) and view it as a page."""
    if len(payload) != header.payload_size:
        raise FrameError(f"truncated page {header.page_index}: {len(payload)} of {header.payload_size} payload bytes")
    if (_checksum(header.raw, payload) if checksum is None else checksum) != header.checksum:
        raise FrameError(f"checksum mismatch on page {header.page_index}: the page was corrupted in transit")
    if expect is not None:
        check_expectation(header, expect)
    g, kept = header.geometry, keeps_coded(header, expect)
    if header.encoding == RAW:
        values = np.frombuffer(payload, dtype=KV_DTYPE).reshape(g.page_shape)
    elif header.encoding in LOSSY:
        codec = LOSSY[header.encoding]
        try:  # a kept page's codes are checked, not decoded: the decoder's engine decodes them
            values = codec.codes(payload, g.page_shape) if kept else codec.decode(payload, g.page_shape)
        except ValueError as e:
            raise FrameError(f"{codec.NAME} page {header.page_index}: {e}") from e
    else:
        values = decompress_planes(payload, g.page_bytes).reshape(g.page_shape)
    # FP16 zeros past the valid tokens (a kept page: the zero codes they encode to)
    if header.valid_tokens < g.page_tokens and values[:, :, header.valid_tokens :].view(np.uint8).any():
        raise FrameError(f"page {header.page_index} has non-zero bytes past its {header.valid_tokens} valid tokens")
    if kept:
        coded = np.frombuffer(payload, np.uint8)
        return KVPage(header.page_index, header.valid_tokens, data=None, coded=coded, encoding=header.encoding)
    return KVPage(index=header.page_index, valid_tokens=header.valid_tokens, data=values)


def keeps_coded(header: FrameHeader, expect: FrameExpectation | None) -> bool:
    """Whether this frame's page is handed over still encoded: a lossy page, to a decoder whose
    engine decodes that encoding itself (FrameExpectation.keep_coded)."""
    return header.encoding in LOSSY and expect is not None and header.encoding in expect.keep_coded


def check_expectation(header: FrameHeader, expect: FrameExpectation) -> None:
    if header.handoff_id != _id16(expect.handoff_id, "handoff_id"):
        raise FrameError(
            f"page {header.page_index} belongs to handoff {header.handoff_id.hex()}, expected {expect.handoff_id[:16].hex()}"
        )
    if header.contract != _id16(expect.contract, "contract"):
        raise ContractMismatch(
            ["contract fingerprint"],
            f"page {header.page_index} was made under contract {header.contract.hex()}, "
            f"this decoder's is {expect.contract[:16].hex()}",
        )
    if header.tokens != _id16(expect.tokens, "tokens"):
        raise ContractMismatch(["token_ids"], f"page {header.page_index} was made for a different prompt token list")
    if header.geometry != expect.geometry:
        raise FrameError(f"page geometry {header.geometry} differs from this model's {expect.geometry}")
