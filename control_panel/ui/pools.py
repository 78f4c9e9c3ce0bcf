"""The Models page: each model name on the API and the pool of nodes that serves it.

A model is created as a pair (prefill on one node, decode on another: the smallest pool); nodes
join or leave its pool afterwards. Forms are checked here (every error names its field, in the
user's language); the nodes check engine, model path and contract in `services` before any of
them loads anything.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Form
from fastapi.responses import RedirectResponse
from sqlmodel import Session, select

from tandem_protocol import ENGINES
from tandem_protocol.errors import ContractMismatch

from ..deps import SIGNED_IN, CsrfForm, Panel, Render, Tr
from ..models import Node, Pool, PoolMember
from ..services import MemberSpec, PanelError, add_member, create_pair, delete_pool, remove_member
from . import node_status
from .render import CONTRACT_FIELDS, FALLBACKS, PAGE_ENCODINGS

router = APIRouter(include_in_schema=False, dependencies=SIGNED_IN)


async def models_context(panel: Panel) -> dict:
    with Session(panel.db) as s:
        nodes = {n.id: n for n in s.exec(select(Node).order_by(Node.name))}
        members = s.exec(select(PoolMember).order_by(PoolMember.role.desc(), PoolMember.id)).all()
        models = [
            {"pool": p, "members": [(m, nodes.get(m.node_id)) for m in members if m.pool_id == p.id]}
            for p in s.exec(select(Pool).order_by(Pool.name))
        ]
    for row in models:
        row["links"] = measured_links(panel, row["members"])
    paired = [n for n in nodes.values() if n.paired]
    key = panel.router.cluster_key
    found = await asyncio.gather(*(node_status.node_models(n.url, key) for n in paired))
    model_paths = [(n.name, m["path"]) for n, models in zip(paired, found) for m in models if m["supported"]]
    return {
        "models": models,
        "nodes": paired,
        "engines": list(ENGINES),
        "model_paths": model_paths,
        "measured": {n.url: measured_node(panel, n.url) for n in nodes.values() if n.url},
    }


def measured_node(panel: Panel, url: str) -> dict | None:
    """What the planner has measured of a node: prefill tokens/s (at 2,048 tokens, or the length
    nearest it measured) and decode step, for the page; None: nothing yet."""
    f = panel.router.planner.figures
    spt, step = f.seconds_per_token(url, 2048), f.step(url)
    if spt is None and step is None:
        return None
    return {"rate": f"{1 / spt:,.0f}" if spt else "?", "step": f"{step * 1000:.0f}" if step else "?"}


def measured_links(panel: Panel, members: list) -> list[dict]:
    """Each measured prefill-to-decode link of a pool: (P name, D name, MB/s, round trip ms)."""
    f, out = panel.router.planner.figures, []
    for pm, p in members:
        for dm, d in members:
            if p and d and pm.role == "prefill" and dm.role == "decode" and p.url != d.url:
                link = f.link(p.url, d.url)
                if link is not None:
                    rate, rtt = f"{link.bytes_per_second / 1e6:,.0f}", f"{link.rtt_seconds * 1000:.1f}"
                    out.append({"p": p.name, "d": d.name, "rate": rate, "rtt": rtt})
    return out


async def models_page_response(panel: Panel, render: Render, status_code: int = 200, **shown):
    """The page, with a form's error (`error`, `bad_fields`, `form`, `member_error` for one model's
    add-node form) where there is one."""
    shown = {"error": None, "bad_fields": [], "form": {}, "member_error": None, "member_form": {}, **shown}
    return render("models.html", status_code=status_code, **shown, **(await models_context(panel)))


@router.get("/models")
async def models_page(panel: Panel, render: Render):
    return await models_page_response(panel, render)


@router.get("/pairs")
async def pairs_moved():
    return RedirectResponse("/models", status_code=301)  # the page's name before pools


def whole_number(text: str, least: int) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() and int(text) >= least else None


def check_form(form: dict, nodes: tuple[Node | None, Node | None], t: Tr) -> tuple[str | None, list[str]]:
    """The form's first mistake and the fields at fault, or (None, [])."""
    _ = t.gettext
    p_node, d_node = nodes
    for key, message in (
        ("context_length", _("The context length must be a whole number of tokens, 1 or more.")),
        ("staging_mib", _("The staging budget must be a whole number of MiB, 1 or more.")),
        ("decode_kv_mib", _("The decode KV budget must be a whole number of MiB, 1 or more.")),
    ):
        if form[key] and whole_number(form[key], 1) is None:
            return message, [key]
    if whole_number(form["threshold"] or "0", 0) is None:
        return _("The threshold must be a whole number of tokens, 0 or more."), ["threshold"]
    if not form["name"] or "/" in form["name"]:
        return _("A pair needs a name without '/' (it becomes the model name on the API)."), ["name"]
    if p_node is None or d_node is None:
        return _("Choose a prefill node and a decode node."), ["prefill", "decode"]
    if p_node.id == d_node.id:
        return _("The prefill node and the decode node must be different."), ["prefill", "decode"]
    if form["fallback"] not in FALLBACKS:
        return _("Unknown fallback policy."), ["fallback"]
    if form["page_encoding"] not in PAGE_ENCODINGS:
        return _("Unknown page encoding."), ["page_encoding"]
    return None, []


