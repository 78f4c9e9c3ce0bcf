"""OpenAI request fields that reach the engines, through the panel's API with the official SDK, on
every direction and on every engine alone, streaming and not.

Log-probabilities: one entry per output token, each top list sorted and the greedy token its head,
the tokens' bytes spelling the answer, streaming equal to not streaming. On a P/D route the first
token's entry comes from the engine that sampled it (the prefiller for a commit-first decoder: over
the wire in the final frame) and matches that engine alone. logit_bias: every token obeys it, a
commit-first prefiller's first pick included (on a covering set of routes: every engine in every
role it samples in). Structured outputs: `parse` with a pydantic model on the issue's routes (ten
prompts shared between them), json_object and json_schema on a covering set of routes, bad schemas
refused. Tools: a required call valid against its schema, streaming and not, and a whole call →
result → answer loop."""

from __future__ import annotations

import functools
import json
import math

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from .cluster import DIRECTIONS, for_each, pair_name

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOP = 5
ENDS = {"<|im_end|>", "<|endoftext|>"}  # a stop token's entry: reported, not part of the text
ALONE = ["torch", "mlx", "vllm", "sglang2"]
# Largest differences measured (all 14 directions, one engine thread each) between an entry's
# logprob on a P/D route and on the engine that computed it alone: a commit-first prefiller's first
# token is its own pick (measured equal, so held to float noise); a recompute-last decoder's
# first step, and every later step of any decoder, reads KV another engine computed (cross-engine
# rounding, as tests/integration/rules.py bounds). The cross-engine ones are held to twice these.
OWN_FIRST = 1e-6
CROSS_FIRST_MAX, LATER_MAX = 0.046, 0.012


def node(name: str) -> str:
    engine = "sglang" if name.startswith("sglang") else "vllm" if name.startswith("vllm") else name
    return f"node/{engine}-{name}"


def route_model(route) -> str:
    """A route: a (prefiller, decoder) pair, or an agent's name for that node alone."""
    return node(route) if isinstance(route, str) else pair_name(*route)


def decoder_of(route) -> str:
    return route if isinstance(route, str) else route[1]


def ask(client, model: str, stream: bool) -> tuple[str, list, int, str]:
    """The answer's text, its logprob entries, its completion token count and its finish reason."""
    args = dict(model=model, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=TOP)
    if not stream:
        r = client.chat.completions.create(**args)
        choice = r.choices[0]
        return choice.message.content, choice.logprobs.content, r.usage.completion_tokens, choice.finish_reason
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1, finish
    return text, entries, chunks[-1].usage.completion_tokens, finish[0]


def check(text: str, entries: list, tokens: int, finish: str) -> None:
    assert len(entries) == tokens > 0, (len(entries), tokens)
    assert finish == ("stop" if entries[-1].token in ENDS else "length"), (finish, entries[-1].token)
    for e in entries:
        top = [t.logprob for t in e.top_logprobs]
        assert len(top) == TOP and top == sorted(top, reverse=True) and top[0] <= 0, e
        assert sum(math.exp(lp) for lp in top) <= 1 + 1e-3, e
        assert e.top_logprobs[0].token == e.token and e.logprob == pytest.approx(top[0], abs=1e-6), e  # greedy
    body = entries[:-1] if entries[-1].token in ENDS else entries
    assert b"".join(bytes(e.bytes) for e in body).decode() == text, (text, [e.token for e in entries])


@pytest.fixture(scope="module")
def alone(cluster):
    return functools.cache(lambda name: ask(cluster.client, node(name), False))


@pytest.mark.parametrize("name", ALONE)
def test_each_engine_alone_reports_logprobs_streaming_or_not(cluster, alone, name):
    text, entries, tokens, finish = alone(name)
    check(text, entries, tokens, finish)
    s_text, s_entries, s_tokens, s_finish = ask(cluster.client, node(name), True)
    check(s_text, s_entries, s_tokens, s_finish)
    assert (s_text, s_tokens, s_finish) == (text, tokens, finish)
    assert [e.token for e in s_entries] == [e.token for e in entries]
    assert [e.logprob for e in s_entries] == pytest.approx([e.logprob for e in entries], abs=OWN_FIRST)


