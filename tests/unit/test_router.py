"""The panel's routing, driven by fake agents behind a counting httpx transport.

The router is the subject here, so the agents are fakes: they answer what a real decoder answers
(its NDJSON stream, its 4xx/429/502 before a stream) and record every call the panel makes. The
real exchange between real agents is tests/system/test_panel_routing.py's and tests/integration/test_agent_http_pd.py's.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from sqlmodel import Session, select

from control_panel.api.bodies import ChatBody
from control_panel.api.errors import OpenAIError
from control_panel.app import create_app
from control_panel.models import Node, Pool, PoolMember, RequestLog
from control_panel.router import RouteError, Router, RouteStats, Target
from control_panel.security import create_api_key
from control_panel.state import open_state
from tandem_protocol.api import PREFILLER_FAILED
from tandem_protocol.sampling import SamplingParams

P, D = "http://p.test:7001", "http://d.test:7002"
PROMPT = list(range(1, 41))
TOKENS = [{"token": 100 + i, "text": f" w{i}"} for i in range(3)]
DONE = {"done": True, "finish_reason": "length", "wire_bytes": 12345}


class Lines(httpx.AsyncByteStream):
    """An NDJSON body; `hold`: after the lines, wait (a decode still running) until closed."""

    def __init__(self, lines: list[dict], hold: bool = False):
        self.lines, self.hold, self.closed = lines, hold, asyncio.Event()

    async def __aiter__(self):
        for line in self.lines:
            yield (json.dumps(line) + "\n").encode()
        if self.hold:
            await self.closed.wait()

    async def aclose(self) -> None:
        self.closed.set()


def stream(lines: list[dict], hold: bool = False) -> httpx.Response:
    return httpx.Response(200, stream=Lines(lines, hold), headers={"content-type": "application/x-ndjson"})


def refusal(status: int, kind: str, message: str, headers: dict | None = None, **extra) -> httpx.Response:
    return httpx.Response(status, json={"error": {"type": kind, "message": message, **extra}}, headers=headers)


class FakeAgents(httpx.AsyncBaseTransport):
    """Both agents of a pair as the panel reaches them. Every call is counted; `answers` maps a
    route's last part to a function of the JSON body that gives D's answer."""

    def __init__(self, **answers: Callable[[dict], httpx.Response]):
        self.reset(**answers)

    def reset(self, **answers: Callable[[dict], httpx.Response]) -> FakeAgents:
        self.calls: list[tuple[str, str, dict | None]] = []  # (agent, path, body)
        self.answers = {
            "/v1/tokenize": lambda body: httpx.Response(200, json={"token_ids": PROMPT}),
            "/v1/decode": lambda body: stream([*TOKENS, DONE]),
            "/v1/generate": lambda body: stream([*TOKENS, DONE]),
            **{"/v1/" + name: answer for name, answer in answers.items()},
        }
        return self

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        agent = {7001: "P", 7002: "D"}[request.url.port]  # whatever the host
        self.calls.append((agent, request.url.path, body))
        answer = self.answers.get(request.url.path)
        return answer(body) if agent == "D" and answer else httpx.Response(404, json={"error": {"message": "?"}})

    @property
    def paths(self) -> list[tuple[str, str]]:
        return [(agent, path) for agent, path, _ in self.calls]


# ---- through the panel's OpenAI API ------------------------------------------------------------
def pair_app(data_dir: Path, agents: FakeAgents, p_url: str = P, d_url: str = D) -> FastAPI:
    """The real panel app in-process, its router on fake agents: pair "pd" falls back to D alone,
    pair "pd-strict" never does; `app.state.api_key` is a key without limits."""
    key = "tdm_unit-cluster-0123456789abcdef"
    state = open_state(data_dir, key)
    state.router = Router(key, agents)
    app = create_app(state)
    with Session(app.state.db) as s:
        p, d = Node(name="p", url=p_url, paired=True), Node(name="d", url=d_url, paired=True)
        s.add_all([p, d])
        s.flush()
        for name, fallback in (("pd", "decode_alone"), ("pd-strict", "fail")):
            pool = Pool(name=name, context_length=2048, local_threshold=8, fallback=fallback, page_encoding="zstd")
            s.add(pool)
            s.flush()
            for node, role in ((p, "prefill"), (d, "decode")):
                s.add(PoolMember(pool_id=pool.id, node_id=node.id, role=role, engine="torch", model_path="/m"))
        s.commit()
    app.state.api_key = create_api_key(app.state.db, "unit")
    app.state.agents = agents
    return app


@pytest.fixture(scope="module")
def panel(tmp_path_factory):
    return pair_app(tmp_path_factory.mktemp("router"), FakeAgents())


def logged_error(app, r: httpx.Response) -> str:
    """The request log's detail of a failed request, by the id its answer names."""
    rid = re.search(r"\(request (\S+)\)", r.json()["error"]["message"]).group(1)
    with Session(app.state.db) as s:
        return s.exec(select(RequestLog).where(RequestLog.request_id == rid)).one().error


