"""Tool calling: how tools reach a model, what holds a forced call to its schema, and how calls are
read back out of the text.

- **Rendering.** A chat template that knows tools (its source mentions `tools`: Qwen, Llama 3.1+,
  Hermes, Mistral) renders them itself, with earlier calls as dicts. A template that does not
  (the embedded SmolLM2's) gets Tandem's own system prompt (`TOOL_PROMPT`, below: the tools as
  JSON and the Hermes `<tool_call>` format), earlier calls as `<tool_call>` blocks in the
  assistant's text and results as `<tool_response>` blocks in a user turn.
- **Forced calls.** `tool_choice` "required" or a named function constrains the output with a JSON
  schema (as vLLM does): "required" → a JSON array of {"name", "parameters"} objects, one of the
  tools each (exactly one unless `parallel_tool_calls`); a named function → its arguments object;
  objects that list their properties are closed to others (`closed`).
  So a forced call is always valid JSON matching the tool's schema, even from a tiny model.
- **Reading calls** (`tool_choice` "auto"): Hermes/Qwen `<tool_call>{"name", "arguments"}</tool_call>`
  blocks anywhere in the answer (one left open at the end counts), or an answer that is, as a
  whole, Llama 3's JSON call `{"name", "parameters"}` (after an optional `<|python_tag|>`). A block
  that is not JSON or names no offered tool stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_PROMPT = """You can call functions to help answer. They are described here as JSON schemas:
<tools>
{tools}
</tools>
To call a function, answer with one block per call and nothing else:
<tool_call>
{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}
</tool_call>
A function's result comes back in a <tool_response> block."""

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# (No `\s*` around the body: beside a lazy `.*?` it rescans a run of whitespace from each of its
# characters, quadratic in it; json.loads takes the whitespace as it is.)
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = ""

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call(name: str, arguments: object) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, text, "call_" + uuid.uuid4().hex[:24])


def functions(tools: list[dict]) -> dict[str, dict]:
    """name -> the function's definition ({"name", "description", "parameters"})."""
    return {t["function"]["name"]: t["function"] for t in tools}


def parameters(function: dict) -> dict:
    """A function's arguments schema; none given: any JSON object."""
    return function.get("parameters") or {"type": "object"}


def closed(schema: object) -> object:
    """`schema` with every object that lists its properties closed to others, unless it says
    otherwise (`additionalProperties`), as OpenAI's strict mode requires and vLLM's
    `disable_additional_properties` does: a forced call then holds the declared arguments only
    (left open, a small model invents property after property until max_tokens)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: closed(v) if k in ("items", "anyOf", "oneOf", "allOf", "$defs", "definitions") else v
        for k, v in schema.items()
    }
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {name: closed(s) for name, s in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    if isinstance(out.get("$defs"), dict):
        out["$defs"] = {name: closed(s) for name, s in schema["$defs"].items()}
    if isinstance(out.get("definitions"), dict):
        out["definitions"] = {name: closed(s) for name, s in schema["definitions"].items()}
    return out


def forced_schema(tools: list[dict], choice: str | dict, parallel: bool) -> dict:
    """The JSON schema a forced call's output follows: for "required", an array of calls of the
    offered tools (one unless `parallel`); for {"function": {"name"}}, that function's arguments."""
    fns = functions(tools)
    if isinstance(choice, dict):
        return closed(parameters(fns[choice["function"]["name"]]))
    one_of = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": closed(parameters(fn))},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, fn in fns.items()
    ]
    items = one_of[0] if len(one_of) == 1 else {"anyOf": one_of}
    return {"type": "array", "items": items, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def forced_calls(text: str, tools: list[dict], choice: str | dict) -> list[ToolCall]:
    """The calls in a forced call's output (JSON that followed `forced_schema`). An array cut short
    (max_tokens) gives the calls it finished."""
    if isinstance(choice, dict):
        return [new_call(choice["function"]["name"], json.loads(text))]
    return [new_call(call["name"], call["parameters"]) for call in map(json.loads, array_items(text))]


def array_items(text: str) -> list[str]:
    """The whole object items at the start of a JSON array's text, which may be cut anywhere."""
    return ArrayItems().new(text)


class ArrayItems:
    """`array_items` of a text that grows, each character read once: `new(text)` gives the items
    that ended since the last call (a forced call's answer is checked at each token)."""

    def __init__(self):
        self.read, self.depth, self.start, self.in_string, self.escaped = 0, 0, 0, False, False
        self.ended = False

    def new(self, text: str) -> list[str]:
        items = []
        for i in range(self.read, len(text)):
            if self.ended:
                break
            ch = text[i]
            self.read = i + 1
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                self.start = i if self.depth == 2 else self.start
            elif ch in "]}":
                if self.depth == 2:
                    items.append(text[self.start : i + 1])
                self.depth -= 1
                self.ended = self.depth == 0
        return items


def call_key(call: ToolCall) -> tuple[str, str]:
    """What makes two calls the same call: the function and its arguments, as values."""
    return call.name, json.dumps(_loads(call.arguments), sort_keys=True)


def parse_calls(text: str, tools: list[dict]) -> tuple[str, list[ToolCall]]:
    """The text without its tool calls, and the calls (`tool_choice` "auto")."""
    names = set(functions(tools))
    calls, kept, last = [], [], 0
    for match in _BLOCK.finditer(text) if OPEN in text else ():
        call = _call(match.group(1), names, "arguments")
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last : match.start()])
        last = match.end()
    if calls:
        kept.append(text[last:])
        return "".join(kept).strip(), calls
    whole = text.strip().removeprefix("<|python_tag|>").strip()
    call = _call(whole, names, "parameters") or _call(whole, names, "arguments")
    return ("", [call]) if call is not None else (text, [])


def _call(block: str, names: set[str], key: str) -> ToolCall | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names or not isinstance(value.get(key), dict):
        return None
    return new_call(value["name"], value[key])


def render_messages(messages: list[dict], tools: list[dict] | None, template_knows_tools: bool) -> list[dict]:
    """The messages as the chat template is given them (see the module docstring)."""
    if template_knows_tools:
        return [_arguments_as_dicts(m) for m in messages]
    out = []
    for m in messages:
        if m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = [
                f"{OPEN}\n"
                + json.dumps({"name": c["function"]["name"], "arguments": _loads(c["function"].get("arguments"))})
                + f"\n{CLOSE}"
                for c in m["tool_calls"]
            ]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content"), *blocks]))})
        else:
            out.append(m)
    if tools:
        prompt = TOOL_PROMPT.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".strip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments_as_dicts(message: dict) -> dict:
    """Templates that render calls (Qwen, Llama) take `arguments` as a dict; OpenAI clients send
    JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = [
        {**c, "function": {**c["function"], "arguments": _loads(c["function"].get("arguments"))}}
        for c in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def _loads(arguments: object) -> object:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
