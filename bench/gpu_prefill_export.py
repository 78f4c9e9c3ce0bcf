"""What exporting pages costs a CUDA prefill, in process (no agents, no network), by chunk size.

    python bench/gpu_prefill_export.py --model DIR [--lengths 744,2844,8160] [--chunks 256,2048] [--reps 5]

For each prompt length and each prefill chunk size, interleaved repetitions of two runs of the
torch adapter on CUDA:
- alone: local generation's prefill (chunk by chunk, no logits read back but the last): the
  bound's prefill term;
- export: P's prefill: whole pages laid out on the device, copied into pinned host memory on the
  device's stream and collected one chunk later (`EngineAdapter.export_start`).
The engine's prefix cache is off (each length is one prompt, run again and again). Prints median
milliseconds, export ÷ alone for each chunk size, and how each chunk size's alone compares with the
first's: a small model on a big GPU is bound by the host queueing kernels, a
cost per chunk, not per token. Also counts the device syncs of an export run
(`torch.cuda.set_sync_debug_mode`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine_adapters import load_adapter  # noqa: E402
from engine_adapters.base import EngineRequest  # noqa: E402
from tandem_protocol.pages import KVPage  # noqa: E402
from tandem_protocol.sampling import SamplingParams  # noqa: E402


async def alone(adapter, ids: list[int]) -> float:
    t0 = time.perf_counter()
    async for _ in adapter.generate(EngineRequest(f"a{time.monotonic_ns()}", ids, SamplingParams(max_tokens=1))):
        pass
    return time.perf_counter() - t0


async def export(adapter, ids: list[int]) -> float:
    t0 = time.perf_counter()
    pages = 0
    async for item in adapter.prefill(EngineRequest(f"p{time.monotonic_ns()}", ids, SamplingParams(max_tokens=1))):
        pages += isinstance(item, KVPage)
    assert pages == -(-len(ids) // 64)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--lengths", default="744,2844,8160")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunks", default=None, help="prefill chunk sizes in tokens (default: the adapter's)")
    ap.add_argument("--device", default="cuda", help="cpu checks the script itself (no device syncs to count)")
    args = ap.parse_args()
    adapter = load_adapter("torch", args.model, device=args.device)
    # off, as the TTFT benchmark's agents have it: with it, every run after the first would
    # restore the prompt from host memory instead of computing it (it is one prompt a length)
    adapter.set_prefix_cache_bytes(0)
    chunks = [int(x) for x in (args.chunks or str(adapter.prefill_chunk_tokens)).split(",")]
    vocab = adapter.info.vocab_size
    print(
        f"{adapter.accelerator()['name']}, torch {torch.__version__}, {args.model.name}, {args.reps} reps, "
        f"medians in ms; the adapter's own chunk size: {adapter.prefill_chunk_tokens}"
    )
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = [int(x) for x in np.random.default_rng(n).integers(100, vocab - 100, size=n)]
        times: dict[tuple[int, str], list[float]] = {(c, k): [] for c in chunks for k in ("alone", "export")}
        for rep in range(args.reps + 1):  # the first round warms up
            for c, kind in times:
                adapter.prefill_chunk_tokens = c
                t = asyncio.run((alone if kind == "alone" else export)(adapter, ids))
                if rep:
                    times[c, kind].append(t)
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        for c in chunks:
            adapter.prefill_chunk_tokens = c
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if adapter.cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                asyncio.run(export(adapter, ids))
                if adapter.cuda:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchroniz" in str(w.message) for w in caught)
            print(
                f"{n:5d} tokens, chunks of {c:5d} ({len(adapter.prefill_chunks(n)):2d}): alone {med[c, 'alone']:7.1f}  "
                f"export {med[c, 'export']:7.1f}  export ÷ alone {med[c, 'export'] / med[c, 'alone']:.2f}  "
                f"alone ÷ alone at {chunks[0]}: {med[c, 'alone'] / med[chunks[0], 'alone']:.2f}  "
                f"device syncs in one export run: {syncs}"
            )
    adapter.close()


if __name__ == "__main__":
    main()
