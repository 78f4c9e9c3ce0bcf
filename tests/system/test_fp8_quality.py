"""FP8 and INT8 pages' cost in quality on the embedded model, held to what bench/bench_fp8_quality.py
measured (bench/results/fp8-quality-20261205-071636.md for FP8, this test's own run for INT8;
torch -> MLX, the cross-engine tests' 16 greedy tokens): both are opt-in because they may change
answers, and this says by how much."""

from __future__ import annotations

import pytest

from bench.bench_fp8_quality import measure
from node_agent.inprocess import run_pair
from tandem_protocol.handoff import FirstTokenMode
from tandem_protocol.pages import FP8_E4M3, INT8
from tandem_protocol.sampling import SamplingParams

from ..conftest import collect, prompt, run


@pytest.fixture(scope="module")
def lossy(engines) -> dict[str, dict]:
    """Both lossy encodings measured against one FP16 reference (the bench's figures, 16 steps), the
    runs of all 20 prompts decoded in batched steps: 8x faster than one run at a time, the same
    tokens, logits within 2.5e-3 of it (first-step diff 1.21863 against 1.21879, mean KL 3.5732e-3
    against 3.5744e-3: the tolerances below hold either)."""
    return measure(engines["torch"], engines["mlx"], steps=16, encodings=("fp8", "int8"), batched=True)


def test_fp8_pages_against_fp16_pages_as_measured(lossy):
    r = lossy["fp8"]
    print(
        f"\ntorch->mlx FP8 pages: greedy agreement with FP16 pages {r['greedy_agreement']}/20 over 16 tokens, "
        f"first-step max abs logit diff {r['first_step_max_abs_diff']:.4f}, mean KL {r['mean_kl']:.2e}"
    )
    # the baseline: FP16 pages give exactly D's own answer
    assert r["fp16_pages_vs_own_prefill"] == 20, r
    # measured over 16 steps: 15/20, 1.2388, 3.57e-3 (over 32: 10/20, 2.84e-3); a tolerance within 2x
    assert r["greedy_agreement"] >= 15, r
    assert r["first_step_max_abs_diff"] <= 2 * 1.2388, r
    assert r["mean_kl"] <= 2 * 3.57e-3, r
    assert r["wire_ratio"] <= 0.5002, r


@pytest.mark.parametrize("encoding", [FP8_E4M3, INT8], ids=["fp8", "int8"])
def test_a_decoder_that_decodes_lossy_pages_on_its_device_answers_as_the_hosts_codec(engines, long_ids, encoding):
    """torch decodes FP8 and INT8 pages on its device where it has one (decodes_coded, on CUDA):
    the same import path on the CPU gives exactly the tokens of pages the host's codec decoded
    first."""
    torch_engine, params = engines["torch"], SamplingParams(max_tokens=16, ignore_eos=True)
    ids = prompt(long_ids, 193)

    def pair() -> list[int]:
        return run(
            collect(run_pair(torch_engine, torch_engine, ids, params, FirstTokenMode.COMMIT_FIRST, encoding=encoding))
        )

    assert not torch_engine.decodes_coded  # on the CPU the host decodes
    on_host = pair()
    imported, import_coded = [], torch_engine.import_coded
    torch_engine.import_coded = lambda session, start, payload, n, coding: (
        imported.append((start, coding)),
        import_coded(session, start, payload, n, coding),
    )
    torch_engine.decodes_coded = frozenset({encoding})
    try:
        on_device = pair()
    finally:
        torch_engine.decodes_coded = frozenset()
        del torch_engine.import_coded
    assert imported == [(start, encoding) for start in (0, 64, 128, 192)]  # every page came to the engine encoded
    assert on_device == on_host


def test_int8_pages_against_fp16_pages_as_measured(lossy):
    """INT8 pages (per-channel K, per-token V scales) in about the bytes of FP8's: every answer as
    with FP16 pages."""
    r = lossy["int8"]
    print(
        f"\ntorch->mlx INT8 pages: greedy agreement with FP16 pages {r['greedy_agreement']}/20 over 16 tokens, "
        f"first-step max abs logit diff {r['first_step_max_abs_diff']:.4f}, mean KL {r['mean_kl']:.2e}"
    )
    assert r["fp16_pages_vs_own_prefill"] == 20, r
    # measured over 16 steps: 20/20, 0.3483, 1.26e-4; a tolerance within 2x
    assert r["greedy_agreement"] == 20, r
    assert r["first_step_max_abs_diff"] <= 2 * 0.3483, r
    assert r["mean_kl"] <= 2 * 1.26e-4, r
    assert r["wire_ratio"] == 0.515625, r  # at this geometry; 0.512 at an 8B model's