async def save_pair(panel: Panel, form: dict, p_node: Node, d_node: Node, t: Tr) -> tuple[str | None, list[str]]:
    """Create (or replace) the model as a pair of nodes; (None, []) or why not and the fields at fault."""
    _ = t.gettext
    staging_mib, decode_kv_mib = whole_number(form["staging_mib"], 1), whole_number(form["decode_kv_mib"], 1)
    try:
        await create_pair(
            panel.db,
            panel.router.cluster_key,
            form["name"],
            p_node.url,
            d_node.url,
            int(form["threshold"] or 0),
            form["fallback"],
            form["page_encoding"],
            prefill_engine=form["prefill_engine"] or None,
            prefill_model_path=form["prefill_model_path"] or None,
            decode_engine=form["decode_engine"] or None,
            decode_model_path=form["decode_model_path"] or None,
            context_length=whole_number(form["context_length"], 1),
            staging_bytes=staging_mib << 20 if staging_mib else None,
            decode_kv_bytes=decode_kv_mib << 20 if decode_kv_mib else None,
        )
    except (ContractMismatch, PanelError) as e:
        return refusal(e, t)
    finally:
        panel.router.forget(p_node.url, d_node.url)  # their engines may have just changed
    return None, []


def refusal(e: ContractMismatch | PanelError, t: Tr, joining: bool = False) -> tuple[str, list[str]]:
    """What the page says of a refused change (`joining`: a node joining a pool), and the fields at
    fault."""
    _ = t.gettext
    if isinstance(e, ContractMismatch):
        names = ", ".join(_(CONTRACT_FIELDS.get(f, f)) for f in e.fields)
        if joining:
            error = _("This node runs another model: the contracts differ in %(fields)s.", fields=names)
            return error, ["node"] + [f"contract:{f}" for f in e.fields]
        error = _("The two nodes do not run the same model: their contracts differ in %(fields)s.", fields=names)
        return error, ["prefill", "decode"] + [f"contract:{f}" for f in e.fields]
    if joining:
        return _("Could not add the node: %(reason)s", reason=str(e)), list(e.fields)
    return _("Could not create the pair: %(reason)s", reason=str(e)), list(e.fields)


def model_named(panel: Panel, name: str) -> bool:
    with Session(panel.db) as s:
        return s.exec(select(Pool.id).where(Pool.name == name)).first() is not None


