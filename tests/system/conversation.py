"""A three-turn conversation with long answers, for the prefix-cache tests (tests/system/
test_prefix_cache.py in process, test_prefix_cache_servers.py on vLLM and SGLang): each turn's
prompt carries the earlier answers, so a later turn can reuse the KV of what the engine decoded."""

from __future__ import annotations

from node_agent.inprocess import PairStats, run_pair
from tandem_protocol.sampling import SamplingParams

from ..conftest import collect, run

SYSTEM = " ".join(
    f"Rule {i}: answer briefly and say the number {i * 7} only when asked about rule {i}." for i in range(30)
)
# Questions with long answers: every answer crosses a page boundary, so a later turn can only
# reach the figures asserted below through the pages of what the engine decoded.
TURNS = [
    "Describe Paris in detail for a visitor.",
    "Now describe Berlin in the same way.",
    "Compare the two cities at length.",
]
ANSWER = SamplingParams(max_tokens=64)
GiB = 1 << 30


def common_pages(a: list[int], b: list[int], page_tokens: int) -> int:
    return len(common_prefix(a, b)) // page_tokens * page_tokens


def common_prefix(a: list[int], b: list[int]) -> list[int]:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]


def pair_conversation(
    prefiller, decoder, tag: str, replay: list[list[int]] | None = None, salt: str | None = None
) -> tuple[list[list[int]], list[list[int]], list[PairStats]]:
    """Each turn of the conversation through the pair: its prompt, its answer, its page figures.
    `replay`: the prompts of a conversation run before, sent again as they were. `salt`: each turn
    gets a cache salt of its own (f"{salt}-{k}"), so the engines' prefix caches serve it nothing,
    as with no cache."""
    messages, prompts, answers, stats = [{"role": "system", "content": SYSTEM}], [], [], []
    for k, turn in enumerate(TURNS):
        messages.append({"role": "user", "content": turn})
        ids = replay[k] if replay else decoder.chat_token_ids(messages)
        stats.append(PairStats())
        turn_salt = None if salt is None else f"{salt}-{k}"
        answers.append(run(collect(run_pair(prefiller, decoder, ids, ANSWER, stats=stats[-1], cache_salt=turn_salt))))
        prompts.append(ids)
        messages.append({"role": "assistant", "content": decoder.detokenize(answers[-1])})
    return prompts, answers, stats
