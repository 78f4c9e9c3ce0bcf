"""Test support, not product: a stand-in for SGLang's compiled kernel package on a CPU machine.

`sgl_kernel` (SGLang's C++/CUDA kernels) is published for CUDA only, and SGLang's CPU engine
(`SGLANG_USE_CPU_ENGINE=1`) imports a few of its `*_cpu` kernels at module level. For a plain
Llama with `--attention-backend torch_native` only `assign_req_to_token_pool_cpu` is ever called
(on every step); it is written out below in plain torch. Every other `*_cpu` name exists so the
imports succeed, and raises if called, so a code path we did not plan for fails loudly instead of
computing something wrong. No torch ops are registered, which keeps SGLang on its plain PyTorch
layers. On an NVIDIA machine SGLang's real kernels are installed and this folder is not used.
"""

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """req_to_token[row, start:end] = the next (end - start) entries of out_cache_loc, per request
    (the CPU twin of the Triton kernel `assign_req_to_token_pool` in sglang/srt/mem_cache/allocation.py)."""
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def __getattr__(name: str):
    if not name.endswith("_cpu"):
        raise AttributeError(f"sgl_kernel stand-in has no {name!r}")

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available in Tandem's CPU test stand-in")

    missing.__name__ = name
    return missing
