"""INT8 pages (tandem_protocol/int8.py): the error bound of every value, the scales (K per channel,
V per token, never a code past 127), a damaged frame or payload caught; zero and extreme pages:
tests/unit/test_fp8.py."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings

from tandem_protocol import int8
from tandem_protocol.errors import FrameError
from tandem_protocol.pages import INT8, KVPage, PageGeometry, checksum_finish, decode_frame, encode_frame

from .test_fp8 import IDS, pages


def steps(x: np.ndarray) -> np.ndarray:
    """Each value's quantization step, page-shaped: its K channel's or V token's max |x| / 127."""
    a = np.abs(x.astype(np.float64))
    k = np.broadcast_to(a[:, 0].max(axis=1, keepdims=True), a[:, 0].shape)
    v = np.broadcast_to(a[:, 1].max(axis=3, keepdims=True), a[:, 1].shape)
    return np.stack([k, v], axis=1) / 127


@settings(max_examples=60, deadline=None)
@given(pages())
def test_every_value_comes_back_within_half_a_step(page):
    x, valid = page
    y = int8.decode(int8.encode(x), x.shape)
    assert y.dtype == np.float16 and np.isfinite(y).all()
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    # half a step (the scale rounded up to FP16 adds at most 2**-10 of it), then FP16's own
    # rounding of the result (half an ulp: 2**-11 of the value, or 2**-25 among the subnormals)
    bound = steps(x) / 2 * (1 + 2.0**-10) + np.maximum(np.abs(x.astype(np.float64)) * 2.0**-11, 2.0**-25)
    assert (err <= bound).all(), float((err - bound).max())
    assert not y[:, :, valid:].view(np.uint16).any()  # the zero tail stays +0, bit for bit


@settings(max_examples=30, deadline=None)
@given(pages())
def test_the_scales_are_the_blocks_max_over_127_rounded_up(page):
    x, _ = page
    k_scale, v_scale, codes = int8.split(int8.encode(x), x.shape)
    a = np.abs(x.astype(np.float64))
    for scale, amax in ((k_scale, a[:, 0].max(axis=1)), (v_scale, a[:, 1].max(axis=3))):
        s = scale.astype(np.float64)
        assert (s >= amax / 127).all()  # rounded up: no code passes 127
        nearest_below = np.nextafter(scale, np.float16(0)).astype(np.float64)
        assert ((nearest_below < amax / 127) | (s == 0)).all()  # and by the least FP16 step
    assert np.abs(codes.astype(np.int16)).max() <= 127


def test_an_int8_frame_is_about_half_the_bytes_and_damage_is_caught():
    g = PageGeometry(layers=30, kv_heads=3, head_dim=64)
    data = (np.random.default_rng(1).standard_normal(g.page_shape) * 3).astype(np.float16)
    data[:, :, 40:] = 0
    header, payload = encode_frame(KVPage(0, 40, data), encoding=INT8, **IDS)
    assert len(payload) / g.page_bytes == 0.515625  # a byte a value; FP16 scales: 64 per K head, 64 per V head
    frame = bytearray(bytes(header) + bytes(payload))
    _, page = decode_frame(bytes(frame))
    assert (page.data == int8.decode(payload, g.page_shape)).all()
    frame[len(header) + 30_000] ^= 0x10
    with pytest.raises(FrameError, match="checksum"):
        decode_frame(bytes(frame))

    def reframed(change) -> bytes:
        """The payload changed, under a checksum that fits (a broken or hostile peer's)."""
        bad = bytearray(payload)
        change(bad)
        checksum = checksum_finish(xxhash.xxh3_64(bytes(bad)), header)
        return bytes(header)[:-8] + checksum.to_bytes(8, "little") + bytes(bad)

    n_scales = 2 * (30 * 3 * 64 + 30 * 64 * 3)
    for change, message in (
        (lambda b: b.__setitem__(slice(0, 2), np.float16(-1).tobytes()), "finite and positive"),
        (lambda b: b.__setitem__(slice(0, 2), np.float16(np.inf).tobytes()), "finite and positive"),
        (lambda b: b.__setitem__(n_scales + 5, 0x80), "-128"),
        (lambda b: b.__setitem__(n_scales + 40 * 3 * 64, 1), "past its 40 valid tokens"),  # layer 0's K, token 40
    ):
        with pytest.raises(FrameError, match=message):
            decode_frame(reframed(change))
