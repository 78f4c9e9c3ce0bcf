"""The pair form's budgets and the nodes table's decoding and prefix cache columns, on the real
panel in process with fake agents behind an httpx transport (as tests/unit/test_router.py drives
the router).

The fakes answer what an agent answers to the panel's calls (info, status, config, its
checkpoints) and record every call; the identity proof is taken as passed. The real exchange
with real agents is tests/system/test_panel_ui.py's.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from dataclasses import dataclass

import httpx
import pytest
import sqlalchemy as sa
from alembic import command
from sqlmodel import Session, select

from control_panel import pins, services
from control_panel.app import create_app
from control_panel.db import alembic_config, open_db
from control_panel.models import Node, Pool, PoolMember
from control_panel.security import set_admin_password
from control_panel.state import open_state
from control_panel.ui import node_status
from tandem_protocol.client import AgentClient
from tandem_protocol.contract import ModelContract
from tandem_protocol.pages import PROTOCOL_VERSION

from ..panel_db import insert_old_pair

KEY, PASSWORD = "tdm_unit-cluster-0123456789abcdef", "unit-admin-password"
P, D, E = "http://p.test:7001", "http://d.test:7002", "http://e.test:7003"
CONTRACT = ModelContract("w", "t", "c", 2048, layers=2, kv_heads=2, head_dim=64).to_dict()
MIB = 1 << 20


class FakeNodes(httpx.AsyncBaseTransport):
    """Two agents, P and D, as the panel reaches them; `old`: those without decoder admission (nor a
    prefix cache). A state's "prefix_cache" is what its status reports (None: an engine without one)."""

    def __init__(self, old: tuple[str, ...] = ()):
        self.calls: list[tuple[str, str, dict | None]] = []  # (agent, path, body)
        self.state = {
            name: {
                "staging": 512 * MIB,
                "kv": 1024 * MIB,
                "kv_reserved": 0,
                "running": 0,
                "waiting": 0,
                "prefix_cache": None,
            }
            for name in ("P", "D", "E")
        }
        self.old = old
        self.contracts = {name: CONTRACT for name in ("P", "D", "E")}

    def status(self, name: str) -> dict:
        s = self.state[name]
        status = {
            "node_id": name * 32,
            "name": name.lower(),
            "protocol_version": PROTOCOL_VERSION,
            "state": "ready",
            "engine": "torch",
            "model": "m",
            "model_path": "/models/m",
            "contract": self.contracts[name],
            "accelerator": {"kind": "cpu"},
            "context_length": 2048,
            "budget": {"capacity": s["staging"], "reserved": 0, "waiting": 0, "waiting_bytes": 0},
            "decode": {
                "kv_capacity": s["kv"],
                "kv_reserved": s["kv_reserved"],
                "max_sequences": 64,
                "running": s["running"],
                "waiting": s["waiting"],
            },
            "prefix_cache": s["prefix_cache"],
            "open_handoffs": 0,
            "totals": {},
        }
        if name in self.old:
            del status["decode"], status["prefix_cache"]
        return status

    def configured(self, name: str) -> list[dict]:
        return [body for agent, path, body in self.calls if agent == name and path == "/v1/config"]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        name = {"p.test": "P", "d.test": "D", "e.test": "E"}[request.url.host]
        self.calls.append((name, request.url.path, body))
        if request.url.path in ("/v1/info", "/v1/status"):
            return httpx.Response(200, json=self.status(name))
        if request.url.path == "/v1/models/local":
            return httpx.Response(200, json={"roots": [], "models": []})
        if request.url.path == "/v1/config":
            if not body["dry_run"]:
                s = self.state[name]
                s["staging"] = body["staging_bytes"] or s["staging"]
                s["kv"] = body.get("decode_kv_bytes") or s["kv"]
            return httpx.Response(200, json={"ok": True, "changed": not body["dry_run"], **self.status(name)})
        return httpx.Response(404, json={"error": {"message": "?"}})


