"""Each API key's prefix cache namespace (security review L4, control_panel/cache_salt.py): the
page hash chain with a salt (tandem_protocol/prefix.py), the salt the panel sends the agents per
key (or none where the admin shares the cache), the router's index salted the same way, the
decoder passing it on to its prefiller, and vLLM's and SGLang's request bodies carrying it.

The engines' caches under salts, and the attack through a real panel and agent, are
tests/system/test_cache_salt.py's."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import httpx
import pydantic
import pytest
import xxhash
from sqlmodel import Session, select

from control_panel.cache_salt import CacheSalts, load_cache_salts
from control_panel.models import ApiKey
from control_panel.security import create_api_key, revoke_api_key
from engine_adapters.base import EngineRequest
from engine_adapters.sglang_adapter import SGLangAdapter
from engine_adapters.vllm_adapter import VLLMAdapter
from node_agent.handshake import Handshake, PrefillerRefused
from tandem_protocol.api import GenerateBody, HandoffBody
from tandem_protocol.client import AgentHTTPError
from tandem_protocol.handoff import FirstTokenMode
from tandem_protocol.prefix import chain_seed, page_hashes
from tandem_protocol.sampling import SamplingParams

from .test_rate_limits import PASSWORD
from .test_response_owner import panel_on_fakes
from .test_router import chat

FP, PAGE = b"contract-fingerprint", 4
IDS = list(range(1, 13))  # three pages of PAGE
SALT = "5a" * 32


# ---- the hash chain ---------------------------------------------------------------------------
def test_a_salt_moves_every_page_s_hash_and_equal_salts_agree():
    plain = page_hashes(FP, IDS, PAGE)
    salted = page_hashes(FP, IDS, PAGE, salt=SALT)
    other = page_hashes(FP, IDS, PAGE, salt="a5" * 32)
    assert len(plain) == len(salted) == len(other) == 3
    assert not set(salted) & set(plain) and not set(salted) & set(other) and not set(plain) & set(other)
    assert page_hashes(FP, IDS, PAGE, salt=SALT) == salted  # deterministic: a key finds its own pages
    assert page_hashes(FP, IDS + [99], PAGE, salt=SALT) == salted  # still a chain: a longer prompt shares them
    assert chain_seed(FP, SALT) not in (chain_seed(FP), chain_seed(FP, "a5" * 32))  # a short prompt's tail too
    # unsalted is what it always was (no cache emptied by the upgrade), and an empty salt is none
    assert chain_seed(FP) == chain_seed(FP, "") == xxhash.xxh3_128_digest(FP)
    assert page_hashes(FP, IDS, PAGE, salt="") == plain


def test_a_salt_is_checked_where_an_agent_takes_it():
    assert GenerateBody(token_ids=[1], cache_salt=SALT).cache_salt == SALT
    for bad in ("", "a/b", "a@b", "x" * 129, "é"):  # vLLM refuses '/', '@', and over 128 characters
        with pytest.raises(pydantic.ValidationError, match="cache_salt"):
            GenerateBody(token_ids=[1], cache_salt=bad)
        with pytest.raises(pydantic.ValidationError, match="cache_salt"):
            HandoffBody(handoff_id="0" * 32, token_ids=[1], contract="c", cache_salt=bad)


# ---- the salts the panel makes ------------------------------------------------------------------
def test_a_key_s_salt_is_its_own_lasts_and_is_not_the_key(tmp_path):
    from control_panel.db import open_db

    db = open_db(tmp_path / "panel.db")
    salts = load_cache_salts(db)
    key = create_api_key(db, "k")
    with Session(db) as s:
        row = s.exec(select(ApiKey)).one()
    salt = salts.of(row)
    assert re.fullmatch(r"[0-9a-f]{64}", salt) and key not in salt and row.key_hash not in salt
    assert load_cache_salts(db).of(row) == salt  # the same after a restart: the key's cached pages stay its own
    assert CacheSalts(b"another panel's secret").of(row) != salt  # not computable without the panel's secret
    revoke_api_key(db, row.id)
    create_api_key(db, "k2")
    with Session(db) as s:
        new = s.exec(select(ApiKey)).one()
    assert new.id == row.id and salts.of(new) != salt  # SQLite gave it the revoked key's id, not its salt


# ---- through the panel, on fake agents ------------------------------------------------------------
LONG = list(range(1, 131))  # two whole pages and 2 tokens: held, under the pool's threshold of 8 new


@pytest.fixture
def api(tmp_path):
    yield from panel_on_fakes(tmp_path)


def key_headers(api, name: str) -> dict:
    return {"Authorization": f"Bearer {create_api_key(api.app_state.db, name)}"}


def agent_calls(api, headers: dict, prompt: list[int] | None = None) -> list[tuple[str, dict]]:
    """The generation calls (path, body) the agents got for one chat, one text completion and one
    Responses request of the key."""
    agents = api.app_state.agents
    if prompt is not None:
        agents.answers["/v1/tokenize"] = lambda body: httpx.Response(200, json={"token_ids": prompt})
    start = len(agents.calls)
    for path, body in (
        ("/v1/chat/completions", chat()),
        ("/v1/completions", {"model": "pd", "prompt": "hi", "max_tokens": 3}),
        ("/v1/responses", {"model": "pd", "input": "hi", "max_output_tokens": 3, "store": False}),
    ):
        r = api.post(path, json=body, headers=headers)
        assert r.status_code == 200, r.text
    return [(path, body) for _, path, body in agents.calls[start:] if path != "/v1/tokenize"]


def test_two_keys_sending_the_same_prompt_reach_the_agents_with_different_salts(api):
    a, b = key_headers(api, "a"), key_headers(api, "b")
    a_calls, b_calls = agent_calls(api, a), agent_calls(api, b)
    assert [p for p, _ in a_calls] == [p for p, _ in b_calls] == ["/v1/decode"] * 3
    a_salts, b_salts = {body["cache_salt"] for _, body in a_calls}, {body["cache_salt"] for _, body in b_calls}
    assert len(a_salts) == len(b_salts) == 1 and a_salts != b_salts  # one per key, whatever the API
    with Session(api.app_state.db) as s:
        keys = {k.name: k for k in s.exec(select(ApiKey))}
    assert a_salts == {api.app_state.panel.cache_salts.of(keys["a"])}


def test_the_router_believes_a_node_holds_a_prompt_only_for_the_key_that_sent_it(api):
    """The routing leak: under the pool's threshold (8 new tokens) a prompt the decoder holds runs
    on the decoder alone, a shorter time to first token. Key A's repeat does; key B's same prompt
    is routed as a new one."""
    a, b = key_headers(api, "a"), key_headers(api, "b")
    # A's chat goes P/D; its text completion and Responses request find D holding 128 of 130 tokens
    assert [p for p, _ in agent_calls(api, a, LONG)] == ["/v1/decode", "/v1/generate", "/v1/generate"]
    # the attack: B's same prompt is new to every node, as its own repeats are not
    assert [p for p, _ in agent_calls(api, b, LONG)] == ["/v1/decode", "/v1/generate", "/v1/generate"]


def signed_in(api) -> str:
    """Sign in; the session's CSRF token."""
    token = re.search(r'name="csrf" value="([^"]+)"', api.get("/login").text).group(1)
    assert api.post("/login", data={"password": PASSWORD, "csrf": token}, follow_redirects=False).status_code == 303
    return re.search(r'name="csrf" value="([^"]+)"', api.get("/settings").text).group(1)


