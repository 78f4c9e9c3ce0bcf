"""Errors that cross the adapter boundary. Each carries a message a user can act on."""

from __future__ import annotations


class TandemError(Exception):
    """Base class of every error Tandem raises on purpose."""


class UnsupportedModel(TandemError):
    """The model directory is not something Tandem can move KV for."""


class ContractMismatch(TandemError):
    """Prefiller and decoder do not agree on the model; `fields` names what differs."""

    def __init__(self, fields: list[str], detail: str = ""):
        self.fields = list(fields)
        message = "model contract mismatch in " + ", ".join(self.fields)
        super().__init__(f"{message}: {detail}" if detail else message)


class FrameError(TandemError):
    """A page frame or page stream is malformed, corrupted, truncated or out of order."""


class RequestError(TandemError):
    """The request cannot be served as asked (bad sampling values, too long, wrong mode)."""


class Cancelled(TandemError):
    """The request was cancelled; whatever it held has been released."""