@pytest.fixture
def panel(tmp_path, monkeypatch):
    """The panel app with nodes "p", "d" and "e" paired, every agent call going to `panel.state.agents`."""
    agents = FakeNodes()
    client = functools.partial(AgentClient, transport=agents)
    monkeypatch.setattr(pins, "AgentClient", client)
    monkeypatch.setattr(node_status, "AgentClient", client)

    async def proved(url: str, _key: str, expect_node_id=None, expect_fingerprint=None) -> services.Proved:
        return services.Proved({P: "P", D: "D", E: "E"}[url.rstrip("/")] * 32, "")

    monkeypatch.setattr(services, "verify_identity", proved)
    state = open_state(tmp_path, KEY)
    set_admin_password(state.db, PASSWORD)
    app = create_app(state)
    with Session(state.db) as s:
        for name, url in (("P", P), ("D", D), ("E", E)):
            s.add(Node(name=name.lower(), url=url, node_id=name * 32, paired=True, engine="torch", model="m"))
        s.commit()
    app.state.agents = agents
    yield app
    state.db.dispose()


def node_ids(app) -> dict[str, str]:
    with Session(app.state.db) as s:
        return {n.name: str(n.id) for n in s.exec(select(Node))}


@dataclass
class StoredPair:
    staging_bytes: int
    decode_kv_bytes: int


def stored_pair_in(db: sa.Engine, name: str) -> StoredPair:
    """The budgets a model of two nodes keeps for its prefill and its decode node."""
    with Session(db) as s:
        members = s.exec(select(PoolMember).join(Pool).where(Pool.name == name)).all()
        budgets = {m.role: m.budget_bytes for m in members}
        return StoredPair(budgets["prefill"], budgets["decode"])


def stored_pair(app, name: str) -> StoredPair:
    return stored_pair_in(app.state.db, name)