@pytest.mark.parametrize("p, d", DIRECTIONS, ids=[pair_name(*x) for x in DIRECTIONS])
def test_every_direction_answers_paris_and_reports_logprobs_from_the_engine_that_sampled(cluster, alone, p, d):
    """The same question, streaming and not: the same answer, finish reason and usage, naming
    Paris (torch<->MLX: word for word, ended by the model); the log-probabilities' rules below."""
    model = pair_name(p, d)
    text, entries, tokens, finish = ask(cluster.client, model, False)
    check(text, entries, tokens, finish)
    s_text, s_entries, s_tokens, s_finish = ask(cluster.client, model, True)
    check(s_text, s_entries, s_tokens, s_finish)
    assert (s_text, s_tokens, s_finish) == (text, tokens, finish)
    assert [e.token for e in s_entries] == [e.token for e in entries]
    assert "Paris" in text, text
    if {p, d} == {"torch", "mlx"}:
        assert (text.strip(), finish) == ("The capital of France is Paris.", "stop"), (text, finish)
    sampled_first = d if d.startswith("vllm") else p  # vLLM decodes recompute-last: it samples the first token
    first = alone(sampled_first)[1][0]
    later = alone(d)[1]
    diffs = {"first": abs(entries[0].logprob - first.logprob)}
    same = next(
        (i for i, (a, b) in enumerate(zip(entries, later)) if a.token != b.token), min(len(entries), len(later))
    )
    # the later steps compared: those before the answers part (at least one, or this checks nothing)
    assert same > 1, ([e.token for e in entries], [e.token for e in later])
    diffs["later"] = max(abs(a.logprob - b.logprob) for a, b in zip(entries[1:same], later[1:same]))
    print(
        f"\n{model}: {tokens} tokens, |first - {sampled_first} alone| {diffs['first']:.2e}, "
        f"later max {diffs['later']:.3f} over {same - 1} steps"
    )
    # a commit-first prefiller's own entry, as it sampled it; a recompute-last decoder's first step
    # already reads the other engine's KV, as every later step does
    first_max = 2 * CROSS_FIRST_MAX if sampled_first == d else OWN_FIRST
    assert entries[0].token == first.token and diffs["first"] <= first_max, diffs
    assert diffs["later"] <= 2 * LATER_MAX, diffs
    cluster.idle(p, d)


def test_errors_have_openai_shape(cluster):
    """An unknown model, fields Tandem cannot honour, a wrong key: the SDK's own error types."""
    client = cluster.client
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
            client.chat.completions.create(
                model=pair_name("torch", "mlx"), messages=[{"role": "user", "content": "hi"}], **extra
            )
    bad = openai.OpenAI(base_url=cluster.panel.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


N_PAIRS = [("torch", "mlx"), ("mlx", "torch")]


@pytest.mark.parametrize("p, d", N_PAIRS, ids=[pair_name(*x) for x in N_PAIRS])
def test_n_choices_are_sampled_apart_streaming_or_not(cluster, p, d):
    """n choices of one request: indices 0..n-1, choice i seeded seed + i (its first token is the
    one a request seeded so samples alone: later ones read logits of a batch of n rows, which
    round apart from one row's and can tip a draw at temperature 1), usage summed over the
    choices, streamed chunks interleaved by index; greedy choices are alike."""
    client, pair = cluster.client, pair_name(p, d)
    messages = [{"role": "user", "content": "Write a word."}]
    args = dict(model=pair, messages=messages, max_tokens=8, temperature=1.0, logprobs=True)
    whole = client.chat.completions.create(n=3, seed=7, **args)
    choices = sorted(whole.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2] and len({c.message.content for c in choices}) > 1, choices
    # only the first token is compared: one is enough
    alone = [client.chat.completions.create(seed=7 + i, **{**args, "max_tokens": 1}).choices[0] for i in range(3)]
    assert [c.logprobs.content[0].token for c in choices] == [a.logprobs.content[0].token for a in alone]
    assert whole.usage.completion_tokens == sum(len(c.logprobs.content) for c in choices)
    # the stream's shape (interleaved indices, usage summed) needs a few tokens, not the whole 8
    streamed_args = {**args, "max_tokens": 4}
    chunks = list(
        client.chat.completions.create(
            n=3, seed=7, stream=True, stream_options={"include_usage": True}, **streamed_args
        )
    )
    by_index = [[c.choices[0] for c in chunks if c.choices and c.choices[0].index == i] for i in range(3)]
    for streamed in by_index:
        assert "".join(c.delta.content or "" for c in streamed) and [c.finish_reason for c in streamed][-1]
    entries = sum(len(c.logprobs.content) for choice in by_index for c in choice if c.logprobs)
    assert chunks[-1].usage.completion_tokens == entries
    greedy = client.completions.create(model=pair, prompt="The capital of France is", n=2, max_tokens=3, temperature=0)
    assert [c.index for c in greedy.choices] == [0, 1] and greedy.choices[0].text == greedy.choices[1].text
    cluster.idle(p, d)


LEGACY = [("torch", "mlx"), ("mlx", "vllm"), ("mlx", "sglang2")]


@pytest.mark.parametrize("p, d", LEGACY, ids=[pair_name(*x) for x in LEGACY])
def test_text_completions_report_the_legacy_shape(cluster, p, d):
    args = dict(model=pair_name(p, d), prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=3)
    answer = cluster.client.completions.create(**args)
    whole, n = answer.choices[0], answer.usage.completion_tokens
    lp = whole.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n > 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert "".join(lp.tokens) == whole.text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-6)
    chunks = list(cluster.client.completions.create(stream=True, **args))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


