"""A random-weight checkpoint with Llama-3.1-8B's exact geometry, built on the GPU (timing is what
the scale run measures, not text): 32 layers, 8 KV heads of 128 (128 KiB of FP16 KV per token),
hidden 4096, MLP 14336, vocabulary 128,256. FP16 safetensors, the tokenizer files given.

    python bench/gpu_build_llama8b.py OUT_DIR TOKENIZER_DIR [--device cuda]

Built under torch.device(DEVICE): about a second on an H200, and the save about 20 s (16 GB);
random initialisation of 8 B parameters on a CPU would take minutes.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

LLAMA_31_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    initializer_range=0.02,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("tokenizer", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=32, help="fewer layers: a quick check of the script")
    args = ap.parse_args()
    t0 = time.perf_counter()
    config = LlamaConfig(**{**LLAMA_31_8B, "num_hidden_layers": args.layers})
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(torch.float16)
    built = time.perf_counter() - t0
    model.save_pretrained(args.out, safe_serialization=True)
    for f in args.tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, args.out / f.name)
    print(f"built in {built:.1f} s, saved in {time.perf_counter() - t0 - built:.1f} s: {args.out}")


if __name__ == "__main__":
    main()
