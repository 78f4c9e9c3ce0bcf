"""The canonical page codec: bit-exact round trips, and every kind of damage detected."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem_protocol.contract import token_digest
from tandem_protocol.errors import ContractMismatch, FrameError
from tandem_protocol.pages import (
    HEADER_SIZE,
    KV_DTYPE,
    PAGE_TOKENS,
    FrameExpectation,
    PageGeometry,
    decode_frame,
    frame_bytes,
    make_page,
    parse_header,
)

CONTRACT = bytes(range(16))
HANDOFF_ID = uuid.UUID(int=7).bytes
TOKENS = token_digest([1, 2, 3])


@st.composite
def pages(draw):
    geometry = PageGeometry(
        layers=draw(st.integers(1, 6)),
        kv_heads=draw(st.integers(1, 4)),
        head_dim=draw(st.sampled_from([1, 8, 16, 64, 80, 128])),
    )
    valid = draw(st.integers(1, PAGE_TOKENS))
    index = draw(st.integers(0, 2**32 - 1))
    shape = geometry.page_shape[:2] + (valid,) + geometry.page_shape[3:]
    seed = draw(st.integers(0, 2**32 - 1))
    # every FP16 bit pattern, NaNs, infinities and negative zero included
    bits = np.random.default_rng(seed).integers(0, 2**16, size=shape, dtype=np.uint16)
    return geometry, index, bits.view(KV_DTYPE)


def expectation(geometry: PageGeometry, **changes) -> FrameExpectation:
    fields = dict(contract=CONTRACT, handoff_id=HANDOFF_ID, tokens=TOKENS, geometry=geometry)
    fields.update(changes)
    return FrameExpectation(**fields)


@settings(max_examples=200, deadline=None)
@given(pages())
def test_round_trip_is_bit_exact(case):
    geometry, index, kv = case
    page = make_page(geometry, index, kv)
    frame = frame_bytes(page, contract=CONTRACT, handoff_id=HANDOFF_ID, tokens=TOKENS)
    assert len(frame) == HEADER_SIZE + geometry.page_bytes
    header, back = decode_frame(frame, expectation(geometry))
    assert (header.page_index, header.valid_tokens, header.geometry) == (index, kv.shape[2], geometry)
    assert back.index == index and back.valid_tokens == kv.shape[2]
    assert back.kv.view(np.uint16).tobytes() == kv.view(np.uint16).tobytes()
    # slots past the valid tokens are zero bytes
    assert not back.data[:, :, kv.shape[2] :].view(np.uint16).any()


@settings(max_examples=200, deadline=None)
@given(pages(), st.data())
def test_any_flipped_bit_is_detected(case, data):
    geometry, index, kv = case
    frame = bytearray(
        frame_bytes(make_page(geometry, index, kv), contract=CONTRACT, handoff_id=HANDOFF_ID, tokens=TOKENS)
    )
    position = data.draw(st.integers(0, len(frame) - 1))
    frame[position] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises((FrameError, ContractMismatch)):
        decode_frame(bytes(frame), expectation(geometry))


def test_layout_is_layers_kv_tokens_heads_dim_little_endian():
    g = PageGeometry(layers=2, kv_heads=3, head_dim=4)
    kv = np.arange(2 * 2 * 5 * 3 * 4, dtype=np.float32).reshape(2, 2, 5, 3, 4)
    page = make_page(g, 0, kv)
    payload = frame_bytes(page, contract=CONTRACT, handoff_id=HANDOFF_ID, tokens=TOKENS)[HEADER_SIZE:]
    flat = np.frombuffer(payload, dtype="<f2").reshape(2, 2, 64, 3, 4)
    # layer 1, V (index 1), token 4, head 2, dim 3
    assert flat[1, 1, 4, 2, 3] == kv[1, 1, 4, 2, 3]
    assert payload[:2] == np.float16(0).tobytes() and payload[2:4] == np.float16(1).astype("<f2").tobytes()


def test_wrong_contract_room_tokens_and_geometry_are_refused():
    g = PageGeometry(layers=2, kv_heads=1, head_dim=8)
    frame = frame_bytes(
        make_page(g, 0, np.ones((2, 2, 3, 1, 8))), contract=CONTRACT, handoff_id=HANDOFF_ID, tokens=TOKENS
    )
    with pytest.raises(ContractMismatch) as e:
        decode_frame(frame, expectation(g, contract=bytes(16)))
    assert e.value.fields == ["contract fingerprint"]
    with pytest.raises(ContractMismatch) as e:
        decode_frame(frame, expectation(g, tokens=token_digest([1, 2, 4])))
    assert e.value.fields == ["token_ids"]
    with pytest.raises(FrameError, match="belongs to handoff"):
        decode_frame(frame, expectation(g, handoff_id=uuid.uuid4().bytes))
    with pytest.raises(FrameError, match="geometry"):
        decode_frame(frame, expectation(PageGeometry(layers=1, kv_heads=2, head_dim=8)))


def test_truncated_and_foreign_frames_are_refused():
    g = PageGeometry(layers=1, kv_heads=1, head_dim=8)
    frame = frame_bytes(
        make_page(g, 3, np.ones((1, 2, 64, 1, 8))), contract=CONTRACT, handoff_id=HANDOFF_ID, tokens=TOKENS
    )
    with pytest.raises(FrameError, match="truncated frame header"):
        parse_header(frame[:40])
    with pytest.raises(FrameError, match="header says"):
        decode_frame(frame[:-1])
    with pytest.raises(FrameError, match="magic"):
        decode_frame(b"HTTP" + frame[4:])
    newer = bytearray(frame)
    newer[4] = 99
    with pytest.raises(FrameError, match="version 99"):
        decode_frame(bytes(newer))


def test_make_page_checks_shape_and_rounds_to_fp16():
    g = PageGeometry(layers=1, kv_heads=1, head_dim=2)
    with pytest.raises(ValueError):
        make_page(g, 0, np.zeros((1, 2, 65, 1, 2)))
    with pytest.raises(ValueError):
        make_page(g, 0, np.zeros((1, 2, 3, 2, 2)))
    page = make_page(g, 0, np.full((1, 2, 1, 1, 2), 1 / 3, dtype=np.float32))
    assert page.data.dtype == KV_DTYPE and page.kv[0, 0, 0, 0, 0] == np.float16(1 / 3)


def test_smollm2_page_is_1_47_mb():
    g = PageGeometry(layers=30, kv_heads=3, head_dim=64)
    assert g.token_bytes == 23_040 and g.page_bytes == 1_474_560 and g.pages_for(129) == 3


def test_compressed_frames_round_trip_exactly_and_fail_clearly():
    """Byte planes + zstd is lossless: the receiver gets the canonical FP16 bytes back, through
    the streaming reader in any chunking; a flipped bit fails the checksum, and a frame whose
    checksum is right but whose payload is not zstd fails with its own message."""
    from tandem_protocol.pages import _HEADER, HEADER_SIZE, ZSTD_PLANES, checksum_finish, encode_frame
    from tandem_protocol.wire import FrameReader

    g = PageGeometry(layers=2, kv_heads=3, head_dim=8)
    rng = np.random.default_rng(3)
    kv = rng.standard_normal((g.layers, 2, 40, g.kv_heads, g.head_dim)).astype("<f2")
    page = make_page(g, 0, kv)
    ids = dict(contract=b"c" * 16, handoff_id=b"r" * 16, tokens=b"t" * 16)
    header, payload = encode_frame(page, encoding=ZSTD_PLANES, **ids)
    frame = header + bytes(payload)
    _, back = decode_frame(frame)
    assert back.data.tobytes() == page.data.tobytes() and back.valid_tokens == 40
    for step in (1, 7, 100, len(frame)):
        reader = FrameReader(FrameExpectation(b"c" * 16, b"r" * 16, b"t" * 16, g))
        got = [item for i in range(0, len(frame), step) for item in reader.feed(frame[i : i + step])]
        assert got[0].data.tobytes() == page.data.tobytes()
    flipped = bytearray(frame)
    flipped[-5] ^= 1
    with pytest.raises(FrameError, match="checksum"):
        decode_frame(bytes(flipped))
    import xxhash

    junk = b"not zstd at all" * 10
    fields = list(_HEADER.unpack_from(header))
    fields[-2], fields[-1] = len(junk), 0
    unsigned = _HEADER.pack(*fields)
    fields[-1] = checksum_finish(xxhash.xxh3_64(junk), unsigned)
    with pytest.raises(FrameError, match="does not decompress"):
        decode_frame(_HEADER.pack(*fields) + junk)
    assert HEADER_SIZE == len(header)


def test_the_final_frame_carries_the_first_tokens_logprobs_and_a_malformed_one_is_a_frame_error():
    from tandem_protocol.handoff import PrefillDone
    from tandem_protocol.sampling import TokenLogprobs
    from tandem_protocol.wire import DONE_MAGIC, FrameReader, _json_frame, done_frame

    g = PageGeometry(layers=2, kv_heads=3, head_dim=8)

    def read(frame: bytes) -> list:
        return FrameReader(FrameExpectation(b"c" * 16, b"r" * 16, b"t" * 16, g)).feed(frame)

    done = PrefillDone(7, 40, 1, 0.5, cached_tokens=3, first_logprobs=TokenLogprobs(-0.5, ((7, -0.5), (9, -1.25))))
    assert read(done_frame(done)) == [done]
    plain = PrefillDone(7, 40, 1, 0.5)
    assert read(done_frame(plain)) == [plain]
    for bad in ({"first_token": 7}, {**vars(plain), "first_logprobs": [-0.5]}, {**vars(plain), "pages": "two"}):
        with pytest.raises(FrameError, match="malformed final frame"):
            read(_json_frame(DONE_MAGIC, {k: v for k, v in bad.items() if k != "first_logprobs" or v}))
