"""The embedded SmolLM2 checkpoint: converted correctly, answers the same in both engines."""

from __future__ import annotations

import json

import numpy as np

from engine_adapters.base import EngineRequest
from engine_adapters.embedded_model import _unpermute, fetch, is_fetched
from tandem_protocol.sampling import SamplingParams
from tandem_protocol.settings import data_dir

from ..conftest import collect, run


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The permutation llama.cpp's convert_hf_to_gguf.py applies to Q and K (its `permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp():
    w = np.arange(192 * 5, dtype=np.float32).reshape(192, 5)
    for heads in (1, 3, 6):
        assert np.array_equal(_unpermute(llama_cpp_permute(w, heads), heads), w)
        assert not np.array_equal(_unpermute(w, heads), w)


def test_fetch_is_idempotent(smol_dir):
    assert is_fetched(data_dir())
    mtime = (smol_dir / "model.safetensors").stat().st_mtime_ns
    path, converted = fetch(data_dir())
    assert path == smol_dir and not converted
    assert (smol_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_checkpoint_files(smol_dir):
    config = json.loads((smol_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3 and config["head_dim"] == 64
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float16"
    assert "im_start" in (smol_dir / "chat_template.jinja").read_text()
    from safetensors import safe_open

    with safe_open(smol_dir / "model.safetensors", "np") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == np.float16
        assert len(list(f.keys())) == 272


def test_both_engines_answer_paris(engines):
    for engine in engines.values():
        ids = engine.chat_token_ids([{"role": "user", "content": "What is the capital of France?"}])
        out = run(collect(engine.generate(EngineRequest("paris", ids, SamplingParams(max_tokens=20)))))
        assert engine.detokenize(out).strip() == "The capital of France is Paris.", engine.name
        assert out[-1] == 2  # stopped at <|im_end|>
