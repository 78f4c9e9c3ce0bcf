"""Damaged page streams between two real agents: each ends with its own clear error, and
afterwards neither agent holds a reservation, a handoff or a request."""

from __future__ import annotations

import pytest

from tandem_protocol.client import AgentHTTPError

from .agents import AgentProcess, TamperProxy, decode_foreign_pages, pd_request, settle
from .conftest import prompt, run


@pytest.fixture(scope="module")
def pair(smol_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("faults")
    with (
        AgentProcess("torch", smol_dir, home / "p") as p,
        AgentProcess("torch", smol_dir, home / "d") as d,
        AgentProcess("torch", smol_dir, home / "other", "--context-length", "4096") as other,
    ):
        yield p, d, other


def error_of(lines: list[dict]) -> dict:
    assert "error" in lines[-1], lines[-1]
    assert not any("token" in line for line in lines), "a damaged stream must decode nothing"
    return lines[-1]["error"]


@pytest.mark.parametrize(
    "damage, kind, message",
    [
        (dict(flip_at=300_000), "FrameError", "checksum mismatch on page 0"),
        (dict(flip_at=1_800_000), "FrameError", "checksum mismatch on page 1"),
        (dict(cut_at=700_000), "FrameError", "broke off"),
        (dict(cut_at=1_474_800), "FrameError", "broke off"),
    ],
)
def test_damaged_stream(pair, long_ids, damage, kind, message):
    p, d, _ = pair
    proxy = TamperProxy(p.port, **damage)
    try:
        lines = run(pd_request(p.url, d.url, prompt(long_ids, 150), {"max_tokens": 4}, prefill_url=proxy.url))
    finally:
        proxy.close()
    error = error_of(lines)
    assert error["type"] == kind and message in error["message"], error
    settle(p, d)


def test_wrong_token_list(pair, long_ids):
    p, d, _ = pair
    ids = prompt(long_ids, 150)
    lines = run(pd_request(p.url, d.url, ids, {"max_tokens": 4}, d_token_ids=ids[:-1] + [ids[-1] + 1]))
    error = error_of(lines)
    assert error["type"] == "ContractMismatch" and error["fields"] == ["token_ids"]
    settle(p, d)


def test_wrong_contract_refused_by_prefiller(pair, long_ids):
    p, _, other = pair
    before = p.status()["totals"]["prefills_started"]
    with pytest.raises(AgentHTTPError) as e:
        run(pd_request(p.url, other.url, prompt(long_ids, 70), {"max_tokens": 4}))
    assert e.value.status == 409 and "contract" in str(e.value)
    assert p.status()["totals"]["prefills_started"] == before  # refused before any compute
    settle(p, other)


def test_wrong_contract_caught_by_decoder(pair, long_ids):
    """Even if a router skips the prefiller's check, the decoder refuses foreign pages."""
    p, _, other = pair
    error = error_of(run(decode_foreign_pages(p.url, other.url, prompt(long_ids, 70))))
    assert error["type"] == "ContractMismatch" and error["fields"] == ["contract fingerprint"]
    settle(p, other)


def test_protocol_version_mismatch_is_explained(pair):
    p, _, _ = pair
    with p.client() as c:
        r = c.get("/v1/info", headers={"X-Tandem-Protocol": "99"})
    assert r.status_code == 400 and "protocol 99" in r.json()["error"]["message"]
