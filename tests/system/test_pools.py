"""A model served by a pool of three real nodes: torch prefills, two MLX nodes decode.

Sixteen conversations at once spread over both decoders and each stays on its decoder; a short
new turn runs on its decoder alone, a long fresh prompt goes P/D (the pool's threshold); when one
decoder dies, its conversations' next turns move to the other and nothing fails.

The nodes serve the tiny random-weight Llama (`tiny_dir`, tests/conftest.py): routes follow the
pool's threshold in tokens and the decoders' caches, not the weights, and the one answer compared
is a decoder's against itself.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx

from ..agents import AgentProcess, PanelProcess, log_rows, settle, side_by_side

CONVERSATIONS = 16
THRESHOLD = 256
WORDS = "river stone lamp orchard violin harbor meadow lantern copper willow canyon ember".split()


def system_prompt(k: int) -> str:
    """A distinct system prompt of ~600 tokens (distinct from its first words, so no page is shared)."""
    words = [WORDS[(k * 7 + i * (k + 3)) % len(WORDS)] for i in range(520)]
    return f"Conversation {k}. You are assistant number {k}. Remember these words: " + " ".join(words)


def test_a_pool_of_three_spreads_conversations_keeps_them_and_survives_a_decoder(tiny_dir, tmp_path):
    import openai

    with (
        side_by_side(
            lambda: AgentProcess("torch", tiny_dir, tmp_path / "p", prefix_cache="default"),
            lambda: AgentProcess("mlx", tiny_dir, tmp_path / "d1", prefix_cache="default"),
            lambda: AgentProcess("mlx", tiny_dir, tmp_path / "d2", prefix_cache="default"),
        ) as (p, d1, d2),
        PanelProcess(tmp_path, "--pair", f"pool={p.url},{d1.url}+{d2.url},threshold={THRESHOLD}") as panel,
    ):
        client = openai.OpenAI(base_url=panel.url + "/v1", api_key=panel.api_key, max_retries=0, timeout=600)
        chats = [[{"role": "system", "content": system_prompt(k)}] for k in range(CONVERSATIONS)]

        def turn(question: str) -> list:
            """Every conversation's next turn, all at once: each one's request log row, in order."""

            def ask(messages: list[dict]) -> str:
                messages.append({"role": "user", "content": question})
                answer = client.chat.completions.create(model="pool", messages=messages, max_tokens=8, temperature=0)
                messages.append({"role": "assistant", "content": answer.choices[0].message.content})
                return answer.id

            with ThreadPoolExecutor(CONVERSATIONS) as threads:
                ids = list(threads.map(ask, chats))
            rows = {r.request_id: r for r in log_rows(tmp_path)}
            assert all(rows[i].outcome == "ok" for i in ids), [rows[i] for i in ids]
            return [rows[i] for i in ids]

        first = turn("Which word comes first?")
        # long fresh prompts go P/D, spread over both decoders
        assert all(r.route == "pd" and r.prefill_node == "torch-p" and r.prompt_tokens > 2 * THRESHOLD for r in first)
        homes = [r.decode_node for r in first]
        spread = {name: homes.count(name) for name in ("mlx-d1", "mlx-d2")}
        assert min(spread.values()) >= 6, spread  # 8 and 8 when measured
        # a short second turn runs on the decoder that holds the first, alone, from its cache
        second = turn("And the second?")
        assert [r.decode_node for r in second] == homes
        assert all(r.route == "decode_alone" and r.cached_tokens > THRESHOLD for r in second), second
        settle(p, d1, d2)

        d1.stop()  # one decoder dies: its conversations move to the other, nothing fails
        third = turn("And the third?")
        assert all(r.decode_node == "mlx-d2" for r in third), [r.decode_node for r in third]
        for home, row in zip(homes, third, strict=True):  # a moved history is long and fresh there: P/D
            assert row.route == ("pd" if home == "mlx-d1" else "decode_alone"), (home, row)
        settle(p, d2)

        # the Requests page names each request's nodes and the prompt tokens its cache served
        with httpx.Client(base_url=panel.url, timeout=60) as ui:
            csrf = re.search(r'name="csrf" value="([^"]+)"', ui.get("/login").text).group(1)
            assert ui.post("/login", data={"password": panel.admin_password, "csrf": csrf}).status_code == 303
            page = ui.get("/requests").text
        assert f"torch-p → {homes[0]}" in page and "torch-p → mlx-d2" in page
        cached = re.findall(r'<td class="num cached">(\d+)</td>', page)
        assert sorted(map(int, cached)) == sorted(r.cached_tokens for r in first + second + third)

        # the pool's answers are the decoder's own: a conversation that stayed on mlx-d2 again, on
        # mlx-d2 alone (MLX against itself, exact; a moved one's P/D answer would be torch's pages
        # against MLX's own, which on random weights may part at a near tie)
        k = homes.index("mlx-d2")
        alone = client.chat.completions.create(model="node/mlx-d2", messages=chats[k][:-1], max_tokens=8, temperature=0)
        assert alone.choices[0].message.content == chats[k][-1]["content"]
