"""The device-side FP8 encoder (engine_adapters/torch_adapter.py `fp8_payloads`), run here on the
CPU: the CUDA prefill sends its bytes as FP8 pages, so they must be the codec's, byte for byte
(tests/test_cuda.py checks the same on a GPU, through the prefill)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_adapters.torch_adapter import fp8_decoded, fp8_payloads, fp8_refused
from tandem_protocol import fp8
from tandem_protocol.errors import FrameError
from tandem_protocol.pages import FP8_E4M3, FrameExpectation, KVPage, PageGeometry, encode_frame, frame_bytes, make_page
from tandem_protocol.wire import FrameReader

SHAPE = (3, 2, 64, 4, 32)  # [layers][2][page_tokens][kv_heads][head_dim]


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


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_device_encoder_makes_the_codecs_bytes(seed):
    pages = pages_like_kv(np.random.default_rng(seed), 4)
    rows = fp8_payloads(torch.from_numpy(pages)).numpy()
    assert rows.shape == (4, fp8.payload_bytes(SHAPE[0], SHAPE[3], SHAPE[4], SHAPE[2]))
    for i, page in enumerate(pages):
        assert rows[i].tobytes() == fp8.encode(page), f"page {i}"
    assert not fp8_refused(rows, SHAPE[0] * 2 * SHAPE[3])


def test_a_page_with_an_infinity_or_nan_is_refused():
    pages = pages_like_kv(np.random.default_rng(3), 3)
    pages[1, 2, 1, 9, 3, 0] = np.inf
    rows = fp8_payloads(torch.from_numpy(pages)).numpy()
    assert fp8_refused(rows, SHAPE[0] * 2 * SHAPE[3]) and not fp8_refused(rows[:1], SHAPE[0] * 2 * SHAPE[3])
    pages[1, 2, 1, 9, 3, 0] = np.nan
    assert fp8_refused(fp8_payloads(torch.from_numpy(pages)).numpy(), SHAPE[0] * 2 * SHAPE[3])
    with pytest.raises(ValueError, match="infinities or NaN"):
        fp8.encode(pages[1])  # the host's codec refuses it too


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


def test_a_decoder_that_decodes_fp8_itself_gets_each_page_checked_but_encoded():
    """With `keep_fp8` (the decoder's engine decodes on its device) an FP8 page comes out of the
    stream as its payload, with the checks a decoded page gets: the checksum, block exponents in
    range, nothing but zeros past its valid tokens."""
    g = PageGeometry(layers=2, kv_heads=2, head_dim=8)
    ids = {"contract": b"c" * 16, "handoff_id": b"h" * 16, "tokens": b"t" * 16}
    expect = FrameExpectation(b"c" * 16, b"h" * 16, b"t" * 16, g, keep_fp8=True)
    kv = np.random.default_rng(5).standard_normal((2, 2, 40, 2, 8)).astype(np.float16)
    frame = frame_bytes(make_page(g, 3, kv), encoding=FP8_E4M3, **ids)
    page = FrameReader(expect).feed(frame)[0]
    assert page.data is None and page.index == 3 and page.valid_tokens == 40
    assert page.fp8.tobytes() == fp8.encode(make_page(g, 3, kv).data)
    # the same page decoded on the host, for a decoder that does not keep FP8
    host = FrameReader(FrameExpectation(b"c" * 16, b"h" * 16, b"t" * 16, g)).feed(frame)[0]
    assert np.array_equal(host.data, fp8_decoded(torch.from_numpy(page.fp8)[None], g)[0].numpy())

    blocks = g.layers * 2 * g.kv_heads

    def reframed(change) -> bytes:
        """The frame with its payload changed, under a checksum that fits (a hostile peer's)."""
        payload = bytearray(page.fp8.tobytes())
        change(payload)
        data = np.frombuffer(bytes(payload), np.uint8)
        header, body = encode_frame(KVPage(3, 40, make_page(g, 3, kv).data, fp8=data), encoding=FP8_E4M3, **ids)
        return bytes(header) + bytes(body)

    def past_valid(p):
        p[blocks + 40 * 2 * 8] = 0x11  # layer 0's K at token 40

    def exponent(p):
        p[0] = fp8.EXP_MAX + 1

    for change, says in ((past_valid, "non-zero bytes past its 40 valid tokens"), (exponent, "block exponents")):
        with pytest.raises(FrameError, match=says):
            FrameReader(expect).feed(reframed(change))
    flipped = bytearray(frame)
    flipped[-5] ^= 0x04
    with pytest.raises(FrameError, match="checksum"):
        FrameReader(expect).feed(bytes(flipped))