async def _signed_in_calls(app, calls: list[tuple[str, str, dict]], lang: str) -> list[httpx.Response]:
    """Sign in, then make each (method, path, form) call; a form gets the session's CSRF token."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
        login = await c.get("/login")
        token = re.search(r'name="csrf" value="([^"]+)"', login.text).group(1)
        assert (await c.post("/login", data={"password": PASSWORD, "csrf": token})).status_code == 303
        c.cookies.set("lang", lang)
        csrf = re.search(r'name="csrf" value="([^"]+)"', (await c.get("/models")).text).group(1)
        answers = []
        for method, path, form in calls:
            answers.append(await c.request(method, path, data={**form, "csrf": csrf} if method == "POST" else None))
        await app.state.router.aclose()
        return answers


def as_admin(app, *calls: tuple[str, str, dict], lang: str = "en") -> list[httpx.Response]:
    return asyncio.run(_signed_in_calls(app, list(calls), lang))


def pair_form(app, **fields) -> dict:
    ids = node_ids(app)
    return {"name": "pd", "prefill": ids["p"], "decode": ids["d"], "threshold": "0", "fallback": "fail", **fields}


@pytest.mark.parametrize("value", ["0", "1.5", "-4", "lots"])
def test_a_decode_kv_budget_that_is_not_whole_mib_is_refused_on_the_form(panel, value):
    (r,) = as_admin(panel, ("POST", "/models", pair_form(panel, decode_kv_mib=value)))
    assert r.status_code == 400
    assert "The decode KV budget must be a whole number of MiB, 1 or more." in r.text
    assert re.search(r'name="decode_kv_mib"[^>]*aria-invalid="true"', r.text)
    assert not re.search(r'name="staging_mib"[^>]*aria-invalid="true"', r.text)
    assert panel.state.agents.configured("P") == panel.state.agents.configured("D") == []  # no node was asked
    (r,) = as_admin(panel, ("POST", "/models", pair_form(panel, decode_kv_mib=value)), lang="de")
    assert "Das Decode-KV-Budget muss eine ganze Zahl von MiB sein, 1 oder mehr." in r.text


def test_the_decode_kv_budget_goes_to_the_decode_node_alone(panel):
    agents = panel.state.agents
    (r,) = as_admin(panel, ("POST", "/models", pair_form(panel, staging_mib="64", decode_kv_mib="256")))
    assert r.status_code == 303, r.text[-2000:]
    p_bodies, d_bodies = agents.configured("P"), agents.configured("D")
    assert [b["dry_run"] for b in p_bodies] == [b["dry_run"] for b in d_bodies] == [True, False]  # checked, then set
    assert all(b["staging_bytes"] == 64 * MIB and "decode_kv_bytes" not in b for b in p_bodies)
    assert all(b["decode_kv_bytes"] == 256 * MIB and b["staging_bytes"] is None for b in d_bodies)
    pair = stored_pair(panel, "pd")
    assert (pair.staging_bytes, pair.decode_kv_bytes) == (64 * MIB, 256 * MIB)  # as the nodes report them

    agents.calls.clear()  # blank budgets and nothing else to change: neither node is configured
    (r,) = as_admin(panel, ("POST", "/models", pair_form(panel, replace="1")))
    assert r.status_code == 303 and agents.configured("P") == agents.configured("D") == []
    assert stored_pair(panel, "pd").decode_kv_bytes == 256 * MIB  # the decode node kept it


def test_a_decode_node_without_admission_is_refused_a_decode_kv_budget(panel):
    agents = panel.state.agents
    agents.old = ("D",)
    (r,) = as_admin(panel, ("POST", "/models", pair_form(panel, decode_kv_mib="256")))
    assert r.status_code == 400 and "decode node: this agent takes no decode KV budget: update Tandem" in r.text
    assert re.search(r'name="decode_kv_mib"[^>]*aria-invalid="true"', r.text)
    assert agents.configured("D") == []
    (r,) = as_admin(panel, ("POST", "/models", pair_form(panel)))  # without one, it pairs: its budget is not known
    assert r.status_code == 303 and stored_pair(panel, "pd").decode_kv_bytes == 0


def decoding_cell(html: str, node: str) -> str:
    row = re.search(rf'<tr data-node="{node}".*?</tr>', html, re.S).group(0)
    return re.search(r'<td class="decoding">(.*?)</td>', row, re.S).group(1)


def test_the_nodes_table_shows_decoding_and_a_dash_for_an_older_agent(panel):
    agents = panel.state.agents
    agents.old = ("P",)
    agents.state["D"].update(kv_reserved=64 * MIB, kv=256 * MIB, running=2, waiting=1)
    (en,) = as_admin(panel, ("GET", "/nodes/table", {}))
    assert en.status_code == 200
    assert "<th>Decoding</th>" in en.text
    d = decoding_cell(en.text, "d")
    assert "2 running · 1 waiting" in d and "64.0 MiB of 256.0 MiB KV reserved" in d
    assert 'aria-valuenow="67108864"' in d and "width: 25%" in d
    assert decoding_cell(en.text, "p").strip() == "—"
    (de,) = as_admin(panel, ("GET", "/nodes/table", {}), lang="de")
    assert "2 laufend · 1 wartend" in decoding_cell(de.text, "d")


def prefix_cache_cell(html: str, node: str) -> str:
    row = re.search(rf'<tr data-node="{node}".*?</tr>', html, re.S).group(0)
    return re.search(r'<td class="prefix-cache">(.*?)</td>', row, re.S).group(1)


def prefix_cache(capacity: int, held: int, lookup_tokens: int, hit_tokens: int) -> dict:
    """A prefix cache as an agent's status reports it."""
    return {
        "capacity": capacity,
        "bytes": held,
        "pages": held // MIB,
        "lookups": lookup_tokens // 100,
        "lookup_tokens": lookup_tokens,
        "hit_tokens": hit_tokens,
        "evicted_pages": 0,
    }


def test_the_nodes_table_shows_the_prefix_cache_and_a_dash_without_one(panel):
    agents = panel.state.agents
    agents.state["D"]["prefix_cache"] = prefix_cache(256 * MIB, 64 * MIB, lookup_tokens=1000, hit_tokens=250)
    (en,) = as_admin(panel, ("GET", "/nodes/table", {}))  # P's engine keeps none: its prefix_cache is null
    assert en.status_code == 200
    assert "<th>Decoding</th><th>Prefix cache</th>" in en.text
    d = prefix_cache_cell(en.text, "d")
    assert re.search(r"<small>(.*?)</small>", d, re.S).group(1) == (
        "64.0 MiB of 256.0 MiB held · 25% of prompt tokens reused"
    )
    assert 'aria-valuemax="268435456"' in d and 'aria-valuenow="67108864"' in d and "width: 25%" in d
    assert prefix_cache_cell(en.text, "p").strip() == "—"
    (de,) = as_admin(panel, ("GET", "/nodes/table", {}), lang="de")
    assert re.search(r"<small>(.*?)</small>", prefix_cache_cell(de.text, "d"), re.S).group(1) == (
        "64.0 MiB von 256.0 MiB belegt · 25 % der Prompt-Tokens wiederverwendet"
    )
    assert "<th>Präfix-Cache</th>" in de.text
    # a cache asked nothing yet says so; an agent older than prefix caches has no key at all
    agents.state["D"]["prefix_cache"] = prefix_cache(256 * MIB, 0, lookup_tokens=0, hit_tokens=0)
    agents.old = ("P",)
    (en,) = as_admin(panel, ("GET", "/nodes/table", {}))
    assert "0 B of 256.0 MiB held · no lookups yet" in prefix_cache_cell(en.text, "d")
    assert prefix_cache_cell(en.text, "p").strip() == "—"


