"""Tool calling's pieces (tandem_protocol/tools.py, control_panel/api/tool_calls.py): the schema a
forced call follows, reading calls out of text in the common formats, Tandem's rendering for a
template without tools, and the streaming reader that holds back what may be a call."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_panel.api.tool_calls import ToolCallText
from tandem_protocol.grammar import json_schema_problem
from tandem_protocol.tools import TOOL_PROMPT, forced_calls, forced_schema, parse_calls, render_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]


def test_forced_schemas_compile_and_read_back():
    for choice, parallel in (
        ("required", False),
        ("required", True),
        ({"type": "function", "function": {"name": "get_weather"}}, True),
    ):
        schema = forced_schema(TOOLS, choice, parallel)
        assert json_schema_problem(json.dumps(schema)) is None, schema
    assert forced_schema(TOOLS, "required", False)["maxItems"] == 1 and "maxItems" not in forced_schema(
        TOOLS, "required", True
    )
    (call,) = forced_calls('[{"name":"get_weather","parameters":{"city":"Oslo"}}]', TOOLS, "required")
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"}) and call.id.startswith("call_")
    # objects that list properties are closed (nested, under items and $defs too) unless they say otherwise
    open_tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "o": {"type": "object", "properties": {"a": {}}},
                    "k": {"type": "object", "properties": {}, "additionalProperties": True},
                },
            },
        },
    }
    args = forced_schema([open_tool], {"type": "function", "function": {"name": "f"}}, True)
    assert args["additionalProperties"] is False and args["properties"]["o"]["additionalProperties"] is False
    assert args["properties"]["k"]["additionalProperties"] is True
    item = forced_schema([open_tool], "required", True)["items"]["properties"]["parameters"]
    assert item["additionalProperties"] is False and json_schema_problem(json.dumps(item)) is None
    (call,) = forced_calls('{"city":"Lima"}', TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Lima"})


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
            "",
            [("get_weather", {"city": "Oslo"})],
        ),
        (  # Qwen/Hermes: text around, two calls, the last left open at the end
            'Let me check.<tool_call>{"name":"get_time","arguments":{}}</tool_call>\n<tool_call>{"name":"get_weather","arguments":{"city":"Rome"}}',
            "Let me check.",
            [("get_time", {}), ("get_weather", {"city": "Rome"})],
        ),
        ('{"name": "get_weather", "parameters": {"city": "Kyiv"}}', "", [("get_weather", {"city": "Kyiv"})]),  # Llama 3
        ('<|python_tag|>{"name": "get_time", "parameters": {}}', "", [("get_time", {})]),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),  # stays text
        (
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
            [],
        ),
        ('{"city": "Oslo"}', '{"city": "Oslo"}', []),  # JSON, but not a call
        ("The weather is fine.", "The weather is fine.", []),
    ],
)
def test_calls_are_read_in_the_common_formats(text, content, calls):
    got_content, got = parse_calls(text, TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


def test_a_template_without_tools_gets_tandems_prompt_and_blocks():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    out = render_messages(messages, TOOLS, template_knows_tools=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith(
        "Be brief.\n\n" + TOOL_PROMPT.split("{tools}")[0]
    )
    assert json.dumps(WEATHER["function"]) in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    known = render_messages(messages, TOOLS, template_knows_tools=True)
    assert known[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"} and known[3] == messages[3]


def stream(reader: ToolCallText, pieces: list[str]) -> tuple[str, str, list]:
    sent = "".join(reader.feed(p) for p in pieces)
    rest, calls = reader.finish()
    return sent, rest, [(c.name, json.loads(c.arguments)) for c in calls]


def test_the_stream_sends_text_until_a_call_may_begin():
    text = 'Checking now. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    for size in (1, 3, 7, len(text)):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        sent, rest, calls = stream(ToolCallText(TOOLS, "auto", forced=False), pieces)
        assert (sent, rest, calls) == ("Checking now. ", "", [("get_weather", {"city": "Oslo"})]), size
    # a "<" that does not open a call goes out once it cannot
    assert stream(ToolCallText(TOOLS, "auto", False), ["a <", "b> c"]) == ("a <b> c", "", [])
    # an answer that opens with "{" is held: Llama 3's call is the whole answer
    assert stream(ToolCallText(TOOLS, "auto", False), ['{"name": "get_time", ', '"parameters": {}}']) == (
        "",
        "",
        [("get_time", {})],
    )
    assert stream(ToolCallText(TOOLS, "auto", False), ['{"a": 1}']) == ("", '{"a": 1}', [])
    # forced: nothing goes out as text; a cut-short call stays text
    forced = ToolCallText(TOOLS, "required", forced=True)
    assert stream(forced, ['[{"name":"get_time",', '"parameters":{}}]']) == ("", "", [("get_time", {})])
    assert stream(ToolCallText(TOOLS, "required", True), ['[{"name":"get_ti']) == ("", '[{"name":"get_ti', [])


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=8)
    | st.sampled_from(["function", "get_weather", "c1", "tool", "assistant", "required", "auto"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "function",
                    "name",
                    "parameters",
                    "id",
                    "role",
                    "content",
                    "tool_calls",
                    "tool_call_id",
                    "arguments",
                ]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(
    tools=st.none() | st.lists(st.dictionaries(st.sampled_from(["type", "function"]), JSON, max_size=2), max_size=2),
    choice=JSON,
    messages=st.lists(
        st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "tool_call_id"]), JSON, max_size=4),
        min_size=1,
        max_size=3,
    ),
)
def test_whatever_tools_and_messages_arrive_the_answer_is_a_400_or_a_request(tools, choice, messages):
    """No shape of tools, tool_choice or tool messages gets past the checks as anything but an
    OpenAIError (a 400) or a request the agents can be sent."""
    from pydantic import ValidationError

    from control_panel.api.bodies import ChatBody
    from control_panel.api.errors import OpenAIError

    try:
        body = ChatBody(model="m", messages=messages, tools=tools, tool_choice=choice)
    except ValidationError:  # FastAPI answers these with a 400 of their own
        return
    try:
        body.check()
        body.sampling()
    except OpenAIError as e:
        assert e.status == 400 and e.param, e


@pytest.mark.parametrize(
    "open_in_prompt, text, reasoning, content",
    [
        (True, "Let me think.\n</think>\n\nParis.", "Let me think.\n", "Paris."),
        (False, "<think>Hmm, France.</think>Paris.", "Hmm, France.", "Paris."),
        (False, "  <think>x</think>y", "x", "y"),
        (False, "Paris. <think> is a tag", "", "Paris. <think> is a tag"),  # only an answer's opening counts
        (True, "never closed", "never closed", ""),
        (False, "Paris.", "", "Paris."),
    ],
)
def test_reasoning_is_kept_out_of_the_content_whatever_the_pieces(open_in_prompt, text, reasoning, content):
    from control_panel.api.reasoning import ReasoningText

    for size in (1, 2, 5, len(text)):
        reader, got_r, got_c = ReasoningText(open_in_prompt), "", ""
        for i in range(0, len(text), size):
            r, c = reader.feed(text[i : i + size])
            got_r, got_c = got_r + r, got_c + c
        r, c = reader.finish()
        assert (got_r + r, got_c + c) == (reasoning, content), size


def test_a_repeated_call_ends_the_answer_and_a_cut_array_keeps_its_whole_calls():
    oslo = '{"name":"get_weather","parameters":{"city":"Oslo"}}'
    lima = '{"name":"get_weather","parameters":{"city":"Lima"}}'
    text = f"[{oslo},{lima},{oslo},{lima}"
    for size in (1, 5, len(text)):
        reader = ToolCallText(TOOLS, "required", forced=True)
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        fed = 0
        for piece in pieces:
            reader.feed(piece)
            fed += len(piece)
            if reader.repeated:
                break
        assert reader.repeated and (fed < len(text) or size == len(text)), size
        reader = ToolCallText(TOOLS, "required", forced=True)
        sent, rest, calls = stream(reader, pieces)
        assert (sent, rest, calls) == ("", "", [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Lima"})])
    # cut short by max_tokens: the whole calls before the cut
    assert stream(ToolCallText(TOOLS, "required", True), [f"[{oslo},{lima[:20]}"])[2] == [
        ("get_weather", {"city": "Oslo"})
    ]
    # the same arguments in another order are the same call; "auto" blocks repeat too
    block = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>'
    again = '<tool_call>{"name": "get_weather", "arguments": {"unit": "c", "city": "Oslo"}}</tool_call>'
    reader = ToolCallText(TOOLS, "auto", forced=False)
    assert stream(reader, ["Sure. ", block, "\n", again, "\n", block]) == (
        "Sure. ",
        "",
        [("get_weather", {"city": "Oslo", "unit": "c"})],
    )
    assert reader.repeated
    # different calls do not end it
    reader = ToolCallText(TOOLS, "auto", forced=False)
    assert len(stream(reader, [block, block.replace("Oslo", "Lima")])[2]) == 2 and not reader.repeated
