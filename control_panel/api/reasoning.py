"""An answer's reasoning, kept out of its content as it streams (tandem_protocol/reasoning.py):
text inside the reasoning block goes to `reasoning_content`, the rest to `content`."""

from __future__ import annotations

from tandem_protocol.reasoning import CLOSE, OPEN

from .tool_calls import partial_tag


class ReasoningText:
    def __init__(self, open_in_prompt: bool):
        self.inside = open_in_prompt  # the template opened the block: the answer begins in it
        self.started = open_in_prompt  # the block was opened (a model may open it only at the start)
        self.held = ""
        self.space: list[str] = []  # whitespace before anything else (held apart: no rescan of it at each token)
        self.closed = False  # the block just closed: the newlines templates put after it are not content

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that can go out now."""
        if not self.started and not self.held and text.isspace():  # no telling yet what it comes before
            self.space.append(text)
            return "", ""
        if self.space:
            text, self.space = "".join(self.space) + text, []
        self.held += text
        reasoning = content = ""
        while True:
            if not self.started:
                start = self.held.lstrip()
                if OPEN.startswith(start) and len(start) < len(OPEN):
                    return reasoning, content  # may still become the opening tag
                self.started = True
                if start.startswith(OPEN):
                    self.inside, self.held = True, start[len(OPEN) :]
                continue
            if not self.inside:
                if self.closed:
                    self.held = self.held.lstrip("\n")
                    self.closed = not self.held
                content += self.held
                self.held = ""
                return reasoning, content
            at = self.held.find(CLOSE)
            if at < 0:  # hold back what could be the start of the closing tag
                cut = len(self.held) - partial_tag(self.held, CLOSE)
                reasoning, self.held = reasoning + self.held[:cut], self.held[cut:]
                return reasoning, content
            reasoning += self.held[:at]
            self.held, self.inside, self.closed = self.held[at + len(CLOSE) :], False, True

    def finish(self) -> tuple[str, str]:
        held, self.held, self.space = "".join(self.space) + self.held, "", []
        return (held, "") if self.inside else ("", held)