def test_sharing_the_cache_across_keys_sends_no_salt_and_the_setting_lasts(api, tmp_path):
    a, b = key_headers(api, "a"), key_headers(api, "b")
    csrf = signed_in(api)
    page = api.get("/settings").text
    assert "Share the prefix cache across API keys" in page
    assert not re.search(r'id="share-prefix-cache"[^>]*checked', page)  # off by default
    assert api.post("/settings/prefix-cache", data={"share": "on"}).status_code == 403  # CSRF-checked
    r = api.post("/settings/prefix-cache", data={"csrf": csrf, "share": "on"}, follow_redirects=False)
    assert r.status_code == 303, r.text
    assert re.search(r'id="share-prefix-cache"[^>]*checked', api.get("/settings").text)
    assert load_cache_salts(api.app_state.db).shared  # kept in the settings: the next start shares too
    a_calls = agent_calls(api, a, LONG)
    b_calls = agent_calls(api, b, LONG)
    assert not any("cache_salt" in body for _, body in a_calls + b_calls)  # as before salts: all shared
    assert [p for p, _ in b_calls] == ["/v1/generate"] * 3  # and so is the index: B's chat finds A's pages
    assert api.post("/settings/prefix-cache", data={"csrf": csrf}, follow_redirects=False).status_code == 303
    assert not load_cache_salts(api.app_state.db).shared
    assert all("cache_salt" in body for _, body in agent_calls(api, a))
    api.cookies.set("lang", "de")
    assert "Präfix-Cache zwischen API-Schlüsseln teilen" in api.get("/settings").text


