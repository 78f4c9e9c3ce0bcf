"""schemathesis over a Tandem API, shared by the bad-input tests (torch agents and a panel) and the
server engines' tests (the agent routes that reach vLLM or SGLang): every operation, valid and
invalid cases, each answered within CALL_TIMEOUT with no 5xx, and checked by the caller's rule.

Generation is seeded from the run: a fresh seed each run (so runs explore new cases), printed and
reported with every failure; FUZZ_SEED=N reproduces a run. Every operation must be exercised:
at least MIN_CASES valid and MIN_CASES invalid cases each, or the run fails saying which one fell
short. The exceptions are stated, never silent: an operation with no parameters and no body,
and those a caller lists in `valid_only` with the reason, have no invalid input to send (their
valid cases are still sent); the report lists them.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.errors import FailureGroup

from .agents import TEST_KEY, AgentProcess
from .seed import run_seed

MAX_EXAMPLES = 25  # per operation and generation mode (valid, then invalid input)
MIN_CASES = 5  # fewer cases than this in either mode: the operation was not really exercised
CALL_TIMEOUT = 30  # seconds: a call that takes longer is a hang
VOCAB = 49152  # the embedded model's (SmolLM2)


def without_headers(doc: dict, *names: str) -> dict:
    """Drop header parameters the test sends right on every call itself."""
    for path in doc["paths"].values():
        for op in path.values():
            op["parameters"] = [p for p in op.get("parameters", []) if p["name"].lower() not in names]
    return doc


def narrowed(doc: dict, changes: dict[tuple[str, str], dict | bool]) -> dict:
    """Narrow parts of the published schema so that valid cases reach deep (a real model name, a
    real prefiller, sampling the engine applies); invalid cases are generated against the
    narrowed schema, so everything outside it is still sent. (model, None) sets whether a body
    may carry properties it does not declare."""
    schemas = doc["components"]["schemas"]
    for (model, prop), schema in changes.items():
        if prop is None:
            schemas[model]["additionalProperties"] = schema
            continue
        assert prop in schemas[model]["properties"], (model, prop)
        schemas[model]["properties"][prop] = schema
    return doc


def path_parameter(doc: dict, name: str, schema: dict) -> dict:
    """Give every path parameter called `name` this schema (as `narrowed` does for bodies)."""
    found = False
    for path in doc["paths"].values():
        for op in path.values():
            for p in op.get("parameters", []):
                if p["in"] == "path" and p["name"] == name:
                    p["schema"], found = schema, True
    assert found, name
    return doc


def runs_long(label: str, body, context: int) -> bool:
    """A valid max_tokens above 4 that the context still admits: the model would run for up to
    `context` tokens (seconds each on a busy CPU) and show nothing a 4-token run does not. Such
    cases are skipped; a max_tokens beyond the context is sent, and refused by the product."""
    if not isinstance(body, dict):
        return False
    if label in ("POST /v1/chat/completions", "POST /v1/completions"):  # absent: 256, beyond the context
        values = [body.get("max_tokens"), body.get("max_completion_tokens")]
    elif label == "POST /v1/responses":
        values = [body.get("max_output_tokens")]
    elif label in ("POST /v1/generate", "POST /v1/decode"):  # the agent's routes that generate
        sampling = body.get("sampling", {})
        values = [sampling.get("max_tokens", 16) if isinstance(sampling, dict) else None]  # 16: the default
    else:
        return False
    return any(4 < number(v) <= context for v in values)


def number(value) -> float:
    """What pydantic's lax mode makes of a value sent for an int (5, 5.0 and "5" are all 5)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return float("nan")
    try:
        return float(value)
    except (ValueError, OverflowError):
        return float("nan")


def has_input(doc: dict, label: str) -> bool:
    """Whether an operation takes anything (a parameter or a body) that a case could get wrong."""
    method, path = label.split(" ", 1)
    op = doc["paths"][path][method.lower()]
    return bool(op.get("parameters")) or "requestBody" in op