@pytest.fixture(scope="module")
def forced(smol_dir):
    """A token no answer to QUESTION would choose, and its text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smol_dir), local_files_only=True)
    (token,) = tokenizer.encode(" banana", add_special_tokens=False)
    return token, tokenizer.decode([token])


# A covering set of P/D routes for what each engine applies while it samples: the first token is
# a commit-first prefiller's own pick (every prefiller engine once in that mode), every decoder
# engine continues once (vLLM's recompute-last included, which samples the first token itself).
COVERING = [("torch", "sglang2"), ("mlx", "torch"), ("vllm", "mlx"), ("sglang", "torch"), ("mlx", "vllm")]
# logit_bias on those and on every engine alone (its own prefill-then-decode path); the agent
# streams to the panel either way, so streaming to the client (the panel's) alternates. (It ran
# on all 18 routes, streaming and not.)
BIAS_ROUTES = [(route, i % 2 == 1) for i, route in enumerate([*COVERING, *ALONE])]


@pytest.mark.parametrize(
    "route, stream", BIAS_ROUTES, ids=[f"{route_model(r)}-{'stream' if s else 'whole'}" for r, s in BIAS_ROUTES]
)
def test_logit_bias_holds_on_every_token_including_a_prefillers_first(cluster, forced, route, stream):
    """+100 on one token makes every greedy pick that token: the first (a commit-first
    prefiller's own pick) as well as the decoder's."""
    model = route_model(route)
    token, text = forced
    args = dict(model=model, messages=QUESTION, max_tokens=4, temperature=0, logit_bias={str(token): 100})
    if stream:
        chunks = cluster.client.chat.completions.create(stream=True, **args)
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        answer = cluster.client.chat.completions.create(**args).choices[0].message.content
    assert answer == text * 4, (model, stream, answer)


class City(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)
    coastal: bool


CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Sydney", "Toronto", "Mumbai", "Berlin"]
# The acceptance routes (issue 21): a torch→MLX pair, a vLLM→MLX pair, an MLX→SGLang pair, a node alone.
PARSE_ROUTES = [("torch", "mlx"), ("vllm", "mlx"), ("mlx", "sglang2"), "torch"]


def share(items: list, route) -> list:
    """The route's share of `items`, dealt round the PARSE_ROUTES: together they ask every item once.
    An answer parses because the schema's grammar shapes every token, not by luck a count of
    prompts would measure, so each route needs a few distinct prompts, not all of them."""
    return items[PARSE_ROUTES.index(route) :: len(PARSE_ROUTES)]


@pytest.mark.parametrize("route", PARSE_ROUTES, ids=[route_model(r) for r in PARSE_ROUTES])
def test_parse_returns_a_typed_object_for_ten_prompts(cluster, route):
    """`client.chat.completions.parse(response_format=<pydantic model>)`: the SDK sends a strict
    json_schema; every answer parses into the model (the SDK validates it): the ten prompts, dealt
    round the four routes (2 or 3 each), 10 of 10."""

    def describe(city: str):
        return cluster.client.chat.completions.parse(
            model=route_model(route),
            messages=[{"role": "user", "content": f"Describe the city of {city}."}],
            response_format=City,
            max_tokens=60,
            temperature=0,
        ).choices[0]

    cities = share(CITIES, route)
    choices = for_each(decoder_of(route), describe, cities)
    assert [c.finish_reason for c in choices] == ["stop"] * len(cities), choices
    parsed = [c.message.parsed for c in choices]
    assert sum(isinstance(p, City) for p in parsed) == len(cities), parsed
    print(f"\n{route_model(route)}: {[p.city for p in parsed]}")


# Structured outputs on the COVERING routes: the grammar is the first token's engine's and the
# decoder's; the server engines alone too (their own prefill-then-decode path: SGLang's
# decode-role node flips its role for it). Each route asks json_object whole and json_schema
# streamed. (It ran on all 18 routes.)
JSON_ROUTES = [*COVERING, "vllm", "sglang2"]


@pytest.mark.parametrize("route", JSON_ROUTES, ids=[route_model(r) for r in JSON_ROUTES])
def test_json_outputs_on_covering_routes_streaming_or_not(cluster, route):
    """json_object and a json_schema: the first token (a commit-first prefiller's own pick)
    already follows the grammar, and the decoder continues it."""
    schema = City.model_json_schema()
    formats = [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}]
    for fmt, stream in zip(formats, (False, True), strict=True):
        args = dict(model=route_model(route), messages=[{"role": "user", "content": "Describe Paris."}])
        args.update(max_tokens=60, temperature=0, response_format=fmt)
        if stream:
            chunks = cluster.client.chat.completions.create(stream=True, **args)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = cluster.client.chat.completions.create(**args).choices[0].message.content
        value = json.loads(text)
        assert isinstance(value, dict), text
        if fmt["type"] == "json_schema":
            City.model_validate(value)


def test_a_schema_that_cannot_compile_is_400_before_any_compute(cluster):
    for fmt, words in [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "Invalid type: foo"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}, "/nope"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
        ({"type": "yaml"}, "type must be"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            cluster.client.chat.completions.create(
                model=pair_name("torch", "mlx"), messages=QUESTION, max_tokens=4, response_format=fmt
            )
        error = e.value.body
        assert error["param"] == "response_format" and words in error["message"], error


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASKS = [
    "What is the weather in Oslo?",
    "Is it raining in Lima?",
    "How hot is Cairo today?",
    "Weather for Tokyo, please.",
    "Should I take a coat in Berlin?",
]


@pytest.mark.parametrize("route", PARSE_ROUTES, ids=[route_model(r) for r in PARSE_ROUTES])
def test_a_required_tool_call_always_matches_its_schema_and_the_loop_completes(cluster, route):
    """tool_choice="required": arguments valid against the tool's schema (jsonschema) every time,
    streaming and not, as the SDK reassembles them (two asks a route, all five over the four
    routes: the forced call's grammar shapes every token); then the call's result as a `tool`
    message and a final answer in text."""
    model, schema = route_model(route), WEATHER["function"]["parameters"]

    def call_for(ask_text: str):
        args = dict(
            model=model,
            messages=[{"role": "user", "content": ask_text}],
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=60,
            temperature=0,
        )
        whole = cluster.client.chat.completions.create(**args).choices[0]
        with cluster.client.chat.completions.stream(**args) as s:
            return whole, s.get_final_completion().choices[0]

    i = PARSE_ROUTES.index(route)
    asks = ASKS[i : i + 2]
    for whole, final in for_each(decoder_of(route), call_for, asks):
        assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
        (call,) = whole.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schema)
        (streamed,) = final.message.tool_calls
        assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    messages = [{"role": "user", "content": asks[-1]}]
    # the loop: the call, its result, the answer
    messages.append(whole.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "12 degrees celsius, light rain"})
    answer = cluster.client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], max_tokens=16, temperature=0
    )  # an answer in text: a few tokens show it (it had 40)
    print(
        f"\n{model}: {call.function.arguments} -> {answer.choices[0].message.content!r} ({answer.choices[0].finish_reason})"
    )
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content, answer
