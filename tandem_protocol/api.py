"""The node agent API's request and response models: the agent's routes take them, and the
panel and the agent client send them. The exchange they carry is drawn once, in ARCHITECTURE.md
("One request")."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .handoff import FirstTokenMode
from .pages import PROTOCOL_VERSION
from .sampling import SamplingParams
from .template_switches import check_template_switches

PageEncoding = Literal["raw", "zstd", "fp8", "int8"]
_URL = r"^https?://[^\s/]+(/.*)?$"
_FINGERPRINT = r"^[0-9a-f]{64}$"
# A cache salt (tandem_protocol/prefix.py) is opaque to the agent; hex or base64url, at most 128
# characters: what vLLM's `cache_salt` takes too.
_CACHE_SALT = r"^[A-Za-z0-9_-]{1,128}$"
_CACHE_SALT_HELP = (
    "the prefix cache's namespace for this request: only requests with the same salt share cached KV "
    "(absent: the unsalted one); the panel gives each API key its own unless its admin shares the cache"
)

# The key in a decoder's error object (an answer before the stream, or the stream's error line)
# that says the prefiller's side failed before any token left: P unreachable, P failed, the page
# stream broke or arrived damaged. D has released what it imported, so a panel may serve the
# request on D alone (a pair's "decode_alone" fallback).
PREFILLER_FAILED = "prefiller_failed"

# How long an agent may take over one POST /v1/tokenize (a chat template's render and the
# encoding, with its wait for the tokenizer thread) before it fails the request with a 400
# (EngineAdapter.on_tokenizer); its client waits a little longer for that answer. An 8 MiB prompt
# (the agent's body limit) took 8 s to encode on a 2-core machine (4 MiB: 3.5-5 s, SmolLM2's
# tokenizer); 60 s leaves that room on a busy one.
TOKENIZE_SECONDS = 60.0


def _check_pin(url: str | None, fingerprint: str | None, field: str) -> None:
    """A certificate is pinned for an HTTPS URL only: with plain HTTP there is none to check."""
    if fingerprint and not (url or "").startswith("https://"):
        raise ValueError(f"{field} pins a TLS certificate: the URL it is for must be https://")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field this agent does not know is refused, never dropped


class GenerateBody(_Body):
    """POST /v1/generate: this engine alone, prefill and decode."""

    token_ids: list[int]
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    request_id: str | None = None
    cache_salt: str | None = Field(None, description=_CACHE_SALT_HELP, pattern=_CACHE_SALT)


class DecodeBody(GenerateBody):
    """POST /v1/decode: the one request a panel sends a decoder for a P/D pair. The decoder checks
    it against its own limits, creates the handoff on the prefiller itself, pulls the pages and
    streams tokens. No `prefill_url`: this engine alone, as /v1/generate."""

    prefill_url: str | None = Field(None, description="base URL of the prefiller agent", pattern=_URL)
    prefill_fingerprint: str | None = Field(
        None, description="SHA-256 of the TLS certificate the prefiller must present (its pin)", pattern=_FINGERPRINT
    )
    page_encoding: PageEncoding = Field(
        "raw",
        description="how pages should travel: raw FP16, byte planes + zstd (lossless), or FP8 with per-block "
        "scales (lossy, half the bytes)",
    )
    mode: FirstTokenMode | None = Field(None, description="first-token mode; none: the decoder's preferred one")

    @model_validator(mode="after")
    def _pin_needs_https(self):
        _check_pin(self.prefill_url, self.prefill_fingerprint, "prefill_fingerprint")
        return self


class HandoffBody(_Body):
    """POST /v1/handoffs on a prefiller, sent by the decoder that will read the pages."""

    handoff_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    token_ids: list[int]
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    mode: FirstTokenMode = FirstTokenMode.COMMIT_FIRST
    contract: str = Field(description="the decoder's contract fingerprint; must equal this node's")
    protocol_version: int = PROTOCOL_VERSION
    wait_timeout: float = Field(30.0, ge=0, le=3600)
    page_encoding: PageEncoding = Field(
        "raw",
        description="how pages travel: raw FP16, byte planes + zstd (lossless) or FP8 (lossy); see /v1/info "
        "page_encodings",
    )
    have_pages: int = Field(
        0, ge=0, description="leading pages of the prompt's KV the decoder holds already: only later pages are sent"
    )
    cache_salt: str | None = Field(
        None,
        description="the decode request's cache salt: the prefiller's cache serves and keeps its pages under it",
        pattern=_CACHE_SALT,
    )


class HandoffCreated(BaseModel):
    handoff_id: str
    pages: int
    reserved_bytes: int
    read_token: str = Field(
        description="the one credential GET /v1/handoffs/{id}/pages takes (a bearer token): this handoff's "
        "pages alone, for the decoder that created it"
    )


class TokenizeBody(BaseModel):
    messages: list[dict] | None = None
    prompt: str | None = None
    tools: list[dict] | None = Field(
        None, description="OpenAI function tools the chat offers (tandem_protocol/tools.py)"
    )
    chat_template_kwargs: dict | None = Field(
        None,
        description="switches passed to the chat template (e.g. enable_thinking): only those of "
        "tandem_protocol/template_switches.py, with scalar values",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _switches_only(cls, value: dict | None) -> dict | None:
        check_template_switches(value)  # a ValueError naming the key: the agent's 400
        return value


class TokenizeAnswer(BaseModel):
    token_ids: list[int]
    reasoning: bool = Field(
        False, description="the chat template left a reasoning block open: the answer begins as reasoning"
    )


class ConfigBody(BaseModel):
    engine: str
    model_path: str
    context_length: int | None = Field(None, ge=1)
    staging_bytes: int | None = Field(None, ge=1 << 20)
    decode_kv_bytes: int | None = Field(None, ge=1 << 20, description="the decoder's KV budget")
    max_sequences: int | None = Field(None, ge=1, le=4096, description="requests the decoder runs at once")
    prefix_cache_bytes: int | None = Field(None, ge=0, description="the engine's prefix cache budget (0: none)")
    dry_run: bool = False


class BenchLinkBody(_Body):
    peer: str = Field(description="base URL of the agent to pull from (it shares this cluster key)", pattern=_URL)
    peer_fingerprint: str | None = Field(
        None, description="SHA-256 of the TLS certificate the peer must present (its pin)", pattern=_FINGERPRINT
    )
    megabytes: int = Field(64, ge=1, le=4096, description="how much to pull, in MB (10^6 bytes)")

    @model_validator(mode="after")
    def _pin_needs_https(self):
        _check_pin(self.peer, self.peer_fingerprint, "peer_fingerprint")
        return self
