"""The chat template switches a request may set (`chat_template_kwargs`), checked by the panel
before any agent is asked anything and again by the agent before it renders a template.

`apply_chat_template` takes its keyword arguments as the template's variables and some as its own
parameters, among them `chat_template`: a template of the caller's choosing, which Jinja's
sandbox renders without any bound on time or memory (vLLM GHSA-6fvq-23cw-5628, fixed by
vllm-project/vllm#25794, which refuses `chat_template` and `tokenize` and drops what the
template does not use). Tandem passes on only the switches known templates read, each a scalar:
no key can name a template, a parameter of `apply_chat_template` or a list for the template to
loop over.
"""

from __future__ import annotations

# The switches, and the templates that read them.
TEMPLATE_SWITCHES = frozenset(
    {
        "enable_thinking",  # Qwen3, SmolLM3, GLM-4.5, EXAONE 4: thinking on or off
        "thinking",  # DeepSeek-V3.1, Granite 3.2+: the same switch under another name
        "reasoning_effort",  # gpt-oss (its harmony template): "low", "medium" or "high"
        "tools_in_user_message",  # Llama 3.1-3.3: tools in the first user message or the system one
        "date_string",  # Llama 3.1-3.3: the date its system message states
    }
)
MAX_SWITCH_TEXT = 256  # characters of a string switch: a date or a level, never a document
_JSON_TYPES = {dict: "object", list: "array", type(None): "null", str: "string"}


class TemplateSwitchError(ValueError):
    """A `chat_template_kwargs` entry Tandem does not pass on; `key` names it."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def check_template_switches(kwargs: dict | None) -> None:
    """Raise TemplateSwitchError, naming the first offending key, unless every key of `kwargs` is
    one of TEMPLATE_SWITCHES and every value a bool, a number or a string of at most
    MAX_SWITCH_TEXT characters."""
    for key, value in (kwargs or {}).items():
        name = key if len(key) <= 64 else key[:64] + "…"  # the message names it, not a megabyte of it
        if key not in TEMPLATE_SWITCHES:
            raise TemplateSwitchError(
                key,
                f"`chat_template_kwargs.{name}` is not a template switch Tandem passes on "
                f"(it takes {', '.join(sorted(TEMPLATE_SWITCHES))})",
            )
        if not isinstance(value, bool | int | float | str) or (isinstance(value, str) and len(value) > MAX_SWITCH_TEXT):
            raise TemplateSwitchError(
                key,
                f"`chat_template_kwargs.{name}` must be a boolean, a number or a string of at most "
                f"{MAX_SWITCH_TEXT} characters (got {_JSON_TYPES.get(type(value), type(value).__name__)}"
                + (f" of {len(value)} characters)" if isinstance(value, str) else ")"),
            )
