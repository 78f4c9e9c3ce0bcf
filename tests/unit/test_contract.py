"""Model contract: every differing field is named; large-file hashes are cached by identity."""

from __future__ import annotations

import json
import shutil

import pytest

from tandem_protocol import contract as contract_mod
from tandem_protocol.contract import HashCache, compute_contract, token_digest
from tandem_protocol.errors import ContractMismatch
from tandem_protocol.model_dir import inspect_model

from ..conftest import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smol_dir):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("contract") / "tiny", "llama", smol_dir)


def contract_of(path, context_length=256, cache=None):
    return compute_contract(inspect_model(path), context_length, cache)


def variant(tiny, tmp_path, edit):
    copy = tmp_path / "variant"
    shutil.copytree(tiny, copy)
    edit(copy)
    return contract_of(copy)


def test_identical_checkpoints_share_a_contract(tiny, tmp_path):
    same = variant(tiny, tmp_path, lambda p: None)
    contract_of(tiny).check_same(same)
    assert same.fingerprint == contract_of(tiny).fingerprint


def flip_weight_byte(path):
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "edit, field",
    [
        (flip_weight_byte, "weights"),
        (lambda p: (p / "chat_template.jinja").write_text("{{ messages }}"), "tokenizer"),
        (
            lambda p: (p / "config.json").write_text(
                json.dumps({**json.loads((p / "config.json").read_text()), "rope_theta": 5000.0})
            ),
            "config",
        ),
    ],
)
def test_a_changed_file_is_named(tiny, tmp_path, edit, field):
    other = variant(tiny, tmp_path, edit)
    with pytest.raises(ContractMismatch) as e:
        contract_of(tiny).check_same(other)
    assert e.value.fields == [field]
    assert field in str(e.value)
    assert other.fingerprint != contract_of(tiny).fingerprint


def test_context_length_is_named(tiny):
    with pytest.raises(ContractMismatch) as e:
        contract_of(tiny, 256).check_same(contract_of(tiny, 512))
    assert e.value.fields == ["context_length"]


def test_several_differences_are_all_named(tiny, tmp_path):
    variant(tiny, tmp_path, flip_weight_byte)
    other = contract_of(tmp_path / "variant", context_length=512)
    with pytest.raises(ContractMismatch) as e:
        contract_of(tiny).check_same(other)
    assert e.value.fields == ["weights", "context_length"]


def test_volatile_config_keys_do_not_change_the_contract(tiny, tmp_path):
    other = variant(
        tiny,
        tmp_path,
        lambda p: (p / "config.json").write_text(
            json.dumps({**json.loads((p / "config.json").read_text()), "transformers_version": "9.9.9"})
        ),
    )
    contract_of(tiny).check_same(other)


def test_token_digest_sees_order_length_and_values():
    base = token_digest([1, 2, 3])
    assert len(base) == 16
    assert base == token_digest([1, 2, 3])
    assert (
        len({base, token_digest([3, 2, 1]), token_digest([1, 2]), token_digest([1, 2, 3, 0]), token_digest([1, 2, 4])})
        == 5
    )


def test_weight_hashes_are_cached_by_file_identity(tiny, tmp_path, monkeypatch):
    cache_file = tmp_path / "hashes.json"
    calls = []
    real = contract_mod.hash_file
    monkeypatch.setattr(contract_mod, "hash_file", lambda f, p=None: calls.append(f.name) or real(f, p))
    first = contract_of(tiny, cache=HashCache(cache_file))
    assert calls.count("model.safetensors") == 1
    second = contract_of(tiny, cache=HashCache(cache_file))  # a fresh process would read the same file
    assert calls.count("model.safetensors") == 1 and first == second
    (tiny / "model.safetensors").touch()  # new mtime: the identity changed, so hash again
    contract_of(tiny, cache=HashCache(cache_file))
    assert calls.count("model.safetensors") == 2


def test_progress_is_reported_in_bytes(tiny):
    seen = []
    compute_contract(inspect_model(tiny), 256, None, lambda done, total: seen.append((done, total)))
    size = (tiny / "model.safetensors").stat().st_size
    assert seen and seen[-1] == (size, size)


def test_agents_writing_one_hash_cache_at_once_do_not_fail(tmp_path):
    """Agents sharing a data dir hash at the same start: their writes to the one cache file must
    not trip over each other (they shared one temporary name, and a replace found it gone)."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    cache_file, files = tmp_path / "hashes.json", []
    for i in range(4):
        files.append(tmp_path / f"w{i}")
        files[-1].write_bytes(b"x" * i)

    def writer(i: int) -> None:
        cache = HashCache(cache_file)  # one per agent, as each process has its own
        for n in range(300):
            cache.put(files[i], f"{i}-{n}")

    with ThreadPoolExecutor(4) as pool:
        for job in [pool.submit(writer, i) for i in range(4)]:
            job.result()
    assert len(json.loads(cache_file.read_text())) >= 1
    assert not list(tmp_path.glob("*.tmp"))
