"""Test-only probes into the server engines: the first-step log-probabilities by which the
cross-engine rules are measured with vLLM or SGLang as the decoder (their APIs expose
log-probabilities, not logits). They talk to the adapter's own server and bridge directly, which
no production path does. `cache_salt`: the request's prefix-cache namespace (a fresh one: the
engine's cache serves it nothing), as the adapters pass EngineRequest.cache_salt."""

from __future__ import annotations

from engine_adapters.bridge import END, first_token_frame, page_frame
from engine_adapters.sglang_adapter import SGLangAdapter, check_finish
from engine_adapters.vllm_adapter import VLLMAdapter
from tandem_protocol.errors import TandemError
from tandem_protocol.pages import KVPage


async def vllm_first_step_logprobs(
    engine: VLLMAdapter,
    token_ids: list[int],
    pages: list[KVPage] | None = None,
    top: int = 20,
    cache_salt: str | None = None,
) -> dict[int, float]:
    """vLLM's top log-probabilities for the token after `token_ids`: over its own prefill, or
    with prompt[:-1] imported from `pages` (recompute-last)."""
    body = {
        "model": "tandem",
        "prompt": token_ids,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": top,
        "return_tokens_as_token_ids": True,
    }
    if cache_salt:
        body["cache_salt"] = cache_salt
    room = None
    if pages is not None:
        room = engine._new_room()
        box = engine.bridge.open("import", room, len(token_ids) - 1)
        for page in pages:
            box.outgoing.put(page_frame(page))
        box.outgoing.put(END)
        body["kv_transfer_params"] = {"tandem_room": room, "tandem_load": len(token_ids) - 1}
    try:
        async with engine.http().post(engine.server.url + "/v1/completions", json=body) as r:
            data = await r.json()
        if "choices" not in data:
            raise TandemError(f"vLLM refused the log-probability request: {data}")
        top_lp = data["choices"][0]["logprobs"]["top_logprobs"][0]
        return {int(k.split(":", 1)[1]): float(v) for k, v in top_lp.items()}
    finally:
        if room is not None:
            engine.bridge.close_room(room)


async def sglang_decode_step_logprobs(
    engine: SGLangAdapter,
    token_ids: list[int],
    first_token: int,
    pages: list[KVPage],
    top: int = 20,
    cache_salt: str | None = None,
) -> dict[int, float]:
    """SGLang's top log-probabilities at its first decode step (the token after `first_token`)
    with the whole prompt's KV taken from `pages`."""
    room = engine._new_room()
    box = engine.bridge.open("import", room, len(token_ids))
    for page in pages:
        box.outgoing.put(page_frame(page))
    box.outgoing.put(first_token_frame(first_token))
    box.outgoing.put(END)
    body = {
        "input_ids": token_ids,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": top,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": engine.server.bootstrap_port,
        "bootstrap_room": int(room),
    }
    if cache_salt:
        body["cache_salt"] = cache_salt
    try:
        async with engine.gate.hold("decode"):
            async with engine.http().post(engine.server.url + "/generate", json=body) as r:
                data = await r.json()
        check_finish(data)
        steps = data["meta_info"]["output_top_logprobs"]
        return {int(token): float(logprob) for logprob, token, *_ in steps[1]}
    finally:
        engine.bridge.close_room(room)
