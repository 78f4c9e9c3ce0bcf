"""What exporting pages costs a CUDA prefill, in process (no agents, no network).

    python bench/gpu_prefill_export.py --model DIR [--lengths 744,2844,8160] [--reps 5]

For each prompt length, interleaved repetitions of four runs of the torch adapter on CUDA:
- alone, waiting per chunk: the prompt computed chunk by chunk, each chunk's logits read back
  (a device sync per chunk: how local generation and P used to run);
- alone: the same without reading back any logits but the last (how they run now);
- export, waiting per chunk: prefill with its KV copied to pageable host memory after every
  chunk, the host waiting for each copy before queueing the next chunk, then cut into pages
  on the host (how P used to run);
- export: whole pages laid out on the device, copied into pinned host memory on the device's
  stream and collected one chunk later, so the device always has the next chunk queued and
  no page is copied again on the host (`EngineAdapter.export_start`).
Prints median milliseconds and each export run's ratio to "alone" (the bound's prefill term).
Also counts the device syncs the export run makes (`torch.cuda.set_sync_debug_mode`).
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
from engine_adapters.base import EngineAdapter, EngineRequest  # noqa: E402
from engine_adapters.pages import KVPage  # noqa: E402
from engine_adapters.sampling import SamplingParams  # noqa: E402


def waiting_per_chunk(adapter) -> None:
    """Make the adapter behave as before asynchronous export (instance attributes only)."""
    adapter.forward_chunk = lambda session, ids: adapter.forward(session, ids)
    adapter.export_start = lambda session, start, end: (start, adapter.export_kv(session, start, end))
    adapter.export_finish = lambda handle: EngineAdapter.export_finish(adapter, handle)
    adapter.export_lag = 0


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
    ap.add_argument("--device", default="cuda", help="cpu checks the script itself (no device syncs to count)")
    args = ap.parse_args()
    new = load_adapter("torch", args.model, device=args.device)
    old = load_adapter("torch", args.model, device=args.device)
    waiting_per_chunk(old)
    assert type(new).forward_chunk is not EngineAdapter.forward_chunk
    vocab = new.info.vocab_size
    runs = {"alone, waiting per chunk": (old, alone), "alone": (new, alone),
            "export, waiting per chunk": (old, export), "export": (new, export)}
    print(f"{new.accelerator()['name']}, torch {torch.__version__}, {args.model.name}, {args.reps} reps, medians in ms")
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = [int(x) for x in np.random.default_rng(n).integers(100, vocab - 100, size=n)]
        times: dict[str, list[float]] = {k: [] for k in runs}
        for rep in range(args.reps + 1):  # the first round warms up
            for name, (adapter, fn) in runs.items():
                t = asyncio.run(fn(adapter, ids))
                if rep:
                    times[name].append(t)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if new.cuda:
                torch.cuda.set_sync_debug_mode("warn")
            asyncio.run(export(new, ids))
            if new.cuda:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        line = "  ".join(f"{k} {v:7.1f}" for k, v in med.items())
        print(f"{n:5d} tokens: {line}")
        print(f"      export ÷ alone {med['export'] / med['alone']:.2f} (was {med['export, waiting per chunk'] / med['alone, waiting per chunk']:.2f} "
              f"waiting per chunk); export now ÷ before {med['export'] / med['export, waiting per chunk']:.2f}; "
              f"device syncs in one export run: {syncs} ({len(new.prefill_chunks(n))} chunks)")
    new.close()
    old.close()


if __name__ == "__main__":
    main()