def fuzz(
    url: str,
    doc: dict,
    headers: dict,
    check,
    context: int,
    skip: set[str] = frozenset(),
    only: set[str] | None = None,
    max_examples: int = MAX_EXAMPLES,
    min_cases: int = MIN_CASES,
    valid_only: dict[str, str] | None = None,
) -> dict:
    """Every operation (or those in `only`), up to `max_examples` valid and as many invalid cases
    each, at least `min_cases` of each; valid ones only for the operations in `valid_only`
    (label: why nothing sent to it can be invalid) and those with no input at all. Each case: an
    answer within CALL_TIMEOUT, no 5xx (schemathesis' not_a_server_error) and `check(response)`.
    Failures are collected (not shrunk: that would rerun the model) and asserted at the end.
    Returns the counts (seed, cases, statuses, 5xx and cases per operation and mode)."""
    run = run_seed()
    print(f"schemathesis on {url}: seed {run} (FUZZ_SEED={run} reproduces this run)")
    schema = schemathesis.openapi.from_dict(doc)
    statuses: Counter = Counter()
    by_operation: dict[str, Counter] = {}
    cases: Counter = Counter()  # (operation, mode) -> cases sent
    failures: list[str] = []
    seconds: dict[str, float] = {}
    valid_only = dict(valid_only or {})

    def send(op, mode, case) -> None:
        """One case: sent, counted and checked; a failure is recorded, never raised."""
        cases[op.label, mode.value] += 1
        try:
            response = case.call(base_url=url, headers=headers, timeout=CALL_TIMEOUT)
        except Exception as e:  # a timeout (a hang) or a broken connection (a crash)
            statuses["no answer"] += 1
            by_operation.setdefault(op.label, Counter())["no answer"] += 1
            failures.append(f"{op.label} [{mode}] {type(e).__name__}: {e}\n{case.as_curl_command(headers)}")
            return
        statuses[response.status_code] += 1
        by_operation.setdefault(op.label, Counter())[response.status_code] += 1
        try:
            case.validate_response(response, checks=[not_a_server_error])
            check(response)
        except (Exception, FailureGroup) as e:  # FailureGroup: a BaseExceptionGroup
            failures.append(
                f"{op.label} [{mode}] {response.status_code} {response.content[:300]!r}: "
                f"{type(e).__name__} {e}\n{case.as_curl_command(headers)}"
            )

    def exercise(op, mode) -> None:
        """Up to max_examples cases of one operation in one mode, from this run's seed."""

        @seed(run)
        @settings(
            max_examples=max_examples,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(
            case=op.as_strategy(generation_mode=mode).filter(lambda case: not runs_long(op.label, case.body, context))
        )
        def one(case):
            send(op, mode, case)

        one()

    for result in schema.get_all_operations():
        op = result.ok()
        if op.label in skip or only is not None and op.label not in only:
            continue
        t0 = time.monotonic()
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
        if not has_input(doc, op.label):
            valid_only[op.label] = "no parameters and no body"
        if op.label in valid_only:
            modes.remove(GenerationMode.NEGATIVE)
        for mode in modes:
            try:
                exercise(op, mode)
            except Unsatisfiable as e:  # every generated case was filtered out, or none exists
                failures.append(f"{op.label} [{mode}]: no case could be generated ({e})")
            # an operation without input has one valid case; any other must have min_cases
            needed = min_cases if has_input(doc, op.label) else 1
            if cases[op.label, mode.value] < needed:
                failures.append(
                    f"{op.label} [{mode}]: {cases[op.label, mode.value]} cases sent, fewer than the "
                    f"{needed} that exercise it (narrow the schema less, or filter less)"
                )
        seconds[op.label] = round(time.monotonic() - t0, 1)
    server_errors = sum(n for status, n in statuses.items() if status == "no answer" or status >= 500)
    counts = {
        "seed": run,
        "operations": len(seconds),
        "cases": sum(statuses.values()),
        "5xx": server_errors,
        "no_answer": statuses["no answer"],
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
        "valid_only": {label: why for label, why in valid_only.items() if label in seconds},
        "by_operation": {
            op: {
                "seconds": t,
                "cases": {mode: n for (label, mode), n in cases.items() if label == op},
                **{str(k): v for k, v in sorted(by_operation.get(op, {}).items(), key=str)},
            }
            for op, t in seconds.items()
        },
    }
    assert not failures, f"seed {run} (FUZZ_SEED={run} reproduces): {len(failures)} failures:\n" + "\n\n".join(
        failures[:10]
    )
    return counts


def media_type(response) -> str:
    return response.headers.get("content-type", [""])[0].split(";")[0]  # schemathesis: lists of values


def panel_answer(response) -> None:
    """A refusal is OpenAI's error object; a stream ends with [DONE] (a Responses stream with its
    completed or incomplete event) and carries no error event (schemathesis reads at most 20
    events of a stream: a longer one is not checked)."""
    if 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert error["message"] and error["type"] and {"param", "code"} <= set(error), error
    elif media_type(response) == "text/event-stream" and not response.stream_cut_short:
        text = response.text
        if text.startswith("event: "):
            last = text.rstrip("\n").rsplit("\n\n", 1)[-1]
            assert last.split("\n", 1)[0] in ("event: response.completed", "event: response.incomplete"), text[-500:]
        else:
            assert text.endswith("data: [DONE]\n\n") and '"error"' not in text, text[-500:]


def agent_answer(response) -> None:
    """A refusal is the agent's error object; a token stream ends with a done or an error line."""
    if 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert error["message"] and error["type"], error
    elif media_type(response) == "application/x-ndjson":
        last = json.loads(response.text.splitlines()[-1])
        assert last.get("done") is True or last["error"]["message"], last


def fuzz_agent(
    d: AgentProcess, p: AgentProcess, context: int, only: set[str] | None = None, max_examples: int = MAX_EXAMPLES
) -> dict:
    """The agent API of decoder `d` (whose prefiller is `p`), every route but the link benchmark
    (GET /v1/bench/pages streams `count` synthetic 1.4 MB pages by design). POST /v1/config stays
    in: a real switch needs an absolute model path inside the agent's model roots, which generated
    text does not hit, and anything else is refused before the engine is touched."""
    headers = {"Authorization": f"Bearer {TEST_KEY}"}
    with d.client() as c:
        doc, info = c.get("/v1/openapi.json").json(), c.get("/v1/info").json()
    # short prompts the engine takes (prefill costs seconds per long prompt on a busy CPU)
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": VOCAB - 1}, "maxItems": 8}
    doc = narrowed(
        without_headers(doc, "authorization", "x-tandem-protocol"),
        {
            ("HandoffBody", "contract"): {"enum": [info["contract"]["fingerprint"]]},  # else every handoff is a 409
            ("DecodeBody", "prefill_url"): {"enum": [p.url]},  # a real prefiller, never a generated host name
            ("BenchLinkBody", "peer"): {"enum": [p.url]},  # likewise
            ("BenchLinkBody", "megabytes"): {"type": "integer", "minimum": 1, "maximum": 2},
            ("HandoffBody", "token_ids"): ids,
            ("DecodeBody", "token_ids"): ids,
            ("GenerateBody", "token_ids"): ids,
            ("SamplingParams", "max_tokens"): {"type": "integer", "minimum": 1, "maximum": 4},
            # torch applies none of these (it refuses them): valid cases leave them at their defaults
            **{
                ("SamplingParams", name): {"enum": [value]}
                for name, value in [
                    ("min_p", 0.0),
                    ("repetition_penalty", 1.0),
                    ("presence_penalty", 0.0),
                    ("frequency_penalty", 0.0),
                ]
            },
        },
    )
    # a handoff id is what POST /v1/handoffs accepts (its body's pattern), so invalid ids are sent too
    path_parameter(doc, "handoff_id", {"type": "string", "pattern": "^[0-9a-f]{32}$"})
    return fuzz(
        d.url,
        doc,
        headers,
        agent_answer,
        context,
        skip={"GET /v1/bench/pages"},
        only=only,
        max_examples=max_examples,
        valid_only={
            "DELETE /v1/requests/{request_id}": "a request id is whatever string the client named its request "
            "with: no string is invalid",
        },
    )


def cancel_open_handoffs(*agents: AgentProcess) -> None:
    """Fuzzed handoffs nobody reads hold budget until their lease ends: cancel them (idempotent)."""
    for agent in agents:
        with agent.client() as c:
            for handoff in c.get("/v1/status").json()["handoffs"]:
                c.delete(f"/v1/handoffs/{handoff['handoff_id']}")


# The agent routes whose handling reaches the engine (the rest of the API is the same for every
# engine, and fuzzed against torch agents in tests/system/test_bad_input.py).
ENGINE_ROUTES = {
    "POST /v1/tokenize",
    "POST /v1/handoffs",
    "GET /v1/handoffs/{handoff_id}/pages",
    "POST /v1/decode",
    "POST /v1/generate",
    "DELETE /v1/requests/{request_id}",
}


def fuzz_engine_routes(d: AgentProcess, p: AgentProcess, max_examples: int = 10) -> dict:
    """fuzz_agent on ENGINE_ROUTES of a decoder `d` and prefiller `p` on a server engine, whose
    processes must all survive it; afterwards the open handoffs nobody read are cancelled, so
    that both agents can be checked idle."""
    with d.client() as c:
        context = c.get("/v1/info").json()["context_length"]
    restarts = {a.url: a.status()["engine_stats"]["restarts"] for a in (d, p)}
    try:
        counts = fuzz_agent(d, p, context, only=ENGINE_ROUTES, max_examples=max_examples)
        # an input that kills the engine is a failure even though the agent brings it back
        assert {a.url: a.status()["engine_stats"]["restarts"] for a in (d, p)} == restarts, "an engine died"
        return counts
    except AssertionError as e:  # what the agents said about it
        raise AssertionError(
            f"{e}\n\ndecoder's log:\n{''.join(d.log[-60:])}\nprefiller's log:\n{''.join(p.log[-30:])}"
        ) from None
    finally:
        cancel_open_handoffs(p, d)
