"""The Responses API's pieces (control_panel/api/responses.py, control_panel/response_store.py):
input items as chat messages, flat tools and formats in chat's shape, errors renamed to the
request's own parameters, and stored answers that expire."""

from __future__ import annotations

import pytest
from sqlmodel import Session, select

from control_panel import response_store
from control_panel.api.errors import OpenAIError
from control_panel.api.responses import chat_format, chat_tool_choice, chat_tools, input_messages, renamed
from control_panel.db import open_db
from control_panel.models import ApiKey, StoredResponse
from control_panel.security import create_api_key


def test_input_items_become_chat_messages():
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]
    call = lambda i, n, a: {"id": i, "type": "function", "function": {"name": n, "arguments": a}}  # noqa: E731
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "Let me see.",
            "tool_calls": [call("c1", "f", "{}"), call("c2", "g", '{"x": 1}')],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": None, "tool_calls": [call("c3", "f", "{}")]},
    ]


@pytest.mark.parametrize(
    "items, says",
    [
        ([{"role": "tool", "content": "x"}], "role must be"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}], "vision"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "`input_file`"),
        ([{"role": "user", "content": 3}], "string or a list"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "`call_id`"),
        ([{"type": "item_reference", "id": "x"}], "`item_reference`"),
    ],
)
def test_bad_input_items_are_named(items, says):
    with pytest.raises(OpenAIError) as e:
        input_messages(items)
    assert e.value.status == 400 and e.value.param == "input" and says in str(e.value) and "input[0]" in str(e.value)


def test_tools_choices_and_formats_take_chats_shape():
    flat = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}
    assert chat_tools([flat]) == [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    ]
    with pytest.raises(OpenAIError, match="file_search"):
        chat_tools([{"type": "file_search"}])
    assert chat_tool_choice({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    assert chat_tool_choice("required") == "required"
    with pytest.raises(OpenAIError):
        chat_tool_choice({"type": "allowed_tools", "tools": []})
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
    assert chat_format(fmt) == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
    }
    assert chat_format({"type": "json_object"}) == {"type": "json_object"}


def test_chat_errors_name_the_responses_parameters():
    e = renamed(OpenAIError(400, "`max_tokens`: must be >= 1 (got 0)", param="max_tokens"))
    assert (str(e), e.param) == ("`max_output_tokens`: must be >= 1 (got 0)", "max_output_tokens")
    e = renamed(OpenAIError(400, "messages[3]: a `tool` message must answer a call", param="messages"))
    assert (str(e), e.param) == ("input: a `tool` message must answer a call", "input")


def test_stored_answers_expire(tmp_path, monkeypatch):
    db = open_db(tmp_path / "panel.db")
    prefix = create_api_key(db, "k")[:10]
    with Session(db) as s:
        key = s.exec(select(ApiKey.id).where(ApiKey.prefix == prefix)).one()
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    response_store.save(db, key, {"id": "resp_a", "output": []}, conversation)
    assert response_store.conversation(db, key, "resp_a") == conversation
    assert response_store.response(db, key, "resp_a") == {"id": "resp_a", "output": []}
    assert response_store.conversation(db, key, "resp_b") is None
    clock = [response_store.time.time()]
    monkeypatch.setattr(response_store.time, "time", lambda: clock[0])
    clock[0] += response_store.KEEP_SECONDS + 1  # past its time: gone, and deleted by the next write
    assert response_store.conversation(db, key, "resp_a") is None and not response_store.forget(db, key, "resp_a")
    response_store.save(db, key, {"id": "resp_b"}, conversation)
    with Session(db) as s:
        assert s.get(StoredResponse, "resp_a") is None
    assert response_store.forget(db, key, "resp_b") and response_store.response(db, key, "resp_b") is None
