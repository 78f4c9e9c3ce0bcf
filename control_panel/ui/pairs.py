"""The Pairs page: a model name on the API served by prefill on one node and decode on another.

The form is checked here (every error names its field, in the user's language); the nodes check
engine, model path and contract in `services.create_pair` before either loads anything.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Form
from fastapi.responses import RedirectResponse
from sqlmodel import Session, select

from tandem_protocol import ENGINES
from tandem_protocol.errors import ContractMismatch

from ..deps import SIGNED_IN, CsrfForm, Db, Panel, Render, Tr
from ..models import Node, Pair
from ..services import PanelError, create_pair, delete_row
from . import node_status
from .render import CONTRACT_FIELDS, FALLBACKS, PAGE_ENCODINGS

router = APIRouter(include_in_schema=False, dependencies=SIGNED_IN)


async def pairs_context(panel: Panel) -> dict:
    with Session(panel.db) as s:
        nodes = {n.id: n for n in s.exec(select(Node).order_by(Node.name))}
        pairs = [
            {"pair": p, "prefill": nodes.get(p.prefill_node_id), "decode": nodes.get(p.decode_node_id)}
            for p in s.exec(select(Pair).order_by(Pair.name))
        ]
    paired = [n for n in nodes.values() if n.paired]
    key = panel.router.cluster_key
    found = await asyncio.gather(*(node_status.node_models(n.url, key) for n in paired))
    model_paths = [(n.name, m["path"]) for n, models in zip(paired, found) for m in models if m["supported"]]
    return {"pairs": pairs, "nodes": paired, "engines": list(ENGINES), "model_paths": model_paths}


@router.get("/pairs")
async def pairs_page(panel: Panel, render: Render):
    return render("pairs.html", error=None, bad_fields=[], form={}, **(await pairs_context(panel)))


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
    """Create (or update) the pair on the nodes; (None, []) or why not and the fields at fault."""
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
    except ContractMismatch as e:
        names = ", ".join(_(CONTRACT_FIELDS.get(f, f)) for f in e.fields)
        error = _("The two nodes do not run the same model: their contracts differ in %(fields)s.", fields=names)
        return error, ["prefill", "decode"] + [f"contract:{f}" for f in e.fields]
    except PanelError as e:
        return _("Could not create the pair: %(reason)s", reason=str(e)), list(e.fields)
    finally:
        panel.router.forget(p_node.url, d_node.url)  # their engines may have just changed
    return None, []


@router.post("/pairs")
async def pairs_create(
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
    }
    with Session(panel.db) as s:
        nodes = tuple(s.get(Node, int(form[role])) if form[role].isdigit() else None for role in ("prefill", "decode"))
    error, bad = check_form(form, nodes, t)
    if error is None:
        error, bad = await save_pair(panel, form, *nodes, t)
    if error:
        context = await pairs_context(panel)
        return render("pairs.html", status_code=400, error=error, bad_fields=bad, form=form, **context)
    return RedirectResponse("/pairs", status_code=303)


@router.post("/pairs/{pair_id}/delete")
async def pairs_delete(_csrf: CsrfForm, pair_id: int, db: Db):
    delete_row(db, Pair, pair_id)
    return RedirectResponse("/pairs", status_code=303)
