"""POST /v1/responses through the official SDK on a torch → MLX pair: a Responses answer
is the chat completion of the same conversation (greedy, so token for token), continued by
`previous_response_id` from SQLite exactly as if the history were resent; streamed events are
well formed and spell the whole answer; function tools round-trip, by id or resent; typed outputs
parse; log-probabilities come with the text; stored answers can be read and deleted; what Tandem
cannot honour is a 400 naming it."""

from __future__ import annotations

import json
import math

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from .cluster import for_each, pair_name

# The Responses <-> chat translation is the panel's, whatever the engines, and what a chat does on
# every engine is tests/integration/test_api_fields.py's; the Responses API on a server engine's
# decoder also runs in test_client_libraries.py (the Agents SDK, vLLM → SGLang). One route, with
# an exact decoder, so that the requests compared go together. (It ran on 4, then on 2: also
# vLLM → MLX, MLX → SGLang and MLX alone.)
ROUTES = [pair_name("torch", "mlx")]


def together(*calls):
    """Each call's answer, the calls sent at once: MLX decodes a batch exactly as one request."""
    return for_each("mlx", lambda call: call(), list(calls))


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]
GREEDY = dict(temperature=0, max_output_tokens=16)
CALLING = dict(temperature=0, max_output_tokens=48)  # room for a whole call


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def chat_text(client, model: str, messages: list[dict]) -> tuple[str, int]:
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=16)
    return r.choices[0].message.content, r.usage.prompt_tokens


@pytest.mark.parametrize("model", ROUTES)
def test_a_conversation_continues_by_previous_response_id_as_if_resent(cluster, model):
    client = cluster.client
    system = {"role": "system", "content": "Be brief."}
    question = {"role": "user", "content": "What is the capital of France?"}
    first, chat = together(
        lambda: client.responses.create(
            model=model, instructions="Be brief.", input="What is the capital of France?", **GREEDY
        ),
        lambda: chat_text(client, model, [system, question]),
    )
    assert first.status in ("completed", "incomplete") and first.output_text
    assert (first.output_text, first.usage.input_tokens) == chat
    # the instructions are not carried over (OpenAI's rule); the history is
    history = [
        question,
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Italy?"},
    ]
    second, chat = together(
        lambda: client.responses.create(model=model, previous_response_id=first.id, input="And of Italy?", **GREEDY),
        lambda: chat_text(client, model, history),
    )
    assert (second.output_text, second.usage.input_tokens) == chat
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text


@pytest.mark.parametrize("model", ROUTES)
def test_streamed_events_are_well_formed_and_spell_the_whole_answer(cluster, model):
    client = cluster.client
    whole, events = together(
        lambda: client.responses.create(model=model, input="Name three colours.", **GREEDY),
        lambda: list(client.responses.create(model=model, input="Name three colours.", stream=True, **GREEDY)),
    )
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("model", ROUTES)
def test_function_tools_round_trip_by_id_or_resent(cluster, model):
    client = cluster.client
    asked = "What is the weather in Oslo?"
    first, events = together(
        lambda: client.responses.create(model=model, input=asked, tools=TOOLS, tool_choice="required", **CALLING),
        lambda: list(
            client.responses.create(
                model=model, input=asked, tools=TOOLS, tool_choice="required", stream=True, **CALLING
            )
        ),
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls), first.output
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    streamed = [o for o in events[-1].response.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [c.arguments for c in calls]
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": "12 C, light rain"} for c in calls]
    by_id, resent = together(
        lambda: client.responses.create(
            model=model, previous_response_id=first.id, input=results, tools=TOOLS, **CALLING
        ),
        lambda: client.responses.create(
            model=model,
            input=[{"role": "user", "content": asked}, *[c.model_dump() for c in calls], *results],
            tools=TOOLS,
            store=False,
            **CALLING,
        ),
    )
    assert by_id.output_text and by_id.output_text == resent.output_text
    assert by_id.usage.input_tokens == resent.usage.input_tokens


@pytest.mark.parametrize("model", ROUTES)
def test_typed_output_parses_and_logprobs_come_with_the_text(cluster, model):
    client = cluster.client
    parsed, r = together(
        lambda: client.responses.parse(
            model=model, input="Name a city and its country.", text_format=City, temperature=0, max_output_tokens=40
        ),
        lambda: client.responses.create(
            model=model,
            input="What is the capital of France?",
            top_logprobs=3,
            include=["message.output_text.logprobs"],
            **GREEDY,
        ),
    )
    assert isinstance(parsed.output_parsed, City), parsed.output_text
    entries = r.output[0].content[0].logprobs
    assert len(entries) in (r.usage.output_tokens, r.usage.output_tokens - 1) and entries  # less a stop token's
    assert "".join(e.token for e in entries).startswith(r.output_text[:1])
    for e in entries:
        top = [t.logprob for t in e.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True) and e.logprob == pytest.approx(top[0], abs=1e-6)
        assert sum(math.exp(lp) for lp in top) <= 1 + 1e-3


def test_stored_answers_can_be_read_deleted_or_not_kept(cluster):
    client, model = cluster.client, ROUTES[0]
    kept = client.responses.create(model=model, input="Say hi.", **GREEDY)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    client.responses.delete(kept.id)
    for gone in (lambda: client.responses.retrieve(kept.id), lambda: client.responses.delete(kept.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="Again?", previous_response_id=kept.id, **GREEDY)
    assert e.value.body["param"] == "previous_response_id"
    unkept = client.responses.create(model=model, input="Say hi.", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


@pytest.mark.parametrize(
    "extra, param, says",
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "vision"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning effort"),
        ({"background": True}, "background", "background"),
        ({"top_logprobs": 21}, "top_logprobs", "top_logprobs"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format", "nope"),
        ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}, "input", "tool_call_id"),
        ({"include": ["file_search_call.results"]}, "include", "file_search_call.results"),
    ],
)
def test_what_tandem_cannot_honour_is_a_400_naming_it(cluster, extra, param, says):
    body = {"model": ROUTES[0], "input": "Hi", **extra}
    r = httpx.post(
        cluster.panel.url + "/v1/responses",
        json=body,
        headers={"Authorization": f"Bearer {cluster.api_key}"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
