"""The device-side FP8 and INT8 coders (engine_adapters/torch_adapter.py `DEVICE_CODECS`), run here
on the CPU: the CUDA prefill sends their bytes as lossy pages and a CUDA decoder imports what they
decode, so both must be the host codecs', byte for byte (tests/system/test_cuda.py checks the same on a
GPU, through the prefill)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_adapters.torch_adapter import DEVICE_CODECS, fp8_decoded, int8_decoded
from tandem_protocol import fp8, int8
from tandem_protocol.errors import FrameError
from tandem_protocol.pages import (
    FP8_E4M3,
    INT8,
    LOSSY,
    FrameExpectation,
    KVPage,
    PageGeometry,
    encode_frame,
    frame_bytes,
    make_page,
)
from tandem_protocol.wire import FrameReader

SHAPE = (3, 2, 64, 4, 32)  # [layers][2][page_tokens][kv_heads][head_dim]
GEOMETRY = PageGeometry(layers=SHAPE[0], kv_heads=SHAPE[3], head_dim=SHAPE[4], page_tokens=SHAPE[2])
ENCODINGS = pytest.mark.parametrize("encoding", [FP8_E4M3, INT8], ids=["fp8", "int8"])


def pages_like_kv(rng: np.random.Generator, n: int) -> np.ndarray:
    """n pages whose blocks span FP16's range: quiet and outlier heads, zero blocks, a partial page
    (zeros past its valid tokens), FP16 subnormals, and FP16's largest values."""
    scales = 2.0 ** rng.integers(-20, 14, size=(n, SHAPE[0], 2, 1, SHAPE[3], 1))
    p = rng.standard_normal((n, *SHAPE)) * scales
    p[0, 1, 0] = 0.0  # a whole layer's K: zero blocks
    p[1, :, :, 17:] = 0.0  # a partial page
    p[2, 0, 1, :, 2] = rng.standard_normal((64, 32)) * 2.0**-20  # subnormal FP16
    p[2, 2, 0, 5, 1, 7] = 65504.0
    return np.clip(p, -65504, 65504).astype(np.float16)


@ENCODINGS
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_device_encoder_makes_the_codecs_bytes(seed, encoding):
    encode, refused, _ = DEVICE_CODECS[encoding]
    codec = LOSSY[encoding]
    pages = pages_like_kv(np.random.default_rng(seed), 4)
    rows = encode(torch.from_numpy(pages)).numpy()
    assert rows.shape == (4, codec.payload_bytes(SHAPE[0], SHAPE[3], SHAPE[4], SHAPE[2]))
    for i, page in enumerate(pages):
        assert rows[i].tobytes() == codec.encode(page), f"page {i}"
    assert not refused(rows, GEOMETRY)


@ENCODINGS
def test_a_page_with_an_infinity_or_nan_is_refused(encoding):
    encode, refused, _ = DEVICE_CODECS[encoding]
    pages = pages_like_kv(np.random.default_rng(3), 3)
    pages[1, 2, 1, 9, 3, 0] = np.inf
    rows = encode(torch.from_numpy(pages)).numpy()
    assert refused(rows, GEOMETRY) and not refused(rows[:1], GEOMETRY)
    pages[1, 2, 1, 9, 3, 0] = np.nan
    assert refused(encode(torch.from_numpy(pages)).numpy(), GEOMETRY)
    with pytest.raises(ValueError, match="infinities or NaN"):
        LOSSY[encoding].encode(pages[1])  # the host's codec refuses it too


def test_the_device_decoder_makes_the_codecs_values_for_every_code_under_every_exponent():
    """`fp8_decoded` (a CUDA decoder's import of FP8 pages) against the codec's table: every one of
    the 256 codes (the NaN codes and -0 among them) in every block, each block under another of
    the 43 exponents, bit for bit."""
    g = PageGeometry(layers=43, kv_heads=1, head_dim=64)  # 86 blocks of 4,096 codes: every code 16 times each
    blocks = g.layers * 2 * g.kv_heads
    exps = (fp8.EXP_MIN + np.arange(blocks) % (fp8.EXP_MAX - fp8.EXP_MIN + 1)).astype(np.int8)
    codes = np.random.default_rng(4).permutation(np.tile(np.arange(256, dtype=np.uint8), blocks * 16))
    payload = np.concatenate([exps.view(np.uint8), codes])
    assert set(exps.tolist()) == set(range(fp8.EXP_MIN, fp8.EXP_MAX + 1))
    got = fp8_decoded(torch.from_numpy(payload)[None], g)[0].numpy()
    assert got.view(np.uint16).tobytes() == fp8.decode(payload, g.page_shape).view(np.uint16).tobytes()