def test_migration_gives_existing_pairs_an_unknown_decode_kv_budget(tmp_path):
    db = tmp_path / "panel.db"
    engine = open_db(db, "0004")
    insert_old_pair(engine)
    engine.dispose()
    engine = open_db(db)
    assert stored_pair_in(engine, "old").decode_kv_bytes == 0
    engine.dispose()
    command.downgrade(alembic_config(f"sqlite:///{db}"), "0004")
    engine = sa.create_engine(f"sqlite:///{db}")
    assert "decode_kv_bytes" not in {c["name"] for c in sa.inspect(engine).get_columns("pair")}
    engine.dispose()


def members_of(app, name: str) -> list[tuple[str, str, int]]:
    with Session(app.state.db) as s:
        rows = s.exec(select(PoolMember, Node).join(Pool).join(Node).where(Pool.name == name).order_by(PoolMember.id))
        return [(n.name, m.role, m.budget_bytes) for m, n in rows]


def pool_id(app, name: str) -> int:
    with Session(app.state.db) as s:
        return s.exec(select(Pool.id).where(Pool.name == name)).one()


def test_a_node_joins_a_model_as_a_second_decoder_and_leaves_it(panel):
    agents = panel.state.agents
    (r,) = as_admin(panel, ("POST", "/models", pair_form(panel)))
    assert r.status_code == 303 and members_of(panel, "pd") == [
        ("p", "prefill", 512 * MIB),
        ("d", "decode", 1024 * MIB),
    ]
    pid, ids = pool_id(panel, "pd"), node_ids(panel)
    join = {"node": ids["e"], "role": "decode", "budget_mib": "256"}
    (r, page) = as_admin(panel, ("POST", f"/models/{pid}/members", join), ("GET", "/models", {}))
    assert r.status_code == 303, r.text[-2000:]
    assert [b["dry_run"] for b in agents.configured("E")] == [True, False]  # checked, then set
    assert all(b["decode_kv_bytes"] == 256 * MIB for b in agents.configured("E"))
    assert members_of(panel, "pd")[-1] == ("e", "decode", 256 * MIB)
    member_row = re.search(r'<tr data-member="e:decode">.*?</tr>', page.text, re.S).group(0)
    assert "torch · /models/m · 256 MiB" in member_row  # budgets in MiB, as the forms take them
    (r,) = as_admin(panel, ("POST", f"/models/{pid}/members", join))  # twice in one role: refused
    assert r.status_code == 400 and "already a decode node of pd" in r.text

    with Session(panel.state.db) as s:
        members = {n.name: m.id for m, n in s.exec(select(PoolMember, Node).join(Node))}
    (r,) = as_admin(panel, ("POST", f"/models/{pid}/members/{members['e']}/delete", {}))
    assert r.status_code == 303 and [m[0] for m in members_of(panel, "pd")] == ["p", "d"]
    (r,) = as_admin(panel, ("POST", f"/models/{pid}/members/{members['d']}/delete", {}))  # its last decoder
    assert r.status_code == 400
    error = re.search(r'<p class="error" role="alert" id="models-error">(.*?)</p>', r.text).group(1)
    assert error == "Could not remove the node: a model needs a decode node: delete the model instead"
    assert [m[0] for m in members_of(panel, "pd")] == ["p", "d"]
    (r,) = as_admin(panel, ("POST", f"/models/{pid}/delete", {}))
    assert r.status_code == 303 and members_of(panel, "pd") == []