async def _post(app, body: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {app.state.api_key}", "content-type": "application/json"}
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", headers=headers) as client:
        try:
            return await client.post(path, content=body)
        finally:
            await app.state.router.aclose()  # its clients belong to this event loop


def ask(panel, body: dict, path: str = "/v1/chat/completions", **answers) -> tuple[httpx.Response, FakeAgents]:
    agents = panel.state.agents.reset(**answers)
    return asyncio.run(_post(panel, json.dumps(body).encode(), path)), agents  # NaN as Python's json sends it


def sse_chunks(r: httpx.Response) -> list[dict]:
    return [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]


def chat(**extra) -> dict:
    return {"model": "pd", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0} | extra


def test_a_pair_request_is_two_calls_tokenize_and_decode(panel):
    r, agents = ask(panel, chat())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == " w0 w1 w2"
    assert agents.paths == [("D", "/v1/tokenize"), ("D", "/v1/decode")]
    decode = agents.calls[1][2]
    assert SamplingParams(**decode.pop("sampling")) == SamplingParams(max_tokens=3)
    assert re.fullmatch(r"[0-9a-f]{64}", decode.pop("cache_salt"))  # the key's own (tests/unit/test_cache_salt.py)
    assert decode == {"token_ids": PROMPT, "prefill_url": P, "page_encoding": "zstd"}


def test_a_prompt_under_the_threshold_is_one_generate_on_d(panel):
    r, agents = ask(panel, chat(), tokenize=lambda body: httpx.Response(200, json={"token_ids": [1, 2, 3]}))
    assert r.status_code == 200, r.text
    assert agents.paths == [("D", "/v1/tokenize"), ("D", "/v1/generate")]


def p_failed_in_stream(body: dict) -> httpx.Response:
    return stream([{"error": {"type": "FrameError", "message": "checksum mismatch on page 0", PREFILLER_FAILED: True}}])


def p_unreachable(body: dict) -> httpx.Response:
    return refusal(502, "PrefillerUnreachable", "prefiller unreachable: http://p.test:7001", **{PREFILLER_FAILED: True})


@pytest.mark.parametrize("decode", [p_failed_in_stream, p_unreachable])
def test_d_reports_p_failed_before_the_first_token_and_the_panel_serves_d_alone(panel, decode):
    r, agents = ask(panel, chat(), decode=decode)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " w0 w1 w2", r.text
    assert agents.paths == [("D", "/v1/tokenize"), ("D", "/v1/decode"), ("D", "/v1/generate")]
    assert agents.calls[2][2]["token_ids"] == PROMPT and "prefill_url" not in agents.calls[2][2]


@pytest.mark.parametrize("decode", [p_failed_in_stream, p_unreachable])
def test_no_fallback_when_the_pair_forbids_it(panel, decode):
    r, agents = ask(panel, chat(model="pd-strict"), decode=decode)
    assert r.status_code == 503 and "fallback disabled" in logged_error(panel, r), r.text
    assert agents.paths == [("D", "/v1/tokenize"), ("D", "/v1/decode")]


def test_a_failure_of_d_itself_is_not_retried_on_d(panel):
    """An error line without the prefiller mark (D's engine failed): reported, never re-run."""
    r, agents = ask(panel, chat(), decode=lambda body: stream([{"error": {"type": "engine_error", "message": "boom"}}]))
    assert r.status_code == 503 and "boom" in logged_error(panel, r), r.text
    assert agents.paths == [("D", "/v1/tokenize"), ("D", "/v1/decode")]


def test_a_busy_prefiller_is_429_with_d_s_retry_after(panel):
    r, agents = ask(
        panel, chat(), decode=lambda body: refusal(429, "BudgetTimeout", "busy", headers={"Retry-After": "7"})
    )
    assert r.status_code == 429 and r.headers["Retry-After"] == "7", (r.status_code, r.headers)
    assert r.json()["error"]["type"] == "rate_limit_exceeded"
    assert agents.paths == [("D", "/v1/tokenize"), ("D", "/v1/decode")]


@pytest.mark.parametrize(
    "message",
    [
        "prompt of 40 tokens plus max_tokens 3000 exceeds the context length 2048",
        "the decode engine (torch) cannot apply min_p: leave it at the default or use another node",
    ],
)
def test_d_refuses_before_any_compute_and_the_client_gets_400(panel, message):
    r, agents = ask(panel, chat(), decode=lambda body: refusal(400, "RequestError", message))
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert agents.paths == [("D", "/v1/tokenize"), ("D", "/v1/decode")]  # no fallback, nothing more


@pytest.mark.parametrize(
    "name, value, bound",
    [
        ("temperature", -1, "greater than or equal to 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("top_p", 0, "greater than 0"),
        ("seed", 2**64, "less than 9223372036854775808"),
        ("presence_penalty", "x", "valid number"),
        ("max_tokens", 0, "greater than or equal to 1"),
        ("max_completion_tokens", -5, "greater than or equal to 1"),
        ("min_p", float("nan"), "finite number"),
    ],
)
def test_bad_sampling_is_400_naming_the_field_and_bound_before_any_call(panel, name, value, bound):
    body = {**chat(), name: value}
    if name == "max_completion_tokens":
        del body["max_tokens"]
    r, agents = ask(panel, body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == name, r.text
    assert name in error["message"] and bound in error["message"], error
    assert agents.calls == []  # refused at the panel's edge: no agent was asked anything


def test_openai_sampling_maps_onto_sampling_params():
    body = ChatBody(model="pd", messages=[{"role": "user", "content": "hi"}], top_k=5, seed=-1, min_p=0.1)
    assert body.sampling() == SamplingParams(max_tokens=256, temperature=1.0, top_k=5, seed=-1, min_p=0.1)
    with pytest.raises(OpenAIError) as e:
        ChatBody(model="pd", messages=[{"role": "user", "content": "hi"}], temperature=True).sampling()
    assert e.value.param == "temperature"


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "greater than or equal to 0"),
        ({"top_logprobs": 3}, "top_logprobs", "needs `logprobs`"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
            "response_format",
            "Invalid type: foo",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "type must be"),
        ({"logit_bias": {"7": 101}}, "logit_bias", "less than or equal to 100"),
    ],
)
def test_bad_logprobs_and_stop_lists_are_400_before_any_call(panel, extra, param, words):
    refused_before_any_call(panel, extra, param, words)


