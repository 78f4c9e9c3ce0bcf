"""mlx-lm engine: Metal in FP16 on Apple Silicon, CPU in float32 (FP16 KV storage) elsewhere."""

from __future__ import annotations

from . import openblas

openblas.preload()  # before the first `import mlx` (see openblas.py)

import sys  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm import load as mlx_load  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from .in_process import InProcessEngine  # noqa: E402


def rope_overrides(config: dict) -> dict:
    """transformers >= 5 writes RoPE settings under `rope_parameters`; mlx-lm 0.32.2 reads the
    top-level `rope_theta`/`rope_scaling` for Llama and Qwen2 and silently falls back to its own
    default base (1e6 for Qwen2) without them. Lift them to the top level."""
    params = config.get("rope_parameters") or {}
    overrides = {}
    if "rope_theta" not in config and "rope_theta" in params:
        overrides["rope_theta"] = params["rope_theta"]
    if "rope_scaling" not in config and params.get("rope_type", "default") != "default":
        overrides["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return overrides


class _FP16KVCache(KVCache):
    """mlx-lm's KVCache with values rounded through FP16 on the way in (see base module doc)."""

    def update_and_fetch(self, keys, values):
        if keys.dtype != mx.float16:
            keys = keys.astype(mx.float16).astype(keys.dtype)
            values = values.astype(mx.float16).astype(values.dtype)
        return super().update_and_fetch(keys, values)


class _Session(list):
    """One request's per-layer caches (what the model is called with), and NumPy views of their
    buffers while pages are imported (`views[layer]` = (K, V), each [heads][capacity][dim]).

    Pages are written straight into MLX's own cache buffers through those views (MLX documents
    `np.array(a, copy=False)` as a writable view of an evaluated array), so the last page costs
    its own copy and nothing more. Before, pages were staged in a NumPy buffer handed to MLX at
    the end: a copy of the whole cache after the last page arrived (137 ms at 6,000 tokens,
    37-42 at 1,536); an MLX slice assignment per page was worse, a new copy of the whole cache
    per page. On CPU the cache is float32 and NumPy widens each FP16 page as it copies it in."""

    capacity = 0  # tokens the request may reach (prompt and output)
    views: list[tuple[np.ndarray, np.ndarray]] | None = None


class _RowsLayer:
    """Layer i of several requests' caches, for one batched decode step (`forward_rows`): row r's
    new K/V go into request r's own cache, RoPE turns each row at its own position, and attention
    reads each row's own K/V (`_rows_attention`). Requests of any lengths step together with no
    padding and no copy of their caches; the projections and MLPs run batched. (mlx-lm's
    BatchKVCache keeps the batch in one left-padded array, which every join and leave copies.)"""

    def __init__(self, caches: list[_FP16KVCache]):
        self.caches = caches
        self.offset = mx.array([c.offset for c in caches])

    def update_and_fetch(self, keys, values):
        pairs = [c.update_and_fetch(keys[r : r + 1], values[r : r + 1]) for r, c in enumerate(self.caches)]
        return [k for k, _ in pairs], [v for _, v in pairs]

    def make_mask(self, n: int, **kwargs):
        return None  # one new token per row, which sees its whole cache


def _rows_attention(module) -> None:
    """Make the model module's attention take `_RowsLayer` rows, one by one; every other call
    goes to mlx-lm's own function unchanged. mlx-lm's attention modules call the function they
    imported by name, so it is replaced there (once per module)."""
    original = module.scaled_dot_product_attention
    if getattr(original, "tandem_rows", False):
        return

    def attention(queries, keys, values, cache, scale, mask, **kwargs):
        if isinstance(cache, _RowsLayer):
            return mx.concatenate(
                [
                    original(queries[r : r + 1], k, v, cache=None, scale=scale, mask=None, **kwargs)
                    for r, (k, v) in enumerate(zip(keys, values, strict=True))
                ]
            )
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    attention.tandem_rows = True
    module.scaled_dot_product_attention = attention


def _writable(a: mx.array) -> np.ndarray:
    """The [heads][capacity][dim] buffer of an evaluated (1, heads, capacity, dim) cache array."""
    view = np.array(a, copy=False)[0]
    if not view.flags.writeable or 0 in view.strides:  # a broadcast constant, not a buffer of its own
        raise RuntimeError("MLX cache array is not a writable buffer of its own")
    return view


class MLXAdapter(InProcessEngine):
    name = "mlx"

    def _load(self) -> None:
        self.on_metal = mx.metal.is_available()
        self.dtype = mx.float16 if self.on_metal else mx.float32
        self.model, _ = mlx_load(str(self.model_dir), model_config=rope_overrides(self.info.config))
        self.model.set_dtype(self.dtype)
        mx.eval(self.model.parameters())
        _rows_attention(sys.modules[type(self.model).__module__])

    def accelerator(self) -> dict:
        if self.on_metal:
            return {"kind": "metal", "name": mx.metal.device_info().get("device_name", "Apple GPU")}
        return {**super().accelerator(), "blas": "OpenBLAS" if openblas.loaded else "reference BLAS (slow)"}

    def kv_budget_bytes(self) -> int:
        if self.on_metal:  # half of what Metal recommends keeping wired, less the weights (FP16 cache)
            info = mx.metal.device_info()
            return max(1, (info["max_recommended_working_set_size"] - mx.get_active_memory()) // 2)
        return super().kv_budget_bytes()

    def new_session(self, capacity: int) -> _Session:
        session = _Session(_FP16KVCache() for _ in range(self.geometry.layers))
        session.capacity = capacity
        return session

    def _logits(self, hidden: mx.array) -> mx.array:
        # Apply the LM head to the last position only (mlx-lm's Model.__call__ does all positions).
        if getattr(self.model.args, "tie_word_embeddings", False):
            return self.model.model.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)

    def forward(self, session: list[_FP16KVCache], token_ids: list[int]) -> np.ndarray:
        hidden = self.model.model(mx.array([token_ids]), session)
        logits = self._logits(hidden[:, -1, :]).astype(mx.float32)
        mx.eval(logits, [(c.keys, c.values) for c in session])
        return np.array(logits[0])

    def forward_rows(self, sessions: list[_Session], tokens: list[int]) -> np.ndarray:
        if len(sessions) == 1:  # alone, a request computes exactly as it always has
            return self.forward(sessions[0], tokens)[None]
        rows = [_RowsLayer([s[i] for s in sessions]) for i in range(self.geometry.layers)]
        hidden = self.model.model(mx.array([[t] for t in tokens]), rows)
        logits = self._logits(hidden[:, -1, :]).astype(mx.float32)
        mx.eval(logits, [(c.keys, c.values) for s in sessions for c in s])
        return np.array(logits)

    def export_kv(self, session: list[_FP16KVCache], start: int, end: int) -> np.ndarray:
        # per layer (1, heads, capacity, dim) -> [layers][2][n][heads][dim] in FP16
        kv = mx.stack([mx.stack([c.keys[0, :, start:end], c.values[0, :, start:end]]) for c in session])
        kv = kv.transpose(0, 1, 3, 2, 4).astype(mx.float16)
        return np.array(kv)

    def reserve(self, session: _Session, tokens: int) -> None:
        # MLX zero-fills what it allocates: 135 ms for a 6,000-token float32 cache here, paid at
        # the request's start, not when its pages burst in
        needed = max(tokens, session.capacity)
        for cache in session:
            if cache.keys is None or cache.keys.shape[2] < needed:
                self._grow(cache, needed)
        mx.eval([(c.keys, c.values) for c in session])
        session.views = [(_writable(c.keys), _writable(c.values)) for c in session]

    def import_kv(self, session: _Session, start: int, kv: np.ndarray) -> None:
        end = start + kv.shape[2]
        if session.views is None or session.views[0][0].shape[1] < end:
            self.reserve(session, end)
        block = kv.transpose(0, 1, 3, 2, 4)  # [L][2][n][H][D] -> [L][2][H][n][D]
        for (k, v), layer in zip(session.views, block):
            k[:, start:end] = layer[0]
            v[:, start:end] = layer[1]

    def _grow(self, cache: _FP16KVCache, length: int) -> None:
        g = self.geometry
        capacity = -(-length // cache.step) * cache.step
        grown_k = mx.zeros((1, g.kv_heads, capacity, g.head_dim), self.dtype)
        grown_v = mx.zeros_like(grown_k)
        if cache.keys is not None:
            old = cache.keys.shape[2]
            grown_k[:, :, :old] = cache.keys
            grown_v[:, :, :old] = cache.values
        cache.keys, cache.values = grown_k, grown_v

    def set_length(self, session: _Session, length: int) -> None:
        session.views = None  # the imports are over: MLX alone writes the caches from here
        for cache in session:
            if cache.keys is None:
                self._grow(cache, length)
            cache.offset = length
        mx.eval([(c.keys, c.values) for c in session])
