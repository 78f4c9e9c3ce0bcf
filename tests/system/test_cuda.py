"""The torch adapter on CUDA (FP16 compute): P/D on the GPU, and GPU pages decoded on the CPU.

Skipped where no CUDA device exists (CI); run on the team's GPU machine with
`TANDEM_TOKENIZER_DIR=<dir with tokenizer.json> pytest tests/system/test_cuda.py`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_adapters import load_adapter
from engine_adapters.base import EngineRequest
from node_agent.inprocess import run_pair
from tandem_protocol.handoff import FirstTokenMode
from tandem_protocol.sampling import SamplingParams

from ..conftest import collect, make_tiny_checkpoint, max_abs_diff, run
from ..integration.rules import first_step_logits

# a skip even in CI, which never has a GPU: these tests are run by hand on a lent GPU (README)
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CI has none: run by hand on a lent GPU)"
)

SAMPLING = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def gpu_and_cpu(tmp_path_factory):
    tokenizer_dir = os.environ.get("TANDEM_TOKENIZER_DIR")
    if not tokenizer_dir:
        from engine_adapters.embedded_model import fetch
        from tandem_protocol.settings import data_dir

        tokenizer_dir = fetch(data_dir())[0]
    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("cuda") / "m",
        "llama",
        Path(tokenizer_dir),
        seed=5,
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
    )
    gpu = load_adapter("torch", path, context_length=512)
    assert gpu.device.type == "cuda" and gpu.dtype == torch.float16
    cpu = load_adapter("torch", path, context_length=512, device="cpu")
    assert cpu.dtype == torch.float32
    yield gpu, cpu
    gpu.close()
    cpu.close()


def ids_of(n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(n).integers(20, 49000, size=n)]


@pytest.mark.parametrize("n", [1, 64, 65, 129, 300])
def test_gpu_pd_equals_gpu_local(gpu_and_cpu, n):
    gpu, _ = gpu_and_cpu
    local = run(collect(gpu.generate(EngineRequest("local", ids_of(n), SAMPLING))))
    for mode in FirstTokenMode:
        if mode is FirstTokenMode.RECOMPUTE_LAST and n == 1:
            continue
        assert run(collect(run_pair(gpu, gpu, ids_of(n), SAMPLING, mode))) == local, mode


@pytest.mark.parametrize("n", [65, 300])
def test_gpu_pages_decode_on_cpu(gpu_and_cpu, n):
    gpu, cpu = gpu_and_cpu
    imported, local = run(first_step_logits(gpu, cpu, ids_of(n)))
    diff = max_abs_diff(imported, local)
    print(
        f"\nCUDA FP16 -> CPU float32, {n} tokens: first-step logits max abs diff {diff:.4f} "
        f"(logit range {np.ptp(local):.2f})"
    )
    assert diff <= 0.02 * float(np.ptp(local))


def test_a_batched_decode_step_on_the_gpu_matches_each_request_alone(gpu_and_cpu):
    """Continuous batching on CUDA (engine_adapters/decode_batch.py): one forward over 8 requests
    of different lengths gives each row the logits its request computes alone, to FP16 rounding
    (batched GEMMs may pick other kernels than a single row's). Measured on an H200: 0.029 on a
    logit range of 31.2 (0.09 %); allowed: twice that share."""
    gpu, _ = gpu_and_cpu
    lengths = [5, 64, 65, 100, 129, 200, 257, 300]

    def prefilled():
        sessions = []
        for n in lengths:
            session = gpu.new_session(n + 4)
            gpu.forward(session, ids_of(n))
            sessions.append(session)
        return sessions

    tokens = [7 + i for i in range(len(lengths))]
    alone = np.stack([gpu._executor.submit(gpu.forward, s, [t]).result() for s, t in zip(prefilled(), tokens)])
    batched = gpu._executor.submit(gpu.forward_rows, gpu._executor.submit(prefilled).result(), tokens).result()
    diff = max_abs_diff(batched, alone)
    print(f"\nCUDA FP16, a batch of {len(lengths)}: logits max abs diff {diff:.5f} (range {np.ptp(alone):.2f})")
    assert diff <= 0.0019 * float(np.ptp(alone))
    assert (batched.argmax(axis=1) == alone.argmax(axis=1)).all()


def test_requests_at_once_on_the_gpu_get_their_own_greedy_answers(gpu_and_cpu):
    gpu, _ = gpu_and_cpu

    async def at_once():
        return await asyncio.gather(
            *[collect(gpu.generate(EngineRequest(f"b{n}", ids_of(n), SAMPLING))) for n in (3, 40, 70, 130)]
        )

    alone = [run(collect(gpu.generate(EngineRequest(f"a{n}", ids_of(n), SAMPLING)))) for n in (3, 40, 70, 130)]
    batched = run(at_once())
    same = [a == b for a, b in zip(alone, batched)]
    print(f"\nCUDA FP16, 4 requests at once: {sum(same)} of 4 equal alone; widest step {gpu.batch.widest}")
    assert gpu.batch.widest >= 2
    assert batched == alone  # 4 of 4 on an H200


@pytest.mark.parametrize("encoding", ["fp8", "int8"])
@pytest.mark.parametrize("n", [65, 300])
def test_lossy_pages_are_encoded_on_the_gpu_as_the_codec_would(gpu_and_cpu, n, encoding):
    """With a lossy `page_encoding` the CUDA prefill encodes each page on the device: the FP8 or
    INT8 payload it carries is byte for byte what the host's codec makes of the page's FP16 data."""
    from tandem_protocol.pages import ENCODINGS, LOSSY

    gpu, _ = gpu_and_cpu
    code = ENCODINGS[encoding]
    # a prompt no other test sent: pages from the prefix cache leave the host's way (no device code)
    ids = [int(x) for x in np.random.default_rng(1000 + n + code).integers(20, 49000, size=n)]
    req = EngineRequest(encoding, ids, SamplingParams(max_tokens=1), lossy_encoding=code)
    pages = [p for p in run(collect(gpu.prefill(req))) if hasattr(p, "coded")]
    assert len(pages) == -(-n // 64) and all(p.coded is not None and p.encoding == code for p in pages)
    for p in pages:
        assert p.coded.tobytes() == LOSSY[code].encode(p.data), f"page {p.index}"


@pytest.mark.parametrize("encoding", ["fp8", "int8"])
@pytest.mark.parametrize("n", [65, 300])
def test_lossy_pages_decoded_on_the_gpu_answer_as_the_hosts_codec(gpu_and_cpu, n, encoding):
    """A CUDA decoder imports FP8 and INT8 pages as they came and decodes them on the device
    (decodes_coded): the same tokens as pages the host's codec decoded to FP16 first."""
    from tandem_protocol.pages import ENCODINGS

    gpu, _ = gpu_and_cpu
    code = ENCODINGS[encoding]
    assert code in gpu.decodes_coded
    kept = gpu.decodes_coded

    def pair() -> list[int]:
        return run(collect(run_pair(gpu, gpu, ids_of(n), SAMPLING, FirstTokenMode.COMMIT_FIRST, encoding=code)))

    on_device = pair()
    gpu.decodes_coded = frozenset()
    try:
        on_host = pair()
    finally:
        gpu.decodes_coded = kept
    assert on_device == on_host


def test_cudas_float8_cast_is_the_codec_for_every_fp16_value_and_block_exponent():
    """What tests/unit/test_fp8.py checks of torch's CPU cast, on the device: the CUDA prefill's
    FP8 bytes are the codec's only if the device's cast rounds as the codec's table does."""
    from ..unit.test_fp8 import cast_mismatches

    bad = cast_mismatches("cuda")
    assert not bad, "\n".join(bad[:30])


@pytest.mark.parametrize("encoding", ["fp8", "int8"])
def test_the_device_encoder_makes_the_codecs_bytes_on_the_gpu(encoding):
    """`fp8_payloads` and `int8_payloads` on CUDA over pages spanning FP16's range (as
    tests/unit/test_lossy_device.py on the CPU), payload for payload against the host's codec;
    where they differ, what differs. Then the device decoders against the host's, on those payloads."""
    from engine_adapters.torch_adapter import DEVICE_CODECS
    from tandem_protocol.pages import ENCODINGS, LOSSY

    from ..unit.test_lossy_device import GEOMETRY, SHAPE, pages_like_kv

    code = ENCODINGS[encoding]
    (encode, _, decode), codec = DEVICE_CODECS[code], LOSSY[code]
    pages = pages_like_kv(np.random.default_rng(0), 4)
    rows = encode(torch.from_numpy(pages).cuda()).cpu().numpy()
    head = len(codec.encode(pages[0])) - pages[0].size  # bytes before the codes: exponents or scales
    for i, page in enumerate(pages):
        want = np.frombuffer(codec.encode(page), np.uint8)
        diff = np.flatnonzero(rows[i] != want)
        where = [
            f"byte {j} ({'exponent or scale' if j < head else 'code'}): {rows[i][j]:#04x} not {want[j]:#04x}"
            + ("" if j < head else f", value {page.reshape(-1)[j - head]!r}")
            for j in diff[:10]
        ]
        assert not len(diff), f"page {i}: {len(diff)} bytes differ\n" + "\n".join(where)
    decoded = decode(torch.from_numpy(rows).cuda(), GEOMETRY).cpu().numpy()
    for i in range(len(pages)):
        host = codec.decode(rows[i].tobytes(), SHAPE)
        assert decoded[i].view(np.uint16).tobytes() == host.view(np.uint16).tobytes(), f"page {i}"
