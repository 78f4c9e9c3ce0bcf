"""Reading a Hugging Face model directory and deciding whether Tandem supports it.

Supported: unquantized, text-only, full-attention Llama, Qwen2 and Qwen3 checkpoints in
safetensors, run with tensor parallelism 1. Everything else is refused with a message that
says what was found, because moving KV between engines only works when both run the same math.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import UnsupportedModel
from .pages import PageGeometry

SUPPORTED_TYPES = {"llama", "qwen2", "qwen3"}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
_MULTIMODAL_KEYS = ("vision_config", "audio_config", "text_config", "vision_tower", "mm_projector_type")


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    config: dict
    model_type: str
    geometry: PageGeometry
    max_context: int
    vocab_size: int

    @property
    def weight_files(self) -> list[Path]:
        return sorted(self.path.glob("*.safetensors"))

    @property
    def tokenizer_files(self) -> list[Path]:
        return [self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()]

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.config, _read_json(self.path / "generation_config.json")):
            eos = source.get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return ids


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModel(f"{path} is not valid JSON: {e}") from e


def inspect_model(path: str | Path) -> ModelInfo:
    """Read `path`'s config and check that Tandem supports it; raise UnsupportedModel if not."""
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise UnsupportedModel(f"model directory {path} does not exist")
    config = _read_json(path / "config.json")
    if not config:
        raise UnsupportedModel(f"{path} has no config.json: not a Hugging Face checkpoint")
    problems = unsupported_reasons(config)
    if problems:
        raise UnsupportedModel(f"{path}: " + "; ".join(problems))
    if not sorted(path.glob("*.safetensors")):
        raise UnsupportedModel(f"{path} has no .safetensors weights (other weight formats are not supported)")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        raise UnsupportedModel(f"{path} has no tokenizer (tokenizer.json or tokenizer.model)")
    heads = config["num_attention_heads"]
    geometry = PageGeometry(
        layers=config["num_hidden_layers"],
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
    )
    return ModelInfo(
        path=path,
        config=config,
        model_type=config["model_type"],
        geometry=geometry,
        max_context=int(config.get("max_position_embeddings") or 0),
        vocab_size=config["vocab_size"],
    )


def unsupported_reasons(config: dict) -> list[str]:
    """Every reason this config cannot be served; empty when it can."""
    reasons = []
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        reasons.append(f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(SUPPORTED_TYPES))})")
    if any(k in config for k in _MULTIMODAL_KEYS):
        reasons.append("multimodal checkpoints are not supported (found a vision/audio/text sub-config)")
    if config.get("quantization_config") or config.get("quantization"):
        reasons.append("quantized checkpoints are not supported: Tandem moves FP16 KV of unquantized weights")
    layer_types = config.get("layer_types") or []
    if config.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        reasons.append("sliding-window attention is not supported: every layer must use full attention")
    if model_type == "llama" and config.get("sliding_window"):
        reasons.append("sliding-window attention is not supported: every layer must use full attention")
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"):
        if not isinstance(config.get(key), int) or config[key] <= 0:
            reasons.append(f"config.json lacks a positive integer {key}")
    return reasons
