"""Would batching concurrent prompts' prefill chunks into one forward pay on the MLX engine?

Issue 19 asks for the prefill of concurrent requests batched "where mlx-lm allows it". This runs
the same prompt chunks (8 requests, chunks of 64-192 tokens, as a burst of 256-token prompts
makes) on the MLX adapter two ways, in the same run: one forward per chunk, as the engine does,
and one right-padded batched forward in which each row writes its own cache and attends to it
alone (as `forward_rows` does for decode steps). It prints the median time of each and their
ratio, and checks that the batched rows' logits and KV equal the single ones bit for bit.

    .venv/bin/python bench/bench_prefill_batch.py [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine_adapters import openblas  # noqa: E402

openblas.preload()  # before the first `import mlx`, as the adapter does

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from engine_adapters.embedded_model import fetch  # noqa: E402
from engine_adapters.mlx_adapter import MLXAdapter  # noqa: E402
from tandem_protocol.settings import data_dir  # noqa: E402

LENGTHS = [192, 192, 150, 192, 64, 192, 192, 192]


class ChunkRows:
    """Layer i of several sessions for one batched prefill forward: row r writes its first
    lengths[r] positions into its own cache (the rest is padding) and RoPE turns it at its offset."""

    def __init__(self, caches, lengths):
        self.caches, self.lengths = caches, lengths
        self.offset = mx.array([c.offset for c in caches])

    def update_and_fetch(self, keys, values):
        pairs = [
            c.update_and_fetch(keys[r : r + 1, :, :n], values[r : r + 1, :, :n])
            for r, (c, n) in enumerate(zip(self.caches, self.lengths, strict=True))
        ]
        return [k for k, _ in pairs], [v for _, v in pairs]

    def make_mask(self, n, **kwargs):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    model, _ = fetch(data_dir())
    adapter = MLXAdapter(model)
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(100, 10000, n)] for n in LENGTHS]

    def run() -> None:
        module = sys.modules[type(adapter.model).__module__]
        rows_attention = module.scaled_dot_product_attention  # Tandem's, for decode rows

        def attention(queries, keys, values, cache, scale, mask, **kwargs):
            if not isinstance(cache, ChunkRows):
                return rows_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
            L, outs = queries.shape[2], []
            for r, (k, v, n) in enumerate(zip(keys, values, cache.lengths, strict=True)):
                o = rows_attention(queries[r : r + 1, :, :n], k, v, cache=None, scale=scale, mask="causal")
                pad = mx.zeros((1, o.shape[1], L - n, o.shape[3]), o.dtype)
                outs.append(mx.concatenate([o, pad], axis=2) if n < L else o)
            return mx.concatenate(outs)

        module.scaled_dot_product_attention = attention
        single_s, batched_s = [], []
        for _ in range(args.reps):
            t = time.perf_counter()
            singles = []
            for ids in prompts:
                session = adapter.new_session(256)
                singles.append((session, adapter.forward(session, ids)))
            single_s.append(time.perf_counter() - t)

            t = time.perf_counter()
            sessions = [adapter.new_session(256) for _ in prompts]
            L = max(LENGTHS)
            layers = [ChunkRows([s[i] for s in sessions], LENGTHS) for i in range(adapter.geometry.layers)]
            hidden = adapter.model.model(mx.array([ids + [0] * (L - len(ids)) for ids in prompts]), layers)
            last = mx.stack([hidden[r, n - 1] for r, n in enumerate(LENGTHS)])
            logits = adapter._logits(last).astype(mx.float32)
            mx.eval(logits, [(c.keys, c.values) for s in sessions for c in s])
            batched_s.append(time.perf_counter() - t)
        logits = np.array(logits)
        exact = all(
            np.array_equal(single[1], logits[r])
            and all(
                np.array_equal(np.array(a.keys[0, :, :n]), np.array(b.keys[0, :, :n]))
                for a, b in zip(single[0], batched, strict=True)
            )
            for r, (single, batched, n) in enumerate(zip(singles, sessions, LENGTHS, strict=True))
        )
        one, many = statistics.median(single_s), statistics.median(batched_s)
        print(f"{len(prompts)} chunks, {sum(LENGTHS)} tokens ({len(prompts) * max(LENGTHS)} with padding)")
        print(f"one forward per chunk: median {one:.3f} s  (runs {', '.join(f'{x:.2f}' for x in single_s)})")
        print(f"one batched forward:   median {many:.3f} s  (runs {', '.join(f'{x:.2f}' for x in batched_s)})")
        print(f"batched ÷ per chunk: {many / one:.2f}; batched rows bit-identical to single: {exact}")

    adapter._executor.submit(run).result()
    adapter.close()


if __name__ == "__main__":
    main()