def refused_before_any_call(panel, extra: dict, param: str, words: str) -> None:
    """A chat with `extra` is a 400 naming `param` and saying `words`, and no agent was asked."""
    r, agents = ask(panel, chat(**extra))
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and words in error["message"], r.text
    assert agents.calls == []


def test_response_format_reaches_the_decoder_as_a_json_schema(panel):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for fmt, expected in [
        ({"type": "json_object"}, {"type": "object"}),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}, schema),
        ({"type": "text"}, None),
    ]:
        r, agents = ask(panel, chat(response_format=fmt))
        assert r.status_code == 200, r.text
        sent = agents.calls[-1][2]["sampling"].get("json_schema")
        assert (None if sent is None else json.loads(sent)) == expected, (fmt, sent)


def test_logit_bias_reaches_the_decoder_as_token_id_pairs(panel):
    r, agents = ask(panel, chat(logit_bias={"7": 5, "11": -100}))
    assert r.status_code == 200, r.text
    assert agents.calls[-1][2]["sampling"]["logit_bias"] == [[7, 5.0], [11, -100.0]]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def text_lines(text: str) -> list[dict]:
    """An agent's token lines whose texts make up `text` (a few characters per token)."""
    return [{"token": 100 + i, "text": text[i : i + 5]} for i in range(0, len(text), 5)] + [DONE]


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "tools[0]"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "given twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]},
            "tools",
            "Invalid type: foo",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools",
            "JSON schema object",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "tool_choice",
            "naming one of",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be none"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot both",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "x"}]},
            "messages",
            "earlier assistant",
        ),
    ],
)
def test_bad_tools_and_tool_messages_are_400_before_any_call(panel, extra, param, words):
    refused_before_any_call(panel, extra, param, words)


