"""The device-side FP8 encoder (engine_adapters/torch_adapter.py `fp8_payloads`), run here on the
CPU: the CUDA prefill sends its bytes as FP8 pages, so they must be the codec's, byte for byte
(tests/test_cuda.py checks the same on a GPU, through the prefill)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_adapters.torch_adapter import fp8_payloads, fp8_refused
from tandem_protocol import fp8

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
