"""Structured outputs: the grammar a request's output must follow, as llguidance compiles it.

Why llguidance (not xgrammar): its wheels are abi3 for Linux x86-64 and aarch64, macOS arm64 and
Windows, with no dependency (xgrammar needs torch, which a Mac running MLX does not have); it
fills a token bitmask straight into a numpy array, which is what the in-process engines sample
from; and vLLM (its `guidance` backend) and SGLang (`--grammar-backend llguidance`) run the same
library, so on a P/D route the prefiller's first token and the decoder's later ones follow one
grammar, token for token. JSON is compact (no free whitespace between tokens, as OpenAI's
structured outputs): a small model given flexible whitespace can spend its whole max_tokens on
newlines. vLLM and SGLang are started with the same setting.
"""

from __future__ import annotations

import json

import llguidance

JSON_OPTIONS = {"whitespace_flexible": False}
ANY_JSON_OBJECT = json.dumps({"type": "object"})  # OpenAI's `json_object`


def json_schema_grammar(schema: str) -> str:
    """llguidance's grammar for output that is one JSON value valid against `schema` (JSON text)."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def json_schema_problem(schema: str) -> str | None:
    """Why `schema` cannot constrain an output (llguidance's message), or None if it can."""
    try:
        if not isinstance(json.loads(schema), dict):
            return "a JSON schema must be an object"
        return llguidance.LLMatcher.validate_grammar(json_schema_grammar(schema)) or None
    except ValueError as e:
        return str(e)