def test_a_forced_call_is_constrained_and_answered_as_tool_calls_whole_and_streamed(panel):
    calls_json = '[{"name":"get_weather","parameters":{"city":"Oslo"}}]'
    body = chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    r, agents = ask(panel, body, decode=lambda b: stream(text_lines(calls_json)))
    assert r.status_code == 200, r.text
    tokenize, decode = agents.calls[0][2], agents.calls[-1][2]
    assert tokenize["tools"] == [WEATHER]  # the decoder's template (or Tandem's prompt) renders them
    schema = json.loads(decode["sampling"]["json_schema"])
    assert schema["type"] == "array" and schema["maxItems"] == 1
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'} and call["id"].startswith(
        "call_"
    )
    r, _ = ask(panel, {**body, "stream": True}, decode=lambda b: stream(text_lines(calls_json)))
    chunks = sse_chunks(r)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["get_weather"]
    assert not any(d.get("content") for d in deltas) and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_reads_a_call_out_of_the_text_and_streams_the_text_before_it(panel):
    text = 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>'
    body = chat(tools=[WEATHER])
    r, agents = ask(panel, body, decode=lambda b: stream(text_lines(text)))
    assert agents.calls[-1][2]["sampling"].get("json_schema") is None  # auto: unconstrained
    message = r.json()["choices"][0]["message"]
    assert (
        message["content"] == "Let me look." and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Lima"}'
    )
    r, _ = ask(panel, {**body, "stream": True}, decode=lambda b: stream(text_lines(text)))
    deltas = [c["choices"][0]["delta"] for c in sse_chunks(r)]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look."
    assert sum("tool_calls" in d for d in deltas) == 1
    # no call in the text: a plain answer; tool_choice none: tools are not even rendered
    r, _ = ask(panel, body, decode=lambda b: stream(text_lines("It is sunny.")))
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    r, agents = ask(panel, chat(tools=[WEATHER], tool_choice="none"), decode=lambda b: stream(text_lines(text)))
    assert "tools" not in agents.calls[0][2] and r.json()["choices"][0]["message"]["content"] == text


