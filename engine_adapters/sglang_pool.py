"""SGLang's KV pool and metadata rows seen as Tandem pages, from the pointers SGLang hands every
transfer backend (`KVArgs`). Used by the transfer backend inside SGLang's scheduler
(engine_adapters/sglang_backend.py); imports torch and numpy only, so it can be tested anywhere.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from tandem_protocol.pages import PageGeometry


def _tensor_at(ptr: int, nbytes: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """A tensor over memory SGLang owns (its pool), without copying or taking ownership. The
    transfer arguments give pointers and lengths only, as they do to every SGLang backend."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # SGLang's scheduler has made its GPU the current one
        dev = torch.device("cuda", torch.cuda.current_device())
    storage = torch._C._construct_storage_from_data_pointer(ptr, dev, nbytes)
    return torch.empty(0, dtype=dtype, device=dev).set_(storage)


class PoolPages:
    """SGLang's token-to-KV pool as canonical pages: one layer's K (or V) is [slots, heads, dim]
    FP16, slot-major ("NHD"), and page p is slots [p*64, p*64 + 64)."""

    def __init__(self, args, device: str, geometry: PageGeometry):
        if args.page_size != 64:
            raise ValueError(f"Tandem pages are 64 tokens: start SGLang with --page-size 64 (not {args.page_size})")
        if args.kv_cache_dtype_str not in ("auto", "float16", "torch.float16", "fp16"):
            raise ValueError(f"Tandem moves FP16 KV; this SGLang caches {args.kv_cache_dtype_str}")
        if getattr(args, "kv_layout", None) not in (None, "nhd", "NHD"):
            raise ValueError(f"Tandem reads SGLang's slot-major (NHD) KV pool, not {args.kv_layout}")
        item = geometry.page_tokens * geometry.kv_heads * geometry.head_dim * 2
        if len(args.kv_data_ptrs) != 2 * geometry.layers or set(args.kv_item_lens) != {item}:
            raise ValueError(
                f"SGLang's KV pool ({len(args.kv_data_ptrs)} buffers of {set(args.kv_item_lens)}-byte "
                f"pages) is not the model's {geometry.layers} layers x K,V x {item}-byte FP16 pages"
            )
        self.geometry = geometry
        self.layers, self.page_tokens = geometry.layers, geometry.page_tokens
        self.heads, self.head_dim = geometry.kv_heads, geometry.head_dim
        self.device = device
        self.buffers = [
            _tensor_at(ptr, size, torch.float16, device).view(-1, self.heads, self.head_dim)
            for ptr, size in zip(args.kv_data_ptrs, args.kv_data_lens)
        ]

    def read(self, page: int, valid: int) -> np.ndarray:
        """[layers, 2, valid, heads, dim] of pool page `page`."""
        s = slice(page * self.page_tokens, page * self.page_tokens + valid)
        L = self.layers
        kv = torch.stack([torch.stack([self.buffers[i][s], self.buffers[L + i][s]]) for i in range(L)])
        return kv.cpu().numpy()

    def write(self, page: int, kv: np.ndarray) -> None:
        """Write [layers, 2, n, heads, dim] into the first n slots of pool page `page`."""
        data = torch.from_numpy(np.ascontiguousarray(kv)).to(self.device)
        start = page * self.page_tokens
        s = slice(start, start + kv.shape[2])
        for i in range(self.layers):
            self.buffers[i][s] = data[i, 0]
            self.buffers[self.layers + i][s] = data[i, 1]


class MetadataRows:
    """The rows of SGLang's metadata buffers (host memory) a decoder reads after a transfer:
    output_ids (the first token) is the first buffer, bootstrap_room the last unless a KV
    checksum buffer follows it (disaggregation/utils.py MetadataBuffers.get_buf_infos)."""

    def __init__(self, args, checksum_buffer: bool):
        def row_view(i: int, dtype) -> np.ndarray:
            ptr, total, item = args.aux_data_ptrs[i], args.aux_data_lens[i], args.aux_item_lens[i]
            buf = (ctypes.c_char * total).from_address(ptr)
            return np.frombuffer(buf, dtype=dtype).reshape(total // item, item // np.dtype(dtype).itemsize)

        self.output_ids = row_view(0, np.int32)
        self.rooms = row_view(len(args.aux_data_ptrs) - (2 if checksum_buffer else 1), np.uint64)

    def commit(self, index: int, first_token: int, room: int) -> None:
        self.output_ids[index, 0] = first_token
        self.rooms[index, 0] = room  # written last: SGLang treats a non-zero room as "metadata landed"
