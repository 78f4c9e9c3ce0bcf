"""The bridge's non-blocking item reader (engine_adapters/bridge.py): whatever the sizes in which
bytes come, it returns the pages and the first token whole and in order, and refuses a stream
that ends inside a frame."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_adapters import bridge
from tandem_protocol.errors import FrameError
from tandem_protocol.pages import PageGeometry, make_page

GEOMETRY = PageGeometry(layers=2, kv_heads=2, head_dim=4)


def page(i: int, tokens: int = 64):
    kv = np.full((2, 2, tokens, 2, 4), i + 0.5, np.float32)
    return make_page(GEOMETRY, i, kv)


def read_all(stream: bytes, cuts: list[int]) -> list:
    """Items of `stream` sent in pieces cut at `cuts`, read as an engine's step loop would."""
    a, b = socket.socketpair()
    reader = bridge.ItemReader(b)

    def send() -> None:
        with a:
            start = 0
            for end in [*sorted(cuts), len(stream)]:
                a.sendall(stream[start:end])
                start = end

    threading.Thread(target=send).start()
    items = []
    try:
        while not reader.ended:
            select.select([reader], [], [], 5)
            items += reader.read()
    finally:
        b.close()
    return items


STREAM = b"".join(bridge.page_frame(page(i, 64 if i < 2 else 5)) for i in range(3)) + bridge.first_token_frame(77)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_items_come_whole_and_in_order_whatever_the_pieces(cuts):
    items = read_all(STREAM, cuts)
    assert [x.index for x in items[:3]] == [0, 1, 2] and items[3] == 77
    assert items[2].valid_tokens == 5
    assert all(np.array_equal(x.kv, page(i, x.valid_tokens).kv) for i, x in enumerate(items[:3]))


@pytest.mark.parametrize("end", [2, 50, len(bridge.page_frame(page(0))) - 1])
def test_a_stream_ending_inside_a_frame_is_refused(end):
    with pytest.raises(FrameError, match="ended inside a frame"):
        read_all(bridge.page_frame(page(0))[:end], [])


def test_a_damaged_page_is_refused():
    frame = bytearray(bridge.page_frame(page(0)))
    frame[-1] ^= 1
    with pytest.raises(FrameError, match="checksum"):
        read_all(bytes(frame), [])


def loader(path, room: str, pages: int, ack: bool) -> tuple[list, float]:
    """An engine's import of `room`: what it read before the agent's end, and how long it waited."""
    conn = bridge.connect(str(path), "import", room, tokens=pages * 64)
    reader, items, start = bridge.ItemReader(conn), [], time.monotonic()
    with conn:
        while not reader.ended and time.monotonic() - start < 10:
            select.select([reader], [], [], 10)
            items += reader.read()
            if ack and len(items) == pages:
                conn.sendall(bridge.imported_frame(123.5))
                ack = False
    return items, time.monotonic() - start


def test_a_room_closed_early_ends_the_engines_load_at_once(tmp_path):
    """A decode that fails mid-stream closes its room: the engine must read the end at once (and
    free its blocks), not when the agent's wait for an acknowledgement runs out."""
    b = bridge.Bridge(tmp_path / "b.sock", "test")

    async def go():
        room = b.open("import", "r1", 3 * 64)
        room.outgoing.put(bridge.page_frame(page(0)))
        got = asyncio.get_running_loop().run_in_executor(None, loader, b.path, "r1", 3, True)
        await asyncio.sleep(0.2)
        b.close_room("r1")  # two pages never come
        return await got

    try:
        items, waited = asyncio.run(go())
    finally:
        b.close()
    assert [x.index for x in items] == [0]
    assert waited < 2, waited


def test_a_whole_room_is_acknowledged(tmp_path):
    b = bridge.Bridge(tmp_path / "b.sock", "test")

    async def go():
        room = b.open("import", "r2", 2 * 64)
        for i in range(2):
            room.outgoing.put(bridge.page_frame(page(i)))
        room.outgoing.put(bridge.END)
        items, _ = await asyncio.get_running_loop().run_in_executor(None, loader, b.path, "r2", 2, True)
        while room.imported_at is None:  # the agent's reader thread records it a moment later
            await asyncio.sleep(0.01)
        return items, room.imported_at

    try:
        items, at = asyncio.run(asyncio.wait_for(go(), 10))
    finally:
        b.close()
    assert [x.index for x in items] == [0, 1] and at == 123.5
