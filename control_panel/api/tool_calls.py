"""An answer that may call tools, as it streams: its text goes out as content until it may be a
call, which is held back and read at the end (tandem_protocol/tools.py says what a call looks
like). A forced call's answer is the calls alone."""

from __future__ import annotations

from tandem_protocol.tools import OPEN, ToolCall, forced_calls, parse_calls


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (to hold back)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


class ToolCallText:
    def __init__(self, tools: list[dict], choice: str | dict | None, forced: bool):
        self.tools, self.choice, self.forced = tools, choice, forced
        self.held, self.holding, self.sent_any = "", forced, False

    def feed(self, text: str) -> str:
        """The content that can go out now."""
        self.held += text
        if self.holding:
            return ""
        start = self.held.lstrip()
        if not self.sent_any and start and start[0] == "{":  # Llama 3's call is the whole answer, as JSON
            self.holding = True
            return ""
        at = self.held.find(OPEN)
        if at >= 0:
            out, self.held, self.holding = self.held[:at], self.held[at:], True
        else:  # keep back what could be the start of a call's opening tag
            cut = len(self.held) - partial_tag(self.held, OPEN)
            out, self.held = self.held[:cut], self.held[cut:]
        self.sent_any = self.sent_any or bool(out.strip())
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content still held, and the calls read from it."""
        held, self.held = self.held, ""
        if self.forced:
            try:
                return "", forced_calls(held, self.tools, self.choice)
            except (ValueError, KeyError, TypeError):  # cut short (max_tokens): not a whole call
                return held, []
        return parse_calls(held, self.tools)
