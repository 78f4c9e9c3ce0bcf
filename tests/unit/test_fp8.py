"""FP8 pages (tandem_protocol/fp8.py): the error bound of every value, the block scales, zero and
extreme pages, rounding checked against every FP16 value, and a damaged frame detected."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem_protocol import fp8, int8
from tandem_protocol.errors import FrameError
from tandem_protocol.pages import FP8_E4M3, KVPage, PageGeometry, decode_frame, encode_frame

IDS = {"contract": b"c" * 16, "handoff_id": b"h" * 16, "tokens": b"t" * 16}


def error_bound(x: np.ndarray, exps: np.ndarray) -> np.ndarray:
    """Half a step of E4M3 at each value, in the block's scale 2**e: 1/16 of the value in E4M3's
    normal range, half the subnormal step (2**-10 * 2**e) below it."""
    scale = np.exp2(exps.astype(np.float64))[:, :, None, :, None]
    return np.maximum(np.abs(x.astype(np.float64)) / 16, scale * 2.0**-10)


@st.composite
def pages(draw):
    """A page of random geometry whose heads have ranges decades apart (as real K and V do),
    with zeros, FP16 subnormals and a zero tail past its valid tokens."""
    layers, heads, dim = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.sampled_from([8, 64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ranges = 10.0 ** rng.uniform(-7, 4.8, size=(layers, 2, 1, heads, 1))
    x = np.clip(rng.standard_normal((layers, 2, 64, heads, dim)) * ranges, -65504, 65504)
    x[rng.random(x.shape) < 0.05] = 0
    valid = draw(st.integers(1, 64))
    x[:, :, valid:] = 0
    return x.astype(np.float16), valid


@settings(max_examples=60, deadline=None)
@given(pages())
def test_every_value_comes_back_within_half_a_step(page):
    x, valid = page
    exps = fp8.block_exponents(x)
    y = fp8.decode(fp8.encode(x), x.shape)
    assert y.dtype == np.float16 and np.isfinite(y).all()
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    assert (err <= error_bound(x, exps)).all()
    assert not y[:, :, valid:].view(np.uint16).any()  # the zero tail stays +0, bit for bit
    # each block's scale is the smallest power of two that holds its largest value
    amax = np.abs(x.astype(np.float64)).max(axis=(2, 4))
    held = amax > 0
    assert (amax[held] <= 448 * np.exp2(exps[held].astype(np.float64))).all()
    assert ((amax[held] > 448 * np.exp2(exps[held] - 1.0)) | (exps[held] == fp8.EXP_MIN)).all()


def test_rounding_is_to_the_nearest_code_ties_to_even_for_every_fp16_value():
    """Exhaustive at one block exponent: each of the 65,536 FP16 values (but NaN and inf) gets
    the code nearest to it among all 254 finite E4M3 values, a tie going to the even code."""
    values = fp8._e4m3_values()
    finite = np.flatnonzero(np.isfinite(values))
    x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)
    for e in (0, -7, 5):
        table = fp8._encode_table()[e - fp8.EXP_MIN]
        ok = np.isfinite(x) & (np.abs(x) <= 448 * 2.0**e)
        y = x[ok] * 2.0**-e
        got = values[table[ok]]
        dist = np.abs(values[finite][None, :] - y[:, None])
        best = dist.min(axis=1)
        assert (np.abs(got - y) == best).all()
        ties = (dist == best[:, None]).sum(axis=1) > 1
        assert (table[ok][ties] % 2 == 0).all() or (np.abs(got[ties]) == 0).all()
    # every E4M3 value is kept exactly
    x = (values[finite] * 2.0**3).astype(np.float16)
    page = np.zeros((1, 2, 64, 1, len(x) // 2), np.float16)
    page.reshape(-1)[: len(x)] = x
    page[0, :, 0, 0, 0] = 448 * 8  # both blocks' exponent 3
    assert (fp8.decode(fp8.encode(page), page.shape) == page).all()


def cast_mismatches(device: str) -> list[str]:
    """Where torch's cast on `device` (value * 2**-e to float8_e4m3fn) differs from this codec's
    table, for every finite FP16 value under every block exponent the codec uses (the first three
    per exponent): a GPU's FP8 bytes are the codec's only if this is empty."""
    import torch  # the engines' own dependency: always installed

    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x = x[torch.isfinite(x)]
    bits = x.view(torch.int16).numpy().view(np.uint16)
    bad = []
    for e in range(fp8.EXP_MIN, fp8.EXP_MAX + 1):
        y = x.float() * 2.0**-e  # exact: a power of two
        ok = (y.abs() <= fp8.E4M3_MAX).numpy()  # a block's exponent keeps its values in range
        got = y[torch.from_numpy(ok)].to(device).to(torch.float8_e4m3fn).view(torch.uint8).cpu().numpy()
        want = fp8._encode_table()[e - fp8.EXP_MIN][bits[ok]]
        for i in np.flatnonzero(got != want)[:3]:
            bad.append(f"e={e} fp16 {bits[ok][i]:#06x}: {got[i]:#04x} not {want[i]:#04x}")
    return bad


def test_torchs_float8_cast_is_this_codec_for_every_fp16_value_and_block_exponent():
    """A GPU can encode pages with torch's own cast and send exactly the bytes this codec would:
    torch's CPU cast here, CUDA's in tests/system/test_cuda.py."""
    bad = cast_mismatches("cpu")
    assert not bad, "\n".join(bad[:30])


@pytest.mark.parametrize("codec", [fp8, int8], ids=["fp8", "int8"])
def test_zero_and_extreme_pages(codec):
    """Both lossy codecs (int8.py too): zeros stay +0, FP16's extremes and subnormals come back."""
    zero = np.zeros((2, 2, 64, 3, 64), np.float16)
    assert not codec.decode(codec.encode(zero), zero.shape).view(np.uint16).any()
    extreme = np.full((1, 2, 64, 2, 8), 65504, np.float16)
    extreme[0, 1] = -65504
    extreme[0, 0, :, 1] = 6e-8  # FP16's smallest subnormal, a block of its own
    y = codec.decode(codec.encode(extreme), extreme.shape)
    assert np.isfinite(y).all() and (y[0, 0, :, 0] == 65504).all() and (y[0, 1] == -65504).all()
    assert (y[0, 0, :, 1] == extreme[0, 0, :, 1]).all()
    with pytest.raises(ValueError, match="infinities or NaN"):
        codec.encode(np.full((1, 2, 64, 1, 8), np.inf, np.float16))


def test_an_fp8_frame_is_half_the_bytes_and_a_flipped_bit_is_caught():
    g = PageGeometry(layers=30, kv_heads=3, head_dim=64)
    data = (np.random.default_rng(1).standard_normal(g.page_shape) * 3).astype(np.float16)
    header, payload = encode_frame(KVPage(0, 64, data), encoding=FP8_E4M3, **IDS)
    assert len(payload) / g.page_bytes <= 0.5002  # one byte a value, one a block
    frame = bytearray(bytes(header) + bytes(payload))
    _, page = decode_frame(bytes(frame))
    assert (page.data == fp8.decode(payload, g.page_shape)).all()
    frame[len(header) + 1000] ^= 0x10
    with pytest.raises(FrameError, match="checksum"):
        decode_frame(bytes(frame))
    frame[72:80] = (len(payload) + 1).to_bytes(8, "little")  # a size the geometry does not give
    with pytest.raises(FrameError, match="payload size"):
        decode_frame(bytes(frame) + b"\0")
