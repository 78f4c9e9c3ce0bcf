"""An answer that may call tools, as it streams: its text goes out as content until it may be a
call, which is held back and read at the end (tandem_protocol/tools.py says what a call looks
like). A forced call's answer is the calls alone.

A call that repeats an earlier one of the same answer (same function, same arguments) ends the
answer there (`repeated`): a small model, once it has made a call, tends to make it again and
again until max_tokens, and the same call twice in one turn gives its caller nothing new."""

from __future__ import annotations

import json

from tandem_protocol.tools import CLOSE, OPEN, ArrayItems, ToolCall, call_key, forced_calls, parse_calls


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (to hold back)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


class ToolCallText:
    def __init__(self, tools: list[dict], choice: str | dict | None, forced: bool):
        self.tools, self.choice, self.forced = tools, choice, forced
        self.held, self.holding, self.sent_any = "", forced, False
        self.repeated = False  # the answer made a call twice: it ends before the second
        # how far the held text has been checked for a repeat (each part of it once: a check of
        # it all at each token cost O(n^2) in its length, O(n^3) with n calls)
        self.keys: set[tuple[str, str]] = set()  # the calls made so far
        self.checked = self.searched = 0  # the end of the last call checked; where a CLOSE may begin
        self.items, self.kept = ArrayItems(), []  # a forced answer's items, those kept

    def feed(self, text: str) -> str:
        """The content that can go out now."""
        if self.repeated:
            return ""
        self.held += text
        if self.holding:
            self._cut_a_repeat(text)
            return ""
        start = self.held.lstrip()
        if not self.sent_any and start and start[0] == "{":  # Llama 3's call is the whole answer, as JSON
            self.holding = True
            return ""
        at = self.held.find(OPEN)
        if at >= 0:
            out, self.held, self.holding = self.held[:at], self.held[at:], True
            self._cut_a_repeat(self.held)
        else:  # keep back what could be the start of a call's opening tag
            cut = len(self.held) - partial_tag(self.held, OPEN)
            out, self.held = self.held[:cut], self.held[cut:]
        self.sent_any = self.sent_any or bool(out.strip())
        return out

    def _cut_a_repeat(self, text: str) -> None:
        """Keep the held text up to the call that repeats an earlier one, if one just ended."""
        if self.forced and isinstance(self.choice, dict):  # one arguments object: nothing to repeat
            return
        if ("}" if self.forced else ">") not in text:
            return
        if self.forced:
            for item in self.items.new(self.held):
                call = json.loads(item)
                key = call_key(ToolCall(call["name"], json.dumps(call["parameters"])))
                if key in self.keys:
                    self.held, self.repeated = "[" + ",".join(self.kept) + "]", True
                    return
                self.keys.add(key)
                self.kept.append(item)
            return
        while (close := self.held.find(CLOSE, self.searched)) >= 0:
            end = close + len(CLOSE)
            _, calls = parse_calls(self.held[self.checked : end], self.tools)
            if calls and call_key(calls[-1]) in self.keys:
                self.held, self.repeated = self.held[: self.checked], True
                return
            self.keys.update(map(call_key, calls))
            self.checked = self.searched = end
        self.searched = max(self.checked, len(self.held) - len(CLOSE) + 1)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content still held, and the calls read from it."""
        held, self.held = self.held, ""
        if self.forced:
            try:
                calls = forced_calls(held, self.tools, self.choice)
            except (ValueError, KeyError, TypeError):  # cut short (max_tokens): not a whole call
                calls = []
            return ("", calls) if calls else (held, [])
        return parse_calls(held, self.tools)
