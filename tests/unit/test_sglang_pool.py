"""SGLang's KV pool seen as Tandem pages (engine_adapters/sglang_pool.py), on pools built the way
SGLang builds them (`MHATokenToKVPool`: one [slots + page, heads, dim] FP16 tensor per layer for K
and for V, described to backends by pointers and lengths). On the CPU here, and on CUDA where a
GPU exists (the lent H200 has torch but no SGLang, so this is how the GPU path gets exercised)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine_adapters.sglang_pool import MetadataRows, PoolPages
from tandem_protocol.pages import PageGeometry

GEOMETRY = PageGeometry(layers=3, kv_heads=2, head_dim=8)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def sglang_like_pool(device: str, slots: int = 64 * 6, page: int = 64, dtype=torch.float16):
    g = GEOMETRY
    k = [torch.randn(slots + page, g.kv_heads, g.head_dim, device=device).to(dtype) for _ in range(g.layers)]
    v = [torch.randn(slots + page, g.kv_heads, g.head_dim, device=device).to(dtype) for _ in range(g.layers)]
    bufs = k + v
    args = SimpleNamespace(
        page_size=page,
        kv_cache_dtype_str="auto",
        kv_layout=None,
        kv_data_ptrs=[b.data_ptr() for b in bufs],
        kv_data_lens=[b.nbytes for b in bufs],
        kv_item_lens=[b[0].nbytes * page for b in bufs],
    )
    return args, k, v


@pytest.mark.parametrize("device", DEVICES)
def test_pages_read_and_write_exactly_the_pool_slots(device):
    args, k, v = sglang_like_pool(device)
    pool = PoolPages(args, device, GEOMETRY)
    got = pool.read(2, 64)
    assert got.shape == GEOMETRY.page_shape and got.dtype == np.float16
    for layer in range(GEOMETRY.layers):
        assert np.array_equal(got[layer, 0], k[layer][128:192].cpu().numpy())
        assert np.array_equal(got[layer, 1], v[layer][128:192].cpu().numpy())
    partial = pool.read(3, 10)
    assert partial.shape[2] == 10 and np.array_equal(partial[1, 1], v[1][192:202].cpu().numpy())

    before = [t.clone() for t in k + v]
    data = np.random.default_rng(0).standard_normal((GEOMETRY.layers, 2, 37, 2, 8)).astype(np.float16)
    pool.write(4, data)
    for layer in range(GEOMETRY.layers):
        assert np.array_equal(k[layer][256:293].cpu().numpy(), data[layer, 0])
        assert np.array_equal(v[layer][256:293].cpu().numpy(), data[layer, 1])
    changed = [
        (i, s)
        for i, (a, b) in enumerate(zip(before, k + v))
        for s in torch.nonzero((a != b).any(-1).any(-1)).flatten().tolist()
    ]
    assert {s for _, s in changed} <= set(range(256, 293))  # no other slot touched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "change, message",
    [
        (dict(page_size=16), "--page-size 64"),
        (dict(kv_cache_dtype_str="fp8_e5m2"), "FP16"),
        (dict(kv_layout="hnd"), "NHD"),
    ],
)
def test_pools_tandem_cannot_read_are_refused(device, change, message):
    args, _, _ = sglang_like_pool(device)
    for name, value in change.items():
        setattr(args, name, value)
    with pytest.raises(ValueError, match=message):
        PoolPages(args, device, GEOMETRY)
    args, _, _ = sglang_like_pool(device)
    with pytest.raises(ValueError, match="layers"):
        PoolPages(args, device, PageGeometry(layers=4, kv_heads=2, head_dim=8))


def test_metadata_rows_land_where_sglang_reads_them():
    """The decoder's first token and room, written into SGLang-shaped metadata buffers (output_ids
    first, bootstrap_room last; the checksum row, when on, after it)."""
    for checksum in (False, True):
        output_ids = torch.zeros((8, 16), dtype=torch.int32)
        others = [torch.zeros((8, 16), dtype=torch.float32) for _ in range(3)]
        rooms = torch.zeros((8, 8), dtype=torch.uint64)
        bufs = [output_ids, *others, rooms] + ([torch.zeros((8, 8), dtype=torch.uint64)] if checksum else [])
        args = SimpleNamespace(
            aux_data_ptrs=[b.data_ptr() for b in bufs],
            aux_data_lens=[b.nbytes for b in bufs],
            aux_item_lens=[b[0].nbytes for b in bufs],
        )
        MetadataRows(args, checksum).commit(5, first_token=4649, room=2**62 + 7)
        assert output_ids[5, 0].item() == 4649 and int(rooms[5, 0].item()) == 2**62 + 7
        assert output_ids.count_nonzero() == 1 and rooms.view(torch.int64).count_nonzero() == 1
