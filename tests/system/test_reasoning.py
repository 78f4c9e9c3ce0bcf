"""A reasoning template keeps reasoning out of `content`, streaming and not, on a P/D pair of real
agents (torch → MLX).

The checkpoint is the embedded model with a thinking template in Qwen3's manner: the generation
prompt opens a `<think>` block unless `enable_thinking` is false, when it is opened and closed
empty. The embedded model never closes the block itself, so with thinking on its whole answer is
reasoning; `chat_template_kwargs={"enable_thinking": false}` (passed to the template) makes it
all content. The router's unit tests cover a block that closes mid-answer. Through /v1/responses the
reasoning is a reasoning item, its tokens counted as reasoning tokens."""

from __future__ import annotations

import shutil

import openai
import pytest

from ..agents import AgentProcess, PanelProcess, side_by_side

THINKING_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smol_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("reasoning")
    model = home / "smollm2-thinking"
    model.mkdir()
    for f in smol_dir.iterdir():
        if f.suffix == ".safetensors":
            (model / f.name).symlink_to(f)
        elif f.name != "chat_template.jinja":
            shutil.copy(f, model / f.name)
    (model / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    with side_by_side(
        lambda: AgentProcess("torch", model, home / "p"), lambda: AgentProcess("mlx", model, home / "d")
    ) as (p, d):
        with PanelProcess(home / "panel", "--pair", f"think={p.url},{d.url},threshold=1") as panel:
            yield openai.OpenAI(base_url=panel.url + "/v1", api_key=panel.api_key, max_retries=0)


def ask(client, stream: bool, **extra) -> tuple[str, str]:
    args = dict(model="think", messages=QUESTION, max_tokens=24, temperature=0, **extra)
    if not stream:
        message = client.chat.completions.create(**args).choices[0].message
        return message.content or "", getattr(message, "reasoning_content", None) or ""
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **args) if c.choices]
    return "".join(d.content or "" for d in deltas), "".join(
        getattr(d, "reasoning_content", None) or "" for d in deltas
    )


def test_reasoning_stays_out_of_content_streaming_or_not(client):
    content, reasoning = ask(client, False)
    assert content == "" and reasoning.strip(), (content, reasoning)
    assert ask(client, True) == (content, reasoning)
    off = ask(client, False, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off[1] == "" and off[0].strip(), off
    assert ask(client, True, extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == off
    print(f"\nthinking: {reasoning!r}\nnot thinking: {off[0]!r}")


def test_the_responses_api_returns_reasoning_as_a_reasoning_item(client):
    args = dict(model="think", input=QUESTION[0]["content"], max_output_tokens=24, temperature=0)
    whole = client.responses.create(**args)
    (item,) = whole.output
    assert item.type == "reasoning" and item.content[0].text.strip() and whole.output_text == ""
    usage = whole.usage  # every token is reasoning but a stop token, which has no text
    assert usage.output_tokens_details.reasoning_tokens == usage.output_tokens - (whole.status == "completed") > 0
    events = list(client.responses.create(stream=True, **args))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == item.content[0].text and events[-1].response.output[0].content[0].text == deltas
    assert not [e for e in events if e.type == "response.output_text.delta"]
    off = client.responses.create(**args, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [i.type for i in off.output] == ["message"] and off.output_text.strip()
    assert off.usage.output_tokens_details.reasoning_tokens == 0
