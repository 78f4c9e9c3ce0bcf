"""Issue 43, H1 and the body caps of L2 and L12: what a request's `chat_template_kwargs` may carry
to a chat template (tandem_protocol/template_switches.py), checked by the panel's chat and
Responses bodies before any agent is asked and again by the agent's TokenizeBody; and the caps
on `logit_bias` (OpenAI's 300 entries) and on a stop string's length.

The panel runs in process on fake agents that count its calls (tests/unit/test_router.py); the
agent's check is its request model, as its route parses it. The attack against real processes
is tests/system/test_hostile_requests.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from control_panel.api.bodies import MAX_LOGIT_BIAS, MAX_STOP_CHARS
from engine_adapters.base import EngineAdapter
from tandem_protocol.api import TokenizeBody
from tandem_protocol.errors import RequestError
from tandem_protocol.template_switches import (
    MAX_SWITCH_TEXT,
    TEMPLATE_SWITCHES,
    TemplateSwitchError,
    check_template_switches,
)

from .test_router import FakeAgents, ask, chat, pair_app

# What the review's attack sends (a nested loop that renders for hours), and its like: a template
# of the caller's own, apply_chat_template's own parameters, a list for a template to loop over.
HOURS = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
REFUSED_KEYS = {
    "chat_template": HOURS,
    "tokenize": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "tools": [{"type": "function"}],
    "documents": [{"text": "x"}],
    "custom_tools": [],
    "messages": [],
    "tokenizer_kwargs": {},
}
NOT_SCALAR = [
    ("enable_thinking", {"chat_template": HOURS}, "object"),
    ("enable_thinking", [True], "array"),
    ("enable_thinking", None, "null"),
    ("date_string", "x" * (MAX_SWITCH_TEXT + 1), f"string of {MAX_SWITCH_TEXT + 1} characters"),
]
ALLOWED = {
    "enable_thinking": False,
    "thinking": True,
    "reasoning_effort": "low",
    "tools_in_user_message": False,
    "date_string": "x" * MAX_SWITCH_TEXT,
}


@pytest.fixture(scope="module")
def panel(tmp_path_factory):
    return pair_app(tmp_path_factory.mktemp("switches"), FakeAgents())


def responses(**extra) -> dict:
    return {"model": "pd", "input": "hi", "max_output_tokens": 3, "temperature": 0} | extra


def test_the_allowed_switches_are_every_key_a_known_template_reads_and_nothing_else():
    assert set(ALLOWED) == TEMPLATE_SWITCHES
    check_template_switches(ALLOWED)
    check_template_switches({"enable_thinking": 1, "thinking": 0.5})  # numbers are scalars too
    check_template_switches(None)
    assert TokenizeBody(messages=[], chat_template_kwargs=ALLOWED).chat_template_kwargs == ALLOWED


@pytest.mark.parametrize("key", sorted(REFUSED_KEYS))
def test_a_key_that_is_no_switch_is_refused_by_name(key):
    with pytest.raises(TemplateSwitchError) as e:
        check_template_switches({"enable_thinking": True, key: REFUSED_KEYS[key]})
    assert e.value.key == key and f"`chat_template_kwargs.{key}` is not a template switch" in str(e.value)


@pytest.mark.parametrize("key, value, said", NOT_SCALAR)
def test_a_switch_takes_a_scalar_only(key, value, said):
    with pytest.raises(TemplateSwitchError) as e:
        check_template_switches({key: value})
    assert e.value.key == key and f"`chat_template_kwargs.{key}` must be" in str(e.value), str(e.value)
    assert f"(got {said})" in str(e.value)


def test_a_huge_key_is_named_but_not_echoed_whole():
    key = "k" * 100_000
    with pytest.raises(TemplateSwitchError) as e:
        check_template_switches({key: 1})
    assert e.value.key == key and len(str(e.value)) < 400


@pytest.mark.parametrize("key", sorted(REFUSED_KEYS))
def test_the_agent_refuses_the_key_in_its_tokenize_body(key):
    with pytest.raises(ValidationError) as e:
        TokenizeBody(messages=[{"role": "user", "content": "x"}], chat_template_kwargs={key: REFUSED_KEYS[key]})
    assert f"`chat_template_kwargs.{key}`" in str(e.value)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", chat), ("/v1/responses", responses)])
@pytest.mark.parametrize("key", sorted(REFUSED_KEYS))
def test_the_panel_answers_400_naming_the_key_before_any_agent_call(panel, path, body, key):
    r, agents = ask(panel, body(chat_template_kwargs={key: REFUSED_KEYS[key]}), path)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "chat_template_kwargs", r.text
    assert f"`chat_template_kwargs.{key}`" in error["message"] and error["type"] == "invalid_request_error"
    assert agents.calls == []


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", chat), ("/v1/responses", responses)])
@pytest.mark.parametrize("key, value, said", NOT_SCALAR)
def test_the_panel_refuses_a_switch_that_is_not_a_scalar(panel, path, body, key, value, said):
    r, agents = ask(panel, body(chat_template_kwargs={key: value}), path)
    error = r.json()["error"]
    assert r.status_code == 400 and f"`chat_template_kwargs.{key}` must be" in error["message"], r.text
    assert agents.calls == []


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", chat), ("/v1/responses", responses)])
def test_the_allowed_switches_reach_the_decoder(panel, path, body):
    r, agents = ask(panel, body(chat_template_kwargs=ALLOWED), path)
    assert r.status_code == 200, r.text
    assert agents.calls[0][1] == "/v1/tokenize" and agents.calls[0][2]["chat_template_kwargs"] == ALLOWED


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", chat), ("/v1/responses", responses)])
def test_logit_bias_takes_openais_300_entries(panel, path, body):
    """L2: each entry is applied at every sampled token, so their number is OpenAI's."""
    bias = {str(token): 1.0 for token in range(MAX_LOGIT_BIAS + 1)}
    r, agents = ask(panel, body(logit_bias=bias), path)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "logit_bias", r.text
    assert f"at most {MAX_LOGIT_BIAS} entries (got {MAX_LOGIT_BIAS + 1})" in error["message"]
    assert agents.calls == []
    bias.popitem()
    r, agents = ask(panel, body(logit_bias=bias), path)
    assert r.status_code == 200, r.text
    assert len(agents.calls[-1][2]["sampling"]["logit_bias"]) == MAX_LOGIT_BIAS


