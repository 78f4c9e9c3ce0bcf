"""Security review L4: one API key cannot probe another's prompts through the shared prefix cache.

The attack: key A sends a prompt; key B sends the same prompt and reads
`usage.prompt_tokens_details.cached_tokens` (or times its first token): anything cached tells B
that someone sent that prefix. Each key's requests carry their own cache salt
(control_panel/cache_salt.py), chained into the page hashes (tandem_protocol/prefix.py), so B
finds nothing of A's while A still finds its own pages.

The engines' own test runs on the tiny random-weight Llama in process (`tiny_engines`), alone and
as a P/D pair (the delta handoff and the prefiller's cache both salted); the attack itself runs
through a real panel and one torch agent, because what the review names is what an API client
sees: the panel's answer, the agent's cache behind it.
"""

from __future__ import annotations

import pytest

from engine_adapters.base import EngineRequest
from node_agent.inprocess import PairStats, run_pair
from tandem_protocol.sampling import SamplingParams

from ..conftest import collect, run
from .conversation import SYSTEM, GiB

ONE = SamplingParams(max_tokens=1)
A, B = "a" * 64, "b" * 64  # two keys' salts, as the panel makes them (hex)


def generate(adapter, ids: list[int], salt: str | None) -> int:
    """The prompt tokens the engine's prefix cache served this request."""
    req = EngineRequest(f"salt-{salt}", ids, ONE, cache_salt=salt)
    run(collect(adapter.generate(req)))
    return req.cached_tokens


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_an_engine_serves_a_prompt_only_to_requests_of_the_salt_that_cached_it(tiny_engines, cache_bytes, engine):
    adapter = tiny_engines[engine]
    cache_bytes(adapter, 0)  # empty it of other tests' pages
    cache_bytes(adapter, GiB)
    ids = adapter.chat_token_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}])
    page = adapter.geometry.page_tokens
    assert len(ids) > 4 * page and len(ids) % page, len(ids)
    assert generate(adapter, ids, A) == 0
    assert generate(adapter, ids, A) == len(ids) - 1  # its own: the whole prompt but its last token
    assert generate(adapter, ids, B) == 0  # the attack: nothing of A's, not even a tail
    assert generate(adapter, ids, None) == 0  # nor for requests without a salt
    assert generate(adapter, ids, B) > 0  # B's own pages now


def test_a_pair_holds_and_prefills_from_the_request_s_salt_alone(tiny_engines, cache_bytes):
    """D's delta handoff (the pages it holds) and P's cache both follow the salt."""
    P, D = tiny_engines["torch"], tiny_engines["mlx"]
    for adapter in (P, D):
        cache_bytes(adapter, 0)
        cache_bytes(adapter, GiB)
    ids = D.chat_token_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}])
    pages = D.geometry.pages_for(len(ids))

    def pair(salt: str | None) -> PairStats:
        stats = PairStats()
        run(collect(run_pair(P, D, ids, ONE, stats=stats, cache_salt=salt)))
        return stats

    def hits() -> int:
        return P.prefix_cache_status()["hit_tokens"]

    assert pair(A).have_pages == 0
    before = hits()
    again = pair(A)
    assert again.have_pages == len(ids) // D.geometry.page_tokens and again.pages == pages - again.have_pages
    assert hits() > before  # P computed only past its cached prefix
    before = hits()
    other = pair(B)  # the attack on a pair: D holds nothing for B, P sends every page and computed them all
    assert other.have_pages == 0 and other.pages == pages and hits() == before


@pytest.fixture(scope="module")
def agent(smol_dir, tmp_path_factory):
    """One torch agent of the embedded model with its default prefix cache (the node under attack)."""
    from ..agents import AgentProcess

    with AgentProcess("torch", smol_dir, tmp_path_factory.mktemp("salt-agent"), prefix_cache="default") as agent:
        yield agent


def test_through_the_panel_a_key_finds_nothing_another_key_cached(agent, tmp_path):
    """The attack as an API client makes it: key A's prompt is cached on the node (A's second
    request reports it cached), key B's same prompt reports 0 cached tokens and the agent's cache
    served it nothing (so no shorter prefill either); B's own repeat is cached."""
    import openai

    from control_panel.cli import issue_credentials

    from ..agents import PanelProcess, settle

    _, key_b = issue_credentials(tmp_path / "panel", "b")  # the panel's data dir in its TANDEM_HOME
    with PanelProcess(tmp_path, "--node", agent.url) as panel:
        model = f"node/{agent.status()['name']}"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which is rule 3?"}]

        def cached(key: str) -> tuple[int, int]:
            """A chat of `key`'s: the cached tokens its answer reports, and those the agent's cache served."""
            before = agent.status()["prefix_cache"]["hit_tokens"]
            client = openai.OpenAI(base_url=panel.url + "/v1", api_key=key, max_retries=0)
            answer = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
            settle(agent)
            served = agent.status()["prefix_cache"]["hit_tokens"] - before
            return answer.usage.prompt_tokens_details.cached_tokens, served

        assert cached(panel.api_key) == (0, 0)
        a_again, served = cached(panel.api_key)
        assert a_again >= 4 * 64 and served == a_again  # A's prompt is cached on the node
        assert cached(key_b) == (0, 0)  # the attack: B learns nothing of A's prompt
        b_again, _ = cached(key_b)
        assert b_again == a_again  # B's own pages serve B as A's serve A


def test_a_decoder_and_its_prefiller_serve_a_prompt_only_under_its_salt(agent):
    """The agents' P/D path: POST /v1/decode with a salt on an agent that prefills for itself
    (prefill_url: its own), so the decoder's delta handoff and the prefiller's cache both look up
    the prompt under the salt the panel sent, which the decoder passes on to its prefiller."""
    from tandem_protocol.client import AgentClient

    from ..agents import TEST_KEY, settle

    async def decode(ids: list[int], salt: str) -> dict:
        client = AgentClient(agent.url, TEST_KEY)
        body = {"token_ids": ids, "sampling": {"max_tokens": 1}, "prefill_url": agent.url, "cache_salt": salt}
        try:
            lines = [line async for line in client.lines("/v1/decode", body)]
        finally:
            await client.aclose()
        settle(agent)
        assert lines[-1].get("done"), lines[-1]
        return lines[-1]

    async def tokenize() -> list[int]:
        client = AgentClient(agent.url, TEST_KEY)
        try:
            answer = await client.tokenize(messages=[{"role": "system", "content": SYSTEM + " Be brief."}])
        finally:
            await client.aclose()
        return answer.token_ids

    ids = run(tokenize())
    first = run(decode(ids, A))
    assert (first["have_pages"], first["prefill_cached_tokens"]) == (0, 0)
    again = run(decode(ids, A))
    assert again["have_pages"] == len(ids) // 64 and again["prefill_cached_tokens"] > 0  # A's own, on both sides
    other = run(decode(ids, B))  # the attack: neither side serves B anything of A's
    assert (other["have_pages"], other["prefill_cached_tokens"], other["cached_tokens"]) == (0, 0, 0)
