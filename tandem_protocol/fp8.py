"""FP8 pages on the wire (`page_encoding: fp8`): half the bytes of FP16, lossy, opt-in per model.

FP16 stays the canonical page (pages.py); an FP8 frame carries the page as

    exponents  int8,  shape [layers][2][kv_heads]                           one scale 2**e per block
    codes      uint8, shape [layers][2][page_tokens][kv_heads][head_dim]   E4M3 (OCP FP8 "fn": no
                                                                            infinities, max 448)

and the receiver restores FP16 values code * 2**e on arrival. A block is one head's K (or V) of
one layer over the page's 64 tokens (64 x head_dim values).

Why that granularity: K after RoPE and V differ in range from layer to layer and from head to
head (a few outlier heads hold values 10-100x their neighbours'); one scale for a whole page would
leave the quiet heads a handful of codes. Per (layer, K/V, head) each scale follows one head's own
range, and costs one byte per 64 x head_dim values (0.02 % of the payload at head_dim 64); a
scale per token would cost 64 times that and gain little, since a head's range moves slowly
along the sequence. The scales are powers of two, as in OCP's Microscaling formats: rescaling is
then exact in FP16, so encoding is one table lookup per value (the FP16 bit pattern, under the
block's exponent, to its E4M3 code, rounded to nearest, ties to even) and decoding another.
"""

from __future__ import annotations

import functools

import numpy as np

NAME = "FP8"
E4M3_MAX = 448.0
FP16_MAX = 65504.0
# The block exponents a page can need: from FP16's largest values (2**8 * 448 > 65504) down to
# blocks of FP16 subnormals (2**-24), which then fill the E4M3 range.
EXP_MIN, EXP_MAX = -34, 8


def payload_bytes(layers: int, kv_heads: int, head_dim: int, page_tokens: int) -> int:
    return layers * 2 * kv_heads + layers * 2 * page_tokens * kv_heads * head_dim


@functools.cache
def _e4m3_values() -> np.ndarray:
    """The value of each of the 256 codes (float64; NaN for the two NaN codes)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    mag = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    mag[(codes & 0x7F) == 0x7F] = np.nan
    return sign * mag


@functools.cache
def _encode_table() -> np.ndarray:
    """[exponent - EXP_MIN][FP16 bit pattern] -> E4M3 code of value / 2**exponent (uint8)."""
    positive = _e4m3_values()[:127]  # codes 0..126 in increasing order of value
    fp16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)
    finite = np.isfinite(fp16)
    sign = np.where(np.signbit(fp16), 0x80, 0).astype(np.uint8)
    table = np.empty((EXP_MAX - EXP_MIN + 1, 65536), dtype=np.uint8)
    for row, e in enumerate(range(EXP_MIN, EXP_MAX + 1)):
        y = np.minimum(np.where(finite, np.abs(fp16), 0.0) * 2.0**-e, E4M3_MAX)
        hi = np.clip(np.searchsorted(positive, y), 1, 126)  # positive[hi-1] <= y <= positive[hi]
        lo = hi - 1
        d_lo, d_hi = y - positive[lo], positive[hi] - y
        # nearest; a tie goes to the even code (an even mantissa)
        code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
        code = np.where(y <= positive[0], 0, code)
        table[row] = code.astype(np.uint8) | sign
    return table


@functools.cache
def _decode_table() -> np.ndarray:
    """[exponent - EXP_MIN][code] -> FP16 value code * 2**exponent (clamped to FP16's range: a
    value rounded up at the top of a block with exponent 8 would pass 65504)."""
    values = np.nan_to_num(_e4m3_values(), nan=0.0)
    scaled = values[None, :] * 2.0 ** np.arange(EXP_MIN, EXP_MAX + 1, dtype=np.float64)[:, None]
    return np.clip(scaled, -FP16_MAX, FP16_MAX).astype(np.float16)


def block_exponents(data: np.ndarray) -> np.ndarray:
    """The smallest e per block with max|x| / 2**e <= 448 (int8, [layers][2][kv_heads])."""
    # on the bit patterns: FP16 magnitudes order as their integers do, and integer max is a
    # native numpy loop where FP16 arithmetic is emulated
    top = (data.view(np.uint16) & 0x7FFF).max(axis=(2, 4))
    if (top >= 0x7C00).any():
        raise ValueError("a page with infinities or NaN cannot be sent as FP8")
    amax = top.view(np.float16).astype(np.float64)
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(amax / E4M3_MAX))
    return np.clip(np.where(amax > 0, e, EXP_MIN), EXP_MIN, EXP_MAX).astype(np.int8)


def encode(data: np.ndarray) -> bytes:
    """An FP16 page ([layers][2][page_tokens][kv_heads][head_dim]) as an FP8 payload."""
    exps = block_exponents(data)
    # one lookup per value in the flat table: row (the block's exponent) * 65536 + FP16 bits
    rows = ((exps.astype(np.int32) - EXP_MIN) << 16)[:, :, None, :, None]
    codes = _encode_table().ravel().take(data.view(np.uint16) + rows)
    return exps.tobytes() + codes.tobytes()


def split(payload: bytes | memoryview, page_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Views of an FP8 payload's block exponents ([layers][2][kv_heads], checked to be in range)
    and codes (page-shaped). The caller has checked its size."""
    layers, two, page_tokens, kv_heads, head_dim = page_shape
    n_exp = layers * two * kv_heads
    exps = np.frombuffer(payload, dtype=np.int8, count=n_exp).reshape(layers, two, kv_heads)
    codes = np.frombuffer(payload, dtype=np.uint8, offset=n_exp).reshape(page_shape)
    if exps.min() < EXP_MIN or exps.max() > EXP_MAX:
        raise ValueError(f"block exponents outside {EXP_MIN}..{EXP_MAX}")
    return exps, codes


def codes(payload: bytes | memoryview, page_shape: tuple[int, ...]) -> np.ndarray:
    """An FP8 payload's codes (page-shaped), its exponents checked: what is checked of a page
    handed on still encoded to an engine that decodes it itself."""
    return split(payload, page_shape)[1]


def decode(payload: bytes | memoryview, page_shape: tuple[int, ...]) -> np.ndarray:
    """The FP16 page an FP8 payload of this shape holds. The caller has checked its size."""
    exps, codes = split(payload, page_shape)
    rows = ((exps.astype(np.int32) - EXP_MIN) << 8)[:, :, None, :, None]
    return _decode_table().ravel().take(codes + rows)