# ---- the decoder passes the salt on to its prefiller ----------------------------------------------
class Prefiller:
    """The prefiller's client as the decoder's handshake calls it: records the handoff asked for
    and refuses it (nothing more of the handshake is this test's subject)."""

    def __init__(self):
        self.asked: dict | None = None

    async def create_handoff(self, **body) -> dict:
        self.asked = body
        raise AgentHTTPError(409, "refused by the test")


@pytest.mark.parametrize("salt", [SALT, None])
def test_the_decoder_asks_its_prefiller_for_the_prompt_under_the_request_s_salt(salt):
    contract = SimpleNamespace(fingerprint="f" * 32, fingerprint_bytes=bytes(16))
    adapter = SimpleNamespace(contract=contract, geometry=None, decodes_coded=frozenset())
    prefiller = Prefiller()
    handshake = Handshake(adapter, prefiller, "http://p.test:7001", metrics=None)
    req = EngineRequest("r", LONG, SamplingParams(), cache_salt=salt)
    with pytest.raises(PrefillerRefused):
        asyncio.run(handshake.open(req, "raw"))
    assert prefiller.asked.get("cache_salt") == salt
    assert ("cache_salt" in prefiller.asked) == (salt is not None)  # unsalted: the body as before salts
    HandoffBody(**prefiller.asked)  # what the prefiller's route takes


# ---- vLLM and SGLang: the salt goes to their servers ----------------------------------------------
def server_adapter(cls):
    """An adapter of `cls` with what building a request body reads, and no server."""
    adapter = object.__new__(cls)
    adapter.info = SimpleNamespace(vocab_size=1000)
    adapter.server = SimpleNamespace(bootstrap_port=1234)
    return adapter


@pytest.mark.parametrize("cls", [VLLMAdapter, SGLangAdapter])
@pytest.mark.parametrize("salt", [SALT, None])
def test_a_server_engine_s_request_carries_the_salt(cls, salt):
    """vLLM chains `cache_salt` into its first block's hash, SGLang into its radix key; no salt is
    no field (the servers' shared cache, as before)."""
    adapter = server_adapter(cls)
    req = EngineRequest("r", LONG, SamplingParams(), cache_salt=salt)
    transfer = SimpleNamespace(op="export", room="7", tokens=128)
    for body in (adapter._body(req, 1, False, transfer), adapter._body(req, 4, True, transfer)):
        assert body.get("cache_salt") == salt and ("cache_salt" in body) == (salt is not None)


def test_sglang_s_generate_salts_both_of_its_halves(monkeypatch):
    """SGLang alone runs a prefill and a decode of its own: both carry the request's salt."""
    adapter = server_adapter(SGLangAdapter)
    seen = []

    async def prefill(req):
        seen.append(req)
        return
        yield

    async def decode(req, stream):
        seen.append(req)
        yield 5

    monkeypatch.setattr(adapter, "validate", lambda req, generates: None, raising=False)
    monkeypatch.setattr(adapter, "prefill", prefill, raising=False)
    monkeypatch.setattr(adapter, "decode", decode, raising=False)

    async def tokens():
        req = EngineRequest("r", LONG, SamplingParams(), FirstTokenMode.COMMIT_FIRST, cache_salt=SALT)
        return [t async for t in adapter.generate(req)]

    assert asyncio.run(tokens()) == [5]
    assert [r.cache_salt for r in seen] == [SALT, SALT]