@pytest.mark.parametrize("stop", ["s" * (MAX_STOP_CHARS + 1), ["ok", "s" * (MAX_STOP_CHARS + 1)], ["x" * 1_000_000]])
def test_a_stop_string_has_a_bounded_length(panel, stop):
    """L12: the answer holds back up to a stop string's length of each choice's text."""
    r, agents = ask(panel, chat(stop=stop))
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "stop", r.text
    assert f"at most {MAX_STOP_CHARS} characters" in error["message"] and agents.calls == []


def test_four_stop_strings_of_the_longest_length_still_pass(panel):
    stops = [c * MAX_STOP_CHARS for c in "abcd"]
    r, agents = ask(panel, chat(stop=stops))
    assert r.status_code == 200, r.text
    assert agents.calls[-1][1] in ("/v1/decode", "/v1/generate")


def test_a_render_past_its_bound_fails_its_request_and_the_event_loop_runs_meanwhile():
    """The agent's tokenizer thread (EngineAdapter.on_tokenizer): a render that outlasts its bound
    (here an Event that is set only after the check) fails its request with a RequestError (the
    agent's 400) at the bound, and the event loop ticks all along."""
    thread = ThreadPoolExecutor(1)
    adapter = SimpleNamespace(_tokenizer_thread=thread)  # all on_tokenizer uses of its adapter
    release = threading.Event()

    async def run() -> tuple[float, float]:
        gaps, last = [], time.perf_counter()

        async def tick() -> None:
            nonlocal last
            while True:
                await asyncio.sleep(0.01)
                gaps.append(time.perf_counter() - last)
                last = time.perf_counter()

        ticker = asyncio.create_task(tick())
        start = time.perf_counter()
        with pytest.raises(RequestError, match="tokenizing did not finish within 0.3 s"):
            await EngineAdapter.on_tokenizer(adapter, release.wait, timeout=0.3)
        took = time.perf_counter() - start
        ticker.cancel()
        return took, max(gaps)

    try:
        took, longest_gap = asyncio.run(run())
    finally:
        release.set()
        thread.shutdown(wait=True)
    assert 0.3 <= took < 2.0, took  # at its bound, not when the render ends
    assert longest_gap < 0.2, longest_gap  # ticks every 10 ms: the loop was never held
