"""The official `openai` client against the panel, through torch<->MLX pairs of real agents."""

from __future__ import annotations

import openai
import pytest

from ..agents import AgentProcess, PanelProcess, side_by_side
from ..conftest import prompt

LENGTHS = [64, 65, 66, 128, 129, 130, 193]


@pytest.fixture(scope="module")
def cluster(smol_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("panel")
    with side_by_side(
        lambda: AgentProcess("torch", smol_dir, home / "torch"), lambda: AgentProcess("mlx", smol_dir, home / "mlx")
    ) as (t, m):
        with PanelProcess(
            home / "panel", "--pair", f"t2m={t.url},{m.url},threshold=1", "--pair", f"m2t={m.url},{t.url},threshold=1"
        ) as panel:
            client = openai.OpenAI(base_url=panel.url + "/v1", api_key=panel.api_key, max_retries=0)
            yield {"panel": panel, "client": client, "torch": t, "mlx": m}


def test_models_are_listed(cluster):
    names = {m.id for m in cluster["client"].models.list()}
    assert {"t2m", "m2t", "node/torch-torch", "node/mlx-mlx"} <= names


@pytest.mark.parametrize("pair, decoder", [("t2m", "node/mlx-mlx"), ("m2t", "node/torch-torch")])
def test_completions_stream_equals_non_stream_equals_single_node(cluster, long_ids, pair, decoder):
    client = cluster["client"]
    for n in LENGTHS:
        ids = prompt(long_ids, n)
        args = dict(prompt=ids, max_tokens=16, temperature=0)
        whole = client.completions.create(model=pair, **args)
        streamed = "".join(c.choices[0].text for c in client.completions.create(model=pair, stream=True, **args))
        single = client.completions.create(model=decoder, **args).choices[0].text
        assert whole.choices[0].text == streamed == single, (pair, n)
        assert whole.usage.prompt_tokens == n and whole.usage.completion_tokens <= 16


@pytest.mark.parametrize("pair", ["t2m", "m2t"])
def test_chat_stream_and_usage(cluster, pair):
    client = cluster["client"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=pair, messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].message.content.strip() == "The capital of France is Paris."
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=pair,
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_errors_have_openai_shape(cluster):
    client = cluster["client"]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"
    for extra in (
        {"n": 17},
        {"n": 0},
        {"modalities": ["audio"]},
        {"functions": [{"name": "f"}]},
        {"tools": [{"type": "x"}]},
    ):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="t2m", messages=[{"role": "user", "content": "hi"}], **extra)
    bad = openai.OpenAI(base_url=cluster["panel"].url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.parametrize("pair", ["t2m", "m2t"])
def test_n_choices_are_sampled_apart_streaming_or_not(cluster, pair):
    """n choices of one request: indices 0..n-1, choice i seeded seed + i (its first token is the
    one a request seeded so samples alone: later ones read logits of a batch of n rows, which
    round apart from one row's and can tip a draw at temperature 1), usage summed over the
    choices, streamed chunks interleaved by index; greedy choices are alike."""
    client = cluster["client"]
    messages = [{"role": "user", "content": "Write a word."}]
    args = dict(model=pair, messages=messages, max_tokens=8, temperature=1.0, logprobs=True)
    whole = client.chat.completions.create(n=3, seed=7, **args)
    choices = sorted(whole.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2] and len({c.message.content for c in choices}) > 1, choices
    alone = [client.chat.completions.create(seed=7 + i, **args).choices[0] for i in range(3)]
    assert [c.logprobs.content[0].token for c in choices] == [a.logprobs.content[0].token for a in alone]
    assert whole.usage.completion_tokens == sum(len(c.logprobs.content) for c in choices)
    chunks = list(
        client.chat.completions.create(n=3, seed=7, stream=True, stream_options={"include_usage": True}, **args)
    )
    by_index = [[c.choices[0] for c in chunks if c.choices and c.choices[0].index == i] for i in range(3)]
    for streamed in by_index:
        assert "".join(c.delta.content or "" for c in streamed) and [c.finish_reason for c in streamed][-1]
    entries = sum(len(c.logprobs.content) for choice in by_index for c in choice if c.logprobs)
    assert chunks[-1].usage.completion_tokens == entries
    greedy = client.completions.create(model=pair, prompt="The capital of France is", n=2, max_tokens=6, temperature=0)
    assert [c.index for c in greedy.choices] == [0, 1] and greedy.choices[0].text == greedy.choices[1].text