def test_a_node_of_another_model_cannot_join_and_its_field_says_so(panel):
    agents = panel.state.agents
    assert as_admin(panel, ("POST", "/models", pair_form(panel)))[0].status_code == 303
    agents.contracts["E"] = {**CONTRACT, "weights": "other"}
    agents.calls.clear()
    join = {"node": node_ids(panel)["e"], "role": "prefill"}
    (r,) = as_admin(panel, ("POST", f"/models/{pool_id(panel, 'pd')}/members", join), lang="de")
    assert r.status_code == 400
    assert "Dieser Knoten führt ein anderes Modell aus: Die Verträge unterscheiden sich in Gewichte." in r.text
    assert re.search(r'<select name="node"[^>]*aria-invalid="true"', r.text)
    assert [b["dry_run"] for b in agents.configured("E")] == [
        True
    ]  # set to the model's context length: checked, never set
    assert [m[0] for m in members_of(panel, "pd")] == ["p", "d"]


def test_the_pairs_page_moved_to_models(panel):
    (r,) = as_admin(panel, ("GET", "/pairs", {}))
    assert r.status_code == 301 and r.headers["location"] == "/models"


def test_markup_an_agent_reports_is_shown_as_text_on_every_page(panel):
    """A node's name, engine and model come from agents (an mDNS record, a status answer): markup
    in them renders escaped on the Nodes table, the Nodes page and the Models page (security
    review §5: the autoescaping, checked)."""
    tag = "<img src=x onerror=alert(1)>"
    with Session(panel.state.db) as s:
        node = s.exec(select(Node).where(Node.name == "e")).one()
        node.name, node.engine, node.model = tag, f"torch{tag}", f"m{tag}"
        s.add(node)
        s.commit()
    for r in as_admin(panel, ("GET", "/nodes/table", {}), ("GET", "/nodes", {}), ("GET", "/models", {})):
        assert r.status_code == 200, r.text
        assert tag not in r.text and "&lt;img src=x onerror=alert(1)&gt;" in r.text, r.request.url


def test_a_new_model_with_a_live_models_name_is_replaced_only_when_asked(panel):
    """UX walk item 1: the create form given the name of a model already served replaced it,
    silently, with the form's defaults. Without Replace ticked it is refused, naming the name field,
    in the user's language, and the live model keeps its nodes and roles; with it, it is replaced."""
    assert as_admin(panel, ("POST", "/models", pair_form(panel)))[0].status_code == 303
    ids = node_ids(panel)
    other = pair_form(panel, prefill=ids["d"], decode=ids["e"])
    (en,) = as_admin(panel, ("POST", "/models", other))
    assert en.status_code == 400, en.text
    assert "A model named pd already exists: add nodes to it, delete it first, or tick Replace" in en.text
    assert re.search(r'<input[^>]*name="name"[^>]*aria-invalid="true"', en.text), en.text
    (de,) = as_admin(panel, ("POST", "/models", other), lang="de")
    assert "Ein Modell namens pd gibt es schon" in de.text
    assert [m[0] for m in members_of(panel, "pd")] == ["p", "d"]
    assert as_admin(panel, ("POST", "/models", {**other, "replace": "1"}))[0].status_code == 303
    assert [m[0] for m in members_of(panel, "pd")] == ["d", "e"]


@pytest.mark.parametrize(
    "typed, url",
    [
        ("192.168.1.20", "https://192.168.1.20:7411"),
        (" 192.168.1.20:8000/ ", "https://192.168.1.20:8000"),
        ("mac.local", "https://mac.local:7411"),
        ("http://192.168.1.20:7411", "http://192.168.1.20:7411"),
        ("https://[fe80::1]:7411/", "https://[fe80::1]:7411"),
        ("[fe80::1]", "https://[fe80::1]:7411"),
        ("  ", ""),
    ],
)
def test_an_address_typed_in_the_add_node_form_becomes_an_agents_url(typed, url):
    """A bare host or host:port is an agent at its defaults: HTTPS, port 7411 unless given."""
    from control_panel.ui.nodes import agent_url

    assert agent_url(typed) == url
