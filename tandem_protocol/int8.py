"""INT8 pages on the wire (`page_encoding: int8`): about half the bytes of FP16, lossy, opt-in per model.

FP16 stays the canonical page (pages.py); an INT8 frame carries the page as

    k_scales  FP16, shape [layers][kv_heads][head_dim]        K: one scale per channel over the page's tokens
    v_scales  FP16, shape [layers][page_tokens][kv_heads]     V: one scale per token over head_dim
    codes     int8, shape [layers][2][page_tokens][kv_heads][head_dim]   round(x / scale), in -127..127

and the receiver restores FP16 values code * scale on arrival (computed in float32, rounded once).

Why these scales (KIVI's, Liu et al. 2024): K after RoPE keeps its outliers in fixed channels,
the same few dimensions of a head for every token, so a scale per channel keeps the quiet channels'
resolution; V has no such channels, and its error reaches the output weighted per token, so a
scale per token. The step is then a 254th of what one channel (or token) spans, where E4M3 keeps 3
mantissa bits of every value: on the embedded model INT8 pages answer as FP16 pages on 20 of 20
prompts against FP8's 15 (tests/system/test_fp8_quality.py; bench/bench_fp8_quality.py). The scales cost 3.1 %
of the codes' bytes at the embedded model's geometry, 2.3 % at an 8B model's (the payload is
0.516 and 0.512 of FP16's). A scale is the block's max |x| / 127 rounded *up* to FP16, so no code
passes 127, and every value comes back within half a step of itself (before the final FP16 rounding).
"""

from __future__ import annotations

import numpy as np

NAME = "INT8"
CODE_MAX = 127
FP16_MAX = 65504.0


def scale_counts(layers: int, kv_heads: int, head_dim: int, page_tokens: int) -> tuple[int, int]:
    """How many K scales and V scales a page's payload holds (FP16 each, before the codes)."""
    return layers * kv_heads * head_dim, layers * page_tokens * kv_heads


def payload_bytes(layers: int, kv_heads: int, head_dim: int, page_tokens: int) -> int:
    n_k, n_v = scale_counts(layers, kv_heads, head_dim, page_tokens)
    return 2 * (n_k + n_v) + layers * 2 * page_tokens * kv_heads * head_dim


def _scale(amax: np.ndarray) -> np.ndarray:
    """max |x| / 127 rounded up to an FP16 value (0 for an all-zero block)."""
    wanted = amax.astype(np.float32) / CODE_MAX
    scale = wanted.astype(np.float16)
    short = scale.astype(np.float32) < wanted
    scale[short] = np.nextafter(scale[short], np.float16(np.inf))
    return scale


def scales(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K's per-channel and V's per-token scales of an FP16 page (FP16, [L][H][D] and [L][T][H])."""
    magnitude = data.view(np.uint16) & 0x7FFF  # FP16 magnitudes order as their bit patterns do
    if (magnitude >= 0x7C00).any():
        raise ValueError("a page with infinities or NaN cannot be sent as INT8")
    k_amax = magnitude[:, 0].max(axis=1).view(np.float16)  # over tokens: [L][H][D]
    v_amax = magnitude[:, 1].max(axis=3).view(np.float16)  # over head_dim: [L][T][H]
    return _scale(k_amax), _scale(v_amax)


def encode(data: np.ndarray) -> bytes:
    """An FP16 page ([layers][2][page_tokens][kv_heads][head_dim]) as an INT8 payload."""
    k_scale, v_scale = scales(data)
    x = data.astype(np.float32)  # one float32 buffer, scaled, rounded and clipped in place
    np.multiply(x[:, 0], _reciprocal(k_scale)[:, None], out=x[:, 0])
    np.multiply(x[:, 1], _reciprocal(v_scale)[..., None], out=x[:, 1])
    np.rint(x, out=x)
    np.clip(x, -CODE_MAX, CODE_MAX, out=x)
    return k_scale.tobytes() + v_scale.tobytes() + x.astype(np.int8).tobytes()


def _reciprocal(scale: np.ndarray) -> np.ndarray:
    """1 / scale in float32, 0 for an all-zero block's scale of 0 (its values are all 0)."""
    s = scale.astype(np.float32)
    return np.divide(1.0, s, out=np.zeros_like(s), where=s > 0)


def split(payload: bytes | memoryview, page_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of an INT8 payload's K scales, V scales (checked finite and not negative) and codes
    (page-shaped, checked within -127..127). The caller has checked its size."""
    layers, _, page_tokens, kv_heads, head_dim = page_shape
    n_k, n_v = scale_counts(layers, kv_heads, head_dim, page_tokens)
    k_scale = np.frombuffer(payload, np.float16, n_k).reshape(layers, kv_heads, head_dim)
    v_scale = np.frombuffer(payload, np.float16, n_v, offset=2 * n_k).reshape(layers, page_tokens, kv_heads)
    codes = np.frombuffer(payload, np.int8, offset=2 * (n_k + n_v)).reshape(page_shape)
    for name, s in (("K", k_scale), ("V", v_scale)):
        bits = s.view(np.uint16)
        if ((bits & 0x7FFF) >= 0x7C00).any() or (bits & 0x8000).any():
            raise ValueError(f"{name} scales must be finite and positive (or zero)")
    if (codes == -128).any():
        raise ValueError("a code of -128 (codes are -127..127)")
    return k_scale, v_scale, codes


def codes(payload: bytes | memoryview, page_shape: tuple[int, ...]) -> np.ndarray:
    """An INT8 payload's codes (page-shaped), its scales and codes checked: what is checked of a
    page handed on still encoded to an engine that decodes it itself."""
    return split(payload, page_shape)[2]


def decode(payload: bytes | memoryview, page_shape: tuple[int, ...]) -> np.ndarray:
    """The FP16 page an INT8 payload of this shape holds. The caller has checked its size."""
    k_scale, v_scale, codes = split(payload, page_shape)
    out = np.empty(page_shape, np.float32)
    np.multiply(codes[:, 0], k_scale.astype(np.float32)[:, None], out=out[:, 0])
    np.multiply(codes[:, 1], v_scale.astype(np.float32)[..., None], out=out[:, 1])
    # a scale rounded up at FP16's top (65504 / 127 -> 516) would take 127 * 516 past 65504
    return np.clip(out, -FP16_MAX, FP16_MAX, out=out).astype(np.float16)