def test_a_tool_message_answering_a_call_reaches_the_template(panel):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    r, agents = ask(panel, chat(messages=messages, tools=[WEATHER]))
    assert r.status_code == 200, r.text
    assert agents.calls[0][2]["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_reasoning_goes_to_reasoning_content_and_template_kwargs_reach_the_template(panel):
    answer = "The user asks about France.</think>Paris."
    body = chat(chat_template_kwargs={"enable_thinking": True})
    opened = {"tokenize": lambda b: httpx.Response(200, json={"token_ids": PROMPT, "reasoning": True})}
    r, agents = ask(panel, body, decode=lambda b: stream(text_lines(answer)), **opened)
    assert agents.calls[0][2]["chat_template_kwargs"] == {"enable_thinking": True}
    message = r.json()["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("Paris.", "The user asks about France.")
    r, _ = ask(panel, {**body, "stream": True}, decode=lambda b: stream(text_lines(answer)), **opened)
    deltas = [c["choices"][0]["delta"] for c in sse_chunks(r)]
    assert "".join(d.get("content") or "" for d in deltas) == "Paris."
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The user asks about France."


def entry(token: str, logprob: float, top: list[tuple[str, float]]) -> dict:
    def one(t, lp):
        return {"token": t, "logprob": lp, "bytes": list(t.encode())}

    return {**one(token, logprob), "top_logprobs": [one(t, lp) for t, lp in top]}


# what an agent sends for a request that asked for 2 alternatives (node_agent/token_stream.py)
LOGPROB_LINES = [
    {"token": 100 + i, "text": text, "logprobs": entry(text, -0.1 * (i + 1), [(text, -0.1 * (i + 1)), ("x", -3.0)])}
    for i, text in enumerate([" Par", "is", ".", " The"])
]


def test_logprobs_reach_the_decoder_and_come_back_in_openai_shape_whole_and_streamed(panel):
    body = chat(logprobs=True, top_logprobs=2, max_tokens=4)
    r, agents = ask(panel, body, decode=lambda body: stream([*LOGPROB_LINES, DONE]))
    assert r.status_code == 200, r.text
    assert agents.calls[-1][2]["sampling"]["logprobs"] == 2
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == " Paris. The"
    assert choice["logprobs"]["content"] == [line["logprobs"] for line in LOGPROB_LINES]
    r, _ = ask(panel, {**body, "stream": True}, decode=lambda body: stream([*LOGPROB_LINES, DONE]))
    chunks = sse_chunks(r)
    got = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert got == [line["logprobs"] for line in LOGPROB_LINES]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == " Paris. The"
    # not asked: none asked of the decoder, none in the answer
    r, agents = ask(panel, chat(), decode=lambda body: stream([*TOKENS, DONE]))
    assert agents.calls[-1][2]["sampling"].get("logprobs") is None and r.json()["choices"][0]["logprobs"] is None


def test_a_stop_string_keeps_the_logprobs_of_the_tokens_up_to_it(panel):
    """Text held back (it could begin a stop string) sends its tokens' entries with what follows;
    the token that completes the stop string is the last one reported."""
    body = chat(logprobs=True, top_logprobs=2, max_tokens=4, stop=[". T"])
    for streamed in (False, True):
        r, _ = ask(panel, {**body, "stream": streamed}, decode=lambda body: stream([*LOGPROB_LINES, DONE]))
        if streamed:
            chunks = sse_chunks(r)
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            got = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
        else:
            text, got = r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["logprobs"]["content"]
        assert text == " Paris" and got == [line["logprobs"] for line in LOGPROB_LINES], streamed


def test_text_completion_logprobs_are_the_legacy_shape(panel):
    body = {"model": "pd", "prompt": "The capital", "max_tokens": 4, "logprobs": 2, "temperature": 0}
    r, agents = ask(panel, body, "/v1/completions", decode=lambda body: stream([*LOGPROB_LINES, DONE]))
    assert r.status_code == 200, r.text
    assert agents.calls[-1][2]["sampling"]["logprobs"] == 2
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [" Par", "is", ".", " The"] and lp["text_offset"] == [0, 4, 6, 7]
    assert lp["token_logprobs"] == [line["logprobs"]["logprob"] for line in LOGPROB_LINES]
    assert lp["top_logprobs"][0] == {" Par": -0.1, "x": -3.0}
    r, _ = ask(panel, {**body, "logprobs": 21}, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


# ---- the router alone: cancellation ---------------------------------------------------------------
def test_a_client_that_goes_away_closes_d_s_stream_and_nothing_else_is_called():
    held = Lines(TOKENS, hold=True)
    agents = FakeAgents(decode=lambda body: httpx.Response(200, stream=held))
    router = Router("key", agents)
    target = Target("pd", (D,), (P,))

    async def main():
        events = router.run(target, PROMPT, SamplingParams(max_tokens=100), RouteStats())
        got = [await events.__anext__() for _ in range(2)]
        await events.aclose()  # the client went away mid-answer
        await router.aclose()
        return got

    assert asyncio.run(main()) == TOKENS[:2]
    assert held.closed.is_set()  # D sees its client hang up: D stops and cancels P's handoff
    assert agents.paths == [("D", "/v1/decode")]


def test_d_unreachable_is_503():
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    async def main():
        router = Router("key", httpx.MockTransport(down))
        try:
            return [e async for e in router.run(Target("pd", (D,), (P,)), PROMPT, SamplingParams(), RouteStats())]
        finally:
            await router.aclose()

    with pytest.raises(RouteError) as e:
        asyncio.run(main())
    assert e.value.status == 503 and "not reachable" in str(e.value)


def test_text_content_parts_are_joined_and_ignore_eos_reaches_the_decoder(panel):
    """What vLLM's load client sends: content as an array of text parts, max_completion_tokens
    and ignore_eos."""
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    body = chat(messages=[{"role": "user", "content": parts}], ignore_eos=True, max_completion_tokens=3)
    del body["max_tokens"]
    r, agents = ask(panel, body)
    assert r.status_code == 200, r.text
    assert agents.calls[0][2]["messages"] == [{"role": "user", "content": "first\nsecond"}]
    assert SamplingParams(**agents.calls[1][2]["sampling"]) == SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.mark.parametrize(
    "part, kind",
    [
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
            "an `image_url` part needs a model with vision",
        ),
        ("plain", "a part of type `str`"),
        ({"type": "input_audio"}, "a part of type `input_audio`"),
    ],
)
def test_a_content_part_that_is_not_text_is_refused_by_name(panel, part, kind):
    content = [{"type": "text", "text": "look"}, part]
    for role in ("user", "system", "assistant"):
        r, agents = ask(panel, chat(messages=[{"role": "user", "content": "hi"}, {"role": role, "content": content}]))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and f"messages[1].content: {kind}" in error["message"], error
    assert agents.paths == []


def test_a_chat_the_template_cannot_render_is_400_without_the_decoder_s_address(panel):
    r, agents = ask(panel, chat(), tokenize=lambda body: refusal(400, "RequestError", "cannot tokenize: bad role"))
    assert r.status_code == 400 and r.json()["error"]["message"] == "cannot tokenize: bad role", r.text
    assert "d.test" not in r.text