def test_the_device_int8_decoder_makes_the_codecs_values_for_every_code_under_every_kind_of_scale():
    """`int8_decoded` against `int8.decode`, bit for bit: every code -127..127 under scales from
    FP16's smallest subnormal to the largest a page can need (whose top codes pass 65504 and are
    clamped), zero scales among them."""
    g = PageGeometry(layers=16, kv_heads=2, head_dim=64)
    rng = np.random.default_rng(6)
    n_k, n_v = int8.scale_counts(g.layers, g.kv_heads, g.head_dim, g.page_tokens)
    bits = rng.integers(0, 0x6008, size=n_k + n_v)  # +0 .. 516 (65504 / 127, rounded up)
    bits[:4] = [0, 1, 0x3C00, 0x6008]  # zero, the smallest subnormal, 1, the largest scale
    codes = rng.permutation(np.tile(np.arange(-127, 128, dtype=np.int8), -(-int(np.prod(g.page_shape)) // 255)))
    codes = codes[: int(np.prod(g.page_shape))]
    codes[[3, 3 + g.kv_heads * g.head_dim]] = [127, -127]  # K of channel 3 (the largest scale): tokens 0, 1
    payload = np.concatenate([bits.astype(np.uint16).view(np.uint8), codes.view(np.uint8)])
    got = int8_decoded(torch.from_numpy(payload)[None], g)[0].numpy()
    want = int8.decode(payload, g.page_shape)
    assert np.abs(want.astype(np.float32)).max() == 65504.0  # the clamp was reached
    assert got.view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


@ENCODINGS
def test_a_decoder_that_decodes_lossy_pages_itself_gets_each_page_checked_but_encoded(encoding):
    """With `keep_coded` (the decoder's engine decodes on its device) a lossy page comes out of the
    stream as its payload, with the checks a decoded page gets: the checksum, the scales, nothing
    but zeros past its valid tokens."""
    g = PageGeometry(layers=2, kv_heads=2, head_dim=8)
    codec, decoded = LOSSY[encoding], DEVICE_CODECS[encoding][2]
    ids = {"contract": b"c" * 16, "handoff_id": b"h" * 16, "tokens": b"t" * 16}
    expect = FrameExpectation(b"c" * 16, b"h" * 16, b"t" * 16, g, keep_coded=frozenset({encoding}))
    kv = np.random.default_rng(5).standard_normal((2, 2, 40, 2, 8)).astype(np.float16)
    frame = frame_bytes(make_page(g, 3, kv), encoding=encoding, **ids)
    page = FrameReader(expect).feed(frame)[0]
    assert page.data is None and page.index == 3 and page.valid_tokens == 40 and page.encoding == encoding
    assert page.coded.tobytes() == codec.encode(make_page(g, 3, kv).data)
    # the same page decoded on the host, for a decoder that does not keep it encoded
    for other in (FrameExpectation(b"c" * 16, b"h" * 16, b"t" * 16, g), FrameExpectation(
        b"c" * 16, b"h" * 16, b"t" * 16, g, keep_coded=frozenset({FP8_E4M3, INT8} - {encoding})
    )):  # fmt: skip
        host = FrameReader(other).feed(frame)[0]
        assert np.array_equal(host.data, decoded(torch.from_numpy(page.coded)[None], g)[0].numpy())

    scales = 2 * sum(int8.scale_counts(g.layers, g.kv_heads, g.head_dim, g.page_tokens))
    head = g.layers * 2 * g.kv_heads if encoding == FP8_E4M3 else scales  # bytes before the codes

    def reframed(change) -> bytes:
        """The frame with its payload changed, under a checksum that fits (a hostile peer's)."""
        payload = bytearray(page.coded.tobytes())
        change(payload)
        data = np.frombuffer(bytes(payload), np.uint8)
        page_in = KVPage(3, 40, make_page(g, 3, kv).data, coded=data, encoding=encoding)
        header, body = encode_frame(page_in, encoding=encoding, **ids)
        return bytes(header) + bytes(body)

    def past_valid(p):
        p[head + 40 * 2 * 8] = 0x11  # layer 0's K at token 40

    def out_of_range(p):  # an FP8 block exponent past its range; an INT8 scale made negative
        if encoding == FP8_E4M3:
            p[0] = fp8.EXP_MAX + 1
        else:
            p[1] |= 0x80

    says = "block exponents" if encoding == FP8_E4M3 else "scales must be finite and positive"
    for change, message in ((past_valid, "non-zero bytes past its 40 valid tokens"), (out_of_range, says)):
        with pytest.raises(FrameError, match=message):
            FrameReader(expect).feed(reframed(change))
    flipped = bytearray(frame)
    flipped[-5] ^= 0x04
    with pytest.raises(FrameError, match="checksum"):
        FrameReader(expect).feed(bytes(flipped))