@router.post("/models")
async def models_create(
    _csrf: CsrfForm,
    panel: Panel,
    render: Render,
    t: Tr,
    name: Annotated[str, Form()] = "",
    prefill: Annotated[str, Form()] = "",
    decode: Annotated[str, Form()] = "",
    prefill_engine: Annotated[str, Form()] = "",
    prefill_model_path: Annotated[str, Form()] = "",
    decode_engine: Annotated[str, Form()] = "",
    decode_model_path: Annotated[str, Form()] = "",
    context_length: Annotated[str, Form()] = "",
    staging_mib: Annotated[str, Form()] = "",
    decode_kv_mib: Annotated[str, Form()] = "",
    threshold: Annotated[str, Form()] = "0",
    fallback: Annotated[str, Form()] = "decode_alone",
    page_encoding: Annotated[str, Form()] = "raw",
    replace: Annotated[str, Form()] = "",
):
    form = {
        "name": name.strip(),
        "prefill": prefill,
        "decode": decode,
        "prefill_engine": prefill_engine,
        "prefill_model_path": prefill_model_path.strip(),
        "decode_engine": decode_engine,
        "decode_model_path": decode_model_path.strip(),
        "context_length": context_length.strip(),
        "staging_mib": staging_mib.strip(),
        "decode_kv_mib": decode_kv_mib.strip(),
        "threshold": threshold,
        "fallback": fallback,
        "page_encoding": page_encoding,
        "replace": replace == "1",
    }
    with Session(panel.db) as s:
        nodes = tuple(s.get(Node, int(form[role])) if form[role].isdigit() else None for role in ("prefill", "decode"))
    error, bad = check_form(form, nodes, t)
    if error is None and not form["replace"] and model_named(panel, form["name"]):  # never silently replaced
        _ = t.gettext
        error = _(
            "A model named %(name)s already exists: add nodes to it, delete it first, or tick Replace to set it anew.",
            name=form["name"],
        )
        bad = ["name"]
    if error is None:
        error, bad = await save_pair(panel, form, *nodes, t)
    if error:
        return await models_page_response(panel, render, 400, error=error, bad_fields=bad, form=form)
    return RedirectResponse("/models", status_code=303)


@router.post("/models/{pool_id}/members")
async def members_add(
    _csrf: CsrfForm,
    pool_id: int,
    panel: Panel,
    render: Render,
    t: Tr,
    node: Annotated[str, Form()] = "",
    role: Annotated[str, Form()] = "decode",
    engine: Annotated[str, Form()] = "",
    model_path: Annotated[str, Form()] = "",
    budget_mib: Annotated[str, Form()] = "",
):
    """Add a node to a model's pool in a role, once its contract agrees with the pool's."""
    _ = t.gettext
    form = {"node": node, "role": role, "engine": engine, "model_path": model_path.strip(), "budget_mib": budget_mib}
    with Session(panel.db) as s:
        chosen = s.get(Node, int(node)) if node.isdigit() else None
    budget = whole_number(budget_mib, 1) if budget_mib.strip() else None
    error, bad = None, []
    if chosen is None:
        error, bad = _("Choose a node."), ["node"]
    elif role not in ("prefill", "decode"):
        error, bad = _("A node of a model prefills or decodes."), ["role"]
    elif budget_mib.strip() and budget is None:
        error, bad = _("The budget must be a whole number of MiB, 1 or more."), ["budget_mib"]
    else:
        spec = MemberSpec(
            chosen.url, role, engine or None, form["model_path"] or None, budget << 20 if budget else None
        )
        try:
            await add_member(panel.db, panel.router.cluster_key, pool_id, spec)
        except (ContractMismatch, PanelError) as e:
            error, bad = refusal(e, t, joining=True)
            bad = ["node" if f in (role, "prefill", "decode") else f.removeprefix(f"{role}_") for f in bad]
        finally:
            panel.router.forget(chosen.url)  # its engine may have just changed
    if error:
        shown = {"member_error": (pool_id, error, bad), "member_form": form}
        return await models_page_response(panel, render, 400, **shown)
    return RedirectResponse("/models", status_code=303)


@router.post("/models/{pool_id}/members/{member_id}/delete")
async def members_remove(_csrf: CsrfForm, pool_id: int, member_id: int, panel: Panel, render: Render, t: Tr):
    """Take a node out of a model's pool (a model keeps at least one decode node)."""
    _ = t.gettext
    with Session(panel.db) as s:
        member = s.get(PoolMember, member_id)
        node = s.get(Node, member.node_id) if member is not None and member.pool_id == pool_id else None
    if node is None:
        return RedirectResponse("/models", status_code=303)  # gone already (a second click)
    try:
        remove_member(panel.db, member_id)
    except PanelError as e:
        return await models_page_response(
            panel, render, 400, error=_("Could not remove the node: %(reason)s", reason=str(e))
        )
    panel.router.forget(node.url)
    return RedirectResponse("/models", status_code=303)


@router.post("/models/{pool_id}/delete")
async def models_delete(_csrf: CsrfForm, pool_id: int, panel: Panel):
    with Session(panel.db) as s:
        urls = [n.url for n in s.exec(select(Node).join(PoolMember).where(PoolMember.pool_id == pool_id))]
    delete_pool(panel.db, pool_id)
    panel.router.forget(*urls)
    return RedirectResponse("/models", status_code=303)
