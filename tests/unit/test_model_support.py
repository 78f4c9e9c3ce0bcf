"""Which checkpoints Tandem accepts, and the messages for those it refuses."""

from __future__ import annotations

import json
import shutil

import pytest

from tandem_protocol.errors import UnsupportedModel
from tandem_protocol.model_dir import inspect_model

from ..conftest import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smol_dir):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("support") / "tiny", "qwen2", smol_dir)


def with_config(tiny, tmp_path, **changes):
    copy = tmp_path / "m"
    shutil.copytree(tiny, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_embedded_model_geometry(smol_dir):
    info = inspect_model(smol_dir)
    assert (info.model_type, info.geometry.layers, info.geometry.kv_heads, info.geometry.head_dim) == (
        "llama",
        30,
        3,
        64,
    )
    assert info.max_context == 8192 and info.eos_token_ids == {2}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"use_sliding_window": True, "sliding_window": 64}, "sliding-window"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantized"),
        ({"quantization": {"group_size": 64, "bits": 4}}, "quantized"),
        ({"vision_config": {"hidden_size": 32}}, "multimodal"),
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ],
)
def test_refused_configs_say_why(tiny, tmp_path, changes, message):
    with pytest.raises(UnsupportedModel, match=message):
        inspect_model(with_config(tiny, tmp_path, **changes))


def test_refused_by_both_engines_before_loading(tiny, tmp_path):
    from engine_adapters import load_adapter

    path = with_config(tiny, tmp_path, quantization_config={"quant_method": "gptq"})
    for engine in ("torch", "mlx"):
        with pytest.raises(UnsupportedModel, match="quantized"):
            load_adapter(engine, path)


def test_missing_pieces(tiny, tmp_path):
    with pytest.raises(UnsupportedModel, match="does not exist"):
        inspect_model(tmp_path / "nowhere")
    copy = with_config(tiny, tmp_path)
    (copy / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModel, match="safetensors"):
        inspect_model(copy)
    (copy / "config.json").unlink()
    with pytest.raises(UnsupportedModel, match="config.json"):
        inspect_model(copy)
