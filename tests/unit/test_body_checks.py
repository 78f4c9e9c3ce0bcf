"""Tools and JSON schemas of a request are bounded and checked off the panel's event loop (security
review L3): each schema is compiled (llguidance) to check it, ~0.1-0.4 s for a 0.2 MB one."""

from __future__ import annotations

import asyncio

import pytest

from control_panel.api import bodies
from tandem_protocol import sampling

from .test_router import FakeAgents, ask, chat, pair_app


@pytest.fixture(scope="module")
def panel(tmp_path_factory):
    return pair_app(tmp_path_factory.mktemp("body-checks"), FakeAgents())


def tool(i: int) -> dict:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    return {"type": "function", "function": {"name": f"f{i}", "parameters": schema}}


def test_more_tools_than_openai_allows_are_refused_before_any_agent_call(panel):
    r, agents = ask(panel, chat(tools=[tool(i) for i in range(bodies.MAX_TOOLS + 1)]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "at most 128 tools (got 129)" in r.json()["error"]["message"] and agents.calls == []
    r, _ = ask(panel, chat(tools=[tool(i) for i in range(bodies.MAX_TOOLS)]))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_schemas_are_compiled_off_the_event_loop(panel, monkeypatch, path):
    on_loop: list[bool] = []
    compile_check = bodies.json_schema_problem

    def spy(schema: str):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return compile_check(schema)

    monkeypatch.setattr(bodies, "json_schema_problem", spy)  # the tools' schemas
    monkeypatch.setattr(sampling, "json_schema_problem", spy)  # the response format's, as sampling
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    body = chat(tools=[tool(0), tool(1)]) if path.endswith("chat/completions") else {"model": "pd", "prompt": "hi"}
    r, _ = ask(panel, {**body, "response_format": fmt, "max_tokens": 3}, path)
    assert r.status_code == 200, r.text
    assert on_loop and not any(on_loop), on_loop
