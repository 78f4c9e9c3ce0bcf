"""Sampling parameters (tandem_protocol/sampling.py): every bound, at its edge and past it, named
in the refusal; and the in-process engines' sampler (engine_adapters/sampler.py) on fixed logits."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from engine_adapters.sampler import Sampler, token_logprobs
from tandem_protocol.sampling import MAX_LOGIT_BIAS, SERVER_FIELDS, SamplingParams, TokenLogprobs

NAN, INF = float("nan"), float("inf")

# (field, values that must be accepted, values that must be refused)
BOUNDS = [
    ("max_tokens", [1, 10**9], [0, -1, 1.5, "4", None]),
    ("temperature", [0, 0.0, 2.5, 100], [-0.1, NAN, INF, -INF, "1", None]),
    ("top_p", [1e-9, 0.5, 1], [0, -0.5, 1.0001, NAN, INF]),
    ("top_k", [0, 1, 2**40], [-1, 1.0, "3"]),
    ("seed", [None, 0, -1, -(2**63), 2**63 - 1], [2**63, -(2**63) - 1, 1.5, "7"]),
    ("min_p", [0, 1, 0.05], [-0.01, 1.01, NAN]),
    ("repetition_penalty", [1e-6, 1, 2], [0, -1, 2.01, INF]),
    ("presence_penalty", [-2, 0, 2], [-2.01, 2.01, NAN, -INF]),
    ("frequency_penalty", [-2, 0, 2], [-2.01, 2.01, NAN, INF]),
    ("logprobs", [None, 0, 20], [-1, 21, 1.0, "5"]),
]


@pytest.mark.parametrize("name, good, bad", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_each_bound_at_its_edge_and_past_it(name, good, bad):
    for value in good:
        assert getattr(SamplingParams(**{name: value}), name) == value
    for value in bad:
        with pytest.raises(ValidationError) as e:
            SamplingParams(**{name: value})
        (error,) = e.value.errors()
        assert error["loc"] == (name,), error
        assert error["input"] == value or value != value, error  # the refusal quotes what was sent (NaN != NaN)
        assert str(e.value).startswith(f"1 validation error for SamplingParams\n{name}\n"), e.value


def test_every_problem_is_named_at_once():
    with pytest.raises(ValidationError) as e:
        SamplingParams(max_tokens=0, temperature=-1, top_p=2, presence_penalty=3)
    named = [error["loc"][0] for error in e.value.errors()]
    assert named == ["max_tokens", "temperature", "top_p", "presence_penalty"]


def test_defaults_are_valid_greedy_and_set_nothing():
    params = SamplingParams()
    assert params.greedy and params.non_default() == set()
    assert not SamplingParams(temperature=0.7).greedy


def test_non_default_names_what_an_engine_must_honour():
    params = SamplingParams(temperature=0.5, top_k=3, min_p=0.1, stop_token_ids=(2,), seed=0)
    assert params.non_default() == {"temperature", "top_k", "min_p", "stop_token_ids", "seed"}
    assert SamplingParams(stop_token_ids=[], top_p=1.0).non_default() == set()  # an empty stop list is the default
    assert set(SERVER_FIELDS) == {"min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}


LOGITS = np.array([0.1, 3.0, 2.9, -1.0, 0.5], dtype=np.float32)


def test_greedy_is_argmax_whatever_the_seed():
    assert {Sampler(SamplingParams(seed=s))(LOGITS) for s in range(20)} == {1}


def test_top_k_1_and_a_tiny_top_p_are_greedy_at_any_temperature():
    for params in (SamplingParams(temperature=5.0, top_k=1, seed=3), SamplingParams(temperature=5.0, top_p=1e-6)):
        sampler = Sampler(params)
        assert {sampler(LOGITS) for _ in range(50)} == {1}


def test_top_k_keeps_only_the_k_most_likely():
    sampler = Sampler(SamplingParams(temperature=10.0, top_k=2, seed=0))
    assert {sampler(LOGITS) for _ in range(200)} == {1, 2}


def test_same_seed_same_tokens_and_skip_stays_on_the_sequence():
    """A decoder that continues after the prefiller's first token skips that token's draw and
    must then draw what a single engine with the same seed draws."""
    params = SamplingParams(temperature=1.5, seed=1234)
    one, two = Sampler(params), Sampler(params)
    alone = [one(LOGITS) for _ in range(40)]
    assert [two(LOGITS) for _ in range(40)] == alone
    continued = Sampler(params)
    continued.skip(alone[0])
    assert [continued(LOGITS) for _ in range(39)] == alone[1:]
    assert len(set(alone)) > 1  # temperature 1.5 on these logits does sample, or the checks above say nothing


def test_a_negative_seed_is_a_seed():
    a, b = Sampler(SamplingParams(temperature=1.0, seed=-5)), Sampler(SamplingParams(temperature=1.0, seed=-5))
    assert [a(LOGITS) for _ in range(20)] == [b(LOGITS) for _ in range(20)]


def test_logprobs_are_the_raw_distributions_whatever_the_sampling():
    """Each token's logprob is the log-softmax of the raw logits (not the tempered or cut
    distribution it was drawn from), its alternatives the most likely, most likely first."""
    expected = LOGITS.astype(np.float64) - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    for params in (SamplingParams(logprobs=3), SamplingParams(logprobs=3, temperature=2.0, top_k=2, seed=1)):
        got: list[TokenLogprobs] = []
        sampler = Sampler(params, got)
        tokens = [sampler(LOGITS) for _ in range(10)]
        assert len(got) == 10
        for token, lp in zip(tokens, got, strict=True):
            assert lp.logprob == pytest.approx(expected[token], abs=1e-12)
            assert [t for t, _ in lp.top] == [1, 2, 4]
            assert [v for _, v in lp.top] == pytest.approx(list(expected[[1, 2, 4]]), abs=1e-12)
    assert token_logprobs(LOGITS, 3, 0).top == ()  # logprobs=0: the token's own, no alternatives
    assert [t for t, _ in token_logprobs(LOGITS, 3, 5).top] == [1, 2, 4, 0, 3]  # the whole vocabulary
    none: list = []
    Sampler(SamplingParams(), none)(LOGITS)
    assert none == []  # not asked for: nothing computed


def test_token_logprobs_travel_as_json():
    lp = TokenLogprobs(-0.25, ((1, -0.25), (7, -2.5)))
    assert TokenLogprobs.from_json(lp.to_json()) == lp


def test_logit_bias_moves_the_pick_not_the_reported_logprobs():
    got: list[TokenLogprobs] = []
    sampler = Sampler(SamplingParams(logit_bias=((3, 100.0),), logprobs=1), got)
    assert sampler(LOGITS) == 3 and Sampler(SamplingParams(logit_bias=((1, -100),)))(LOGITS) == 2
    raw = LOGITS.astype(np.float64) - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    assert got[0].logprob == pytest.approx(raw[3]) and got[0].top[0][0] == 1  # the model's own distribution
    assert LOGITS[3] == np.float32(-1.0)  # the caller's logits are left as they were
    too_many = tuple((t, 1.0) for t in range(MAX_LOGIT_BIAS + 1))  # OpenAI's bound, held at every hop
    for bad in (((3, 100.5),), ((3, -101),), ((-1, 1.0),), ((3, NAN),), ((1.5, 1.0),), too_many):
        with pytest.raises(ValidationError) as e:
            SamplingParams(logit_bias=bad)
        assert e.value.errors()[0]["loc"][0] == "logit_bias"


def test_a_full_logit_bias_moves_each_logit_as_one_at_a_time_would():
    """300 entries, added in one vectorized step: the same logits as adding them one by one."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=49_152).astype(np.float32)
    bias = tuple(
        (int(t), float(b)) for t, b in zip(rng.choice(49_152, 300, replace=False), rng.uniform(-100, 100, 300))
    )
    expected = logits.copy()
    for token, b in bias:
        expected[token] += b
    params = SamplingParams(logit_bias=bias, temperature=0.7, seed=11)
    picks = [Sampler(params)(logits) for _ in range(3)]
    reference = Sampler(params.model_copy(update={"logit_bias": ()}))
    assert picks == [reference(expected)] * 3
