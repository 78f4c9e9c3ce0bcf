"""What the router knows of each node's prefix cache: the page hashes of the sequences it sent
there (prompts to a prefiller; prompts and answers to a decoder), newest kept, per node.

It is the router's belief, not the node's word: a node that evicted pages (its cache is smaller
than the index, or other clients use it) is still believed to hold them, which only costs a
worse choice; the node's done line says what its cache really served (`cached_tokens`), and that
is what the request log records. Hashes chain over token ids (tandem_protocol/prefix.py), so a
page is held only with every page before it, and from the request's cache salt as the nodes'
caches do: one API key's prompts are never believed held for another's (its route, and so its
time to first token, would tell of them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tandem_protocol.pages import PAGE_TOKENS
from tandem_protocol.prefix import page_hashes

# Per node: 32,768 pages are 2M tokens, more than a desk machine's prefix cache holds of a small
# model; about 3 MB of hashes per node.
PAGES_PER_NODE = 32_768


def hashes_of(token_ids: Sequence[int], salt: str | None = None) -> list[bytes]:
    """The hashes of the full pages of a token sequence sent with the cache salt `salt` (one index
    per panel, nodes of one pool share a contract, so no contract seeds the chain here: a node that
    switches model is forgotten)."""
    return page_hashes(b"", token_ids, PAGE_TOKENS, salt=salt)


class PrefixIndex:
    def __init__(self, pages_per_node: int = PAGES_PER_NODE):
        self.pages_per_node = pages_per_node
        self._nodes: dict[str, OrderedDict[bytes, None]] = {}

    def held_pages(self, url: str, hashes: Sequence[bytes]) -> int:
        """How many leading pages of the sequence the node at `url` holds, as far as is known."""
        pages = self._nodes.get(url)
        if not pages:
            return 0
        n = 0
        while n < len(hashes) and hashes[n] in pages:
            n += 1
        return n

    def add(self, url: str, hashes: Sequence[bytes]) -> None:
        """The node now holds these pages (most recently used: the first page last, as a node's
        cache evicts a chain from its tail)."""
        pages = self._nodes.setdefault(url, OrderedDict())
        for h in reversed(hashes):
            pages[h] = None
            pages.move_to_end(h)
        while len(pages) > self.pages_per_node:
            pages.popitem(last=False)

    def forget(self, url: str) -> None:
        """The node restarted, switched engine or model, or left: it holds nothing we know of."""
        self._nodes.pop(url, None)
