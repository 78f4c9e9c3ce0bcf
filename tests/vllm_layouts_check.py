"""Run by tests/integration/test_server_engines.py with vLLM's interpreter: the connector's GPU layout code against caches
built by vLLM's own view functions, for every KVCacheLayout vLLM defines. Prints one JSON line."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, compute_layout_strides, create_kv_cache_views  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from engine_adapters.vllm_connector import StridedLayout  # noqa: E402

BLOCKS, LAYERS, HEADS, DIM, BS = 5, 3, 3, 64, 64
results = {}
for layout in KVCacheLayout:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float16)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = spec.page_size_bytes * BLOCKS * LAYERS
    raw = torch.zeros(size, dtype=torch.int8)
    views = create_kv_cache_views(
        raw,
        spec,
        BLOCKS,
        layout,
        KVCacheTensor(
            size=size, layers=[f"l{i}" for i in range(LAYERS)], layer_stride=layer_stride, block_stride=block_stride
        ),
    )
    target = 1  # write 70 tokens into layer 1: block 3 (64) and block 1 (6), then check everything
    rw = StridedLayout(views[target], BS)
    k, v = torch.randn(70, HEADS, DIM).half(), torch.randn(70, HEADS, DIM).half()
    slots = torch.cat([3 * BS + torch.arange(64), 1 * BS + torch.arange(6)])
    rw.write(views[target], k, v, slots)
    k3, v3 = rw.read(views[target], 3)
    k1, v1 = rw.read(views[target], 1)
    ok = (
        torch.equal(k3, k[:64])
        and torch.equal(v3, v[:64])
        and torch.equal(k1[:6], k[64:])
        and torch.equal(v1[:6], v[64:])
    )
    # where FlashAttention reads them: (B, H, N, 2D) -> transpose(1, 2).split(D) -> (B, N, H, D) each
    fk, fv = views[target].transpose(1, 2).split(DIM, dim=-1)
    ok = ok and torch.equal(fk[3], k[:64]) and torch.equal(fv[3], v[:64])
    # nothing else was touched: other layers all zero, and the byte count written is exactly 70 tokens
    others = all(
        int(torch.count_nonzero(views[i].contiguous().view(torch.int16))) == 0 for i in range(LAYERS) if i != target
    )
    written = int(torch.count_nonzero(raw.view(torch.int16)))
    expected = int(torch.count_nonzero(k.view(torch.int16))) + int(torch.count_nonzero(v.view(torch.int16)))
    results[layout.name] = {
        "read_back": bool(ok),
        "other_layers_untouched": others,
        "only_those_bytes": written == expected,
    }
print(json.dumps(results))
