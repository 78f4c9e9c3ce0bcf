"""What FP8 and INT8 pages cost in quality, against FP16 pages of the same prefill, on the embedded model.

    .venv/bin/python bench/bench_fp8_quality.py [--steps 32] [--encodings fp8,int8]

For each of the 20 cross-engine prompts (tests/integration/rules.py) and each direction between
the in-process engines (torch -> MLX, MLX -> torch): P exports the pages of prompt[:-1]
(recompute-last); D imports them as sent in FP16, and again as they arrive in FP8 or INT8 (encoded
and decoded by tandem_protocol/fp8.py or int8.py, as on the wire). From each import D computes the last prompt
token and then `--steps` greedy tokens:
- first-step logits: max |FP8 - FP16| over the vocabulary (FP8 here and below: the lossy encoding);
- greedy agreement: the two answers identical over every step (and over the first 16, the
  cross-engine tests' length); beside it, as a baseline, FP16 pages against D's own prefill;
- KL: KL(FP16 || FP8) of the next-token distributions, teacher-forced along the FP16 answer so
  both see the same context, averaged over the steps;
and the wire: the lossy payload's size against FP16's, and zstd's lossless ratio on the same pages.
Writes bench/results/fp8-quality-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.prompts import PROMPTS  # noqa: E402
from engine_adapters.base import EngineRequest  # noqa: E402
from tandem_protocol import fp8, int8  # noqa: E402
from tandem_protocol.handoff import FirstTokenMode  # noqa: E402
from tandem_protocol.pages import KVPage, compress_planes  # noqa: E402
from tandem_protocol.sampling import SamplingParams  # noqa: E402

CODECS = {"fp8": fp8, "int8": int8}


def over_the_wire(page: KVPage, encoding: str) -> KVPage:
    """The page as a decoder receives it over a link with this lossy encoding."""
    codec = CODECS[encoding]
    data = codec.decode(codec.encode(page.data), page.data.shape)
    return KVPage(index=page.index, valid_tokens=page.valid_tokens, data=data)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


async def run_from(decoder, pages: list[KVPage], ids: list[int], forced: list[int] | None, steps: int):
    """D's logits at each step after importing `pages` (of ids[:-1]): the last prompt token, then
    `steps` tokens, greedy or `forced`. Returns (logits per step, tokens chosen)."""
    session = await decoder.on_engine(decoder.new_session, len(ids) + steps + 1)
    try:
        for page in pages:
            await decoder.on_engine(decoder.import_kv, session, page.start, page.kv)
        await decoder.on_engine(decoder.set_length, session, len(ids) - 1)
        logits, tokens, last = [], [], ids[-1]
        for step in range(steps):
            row = await decoder.on_engine(decoder.forward, session, [last])
            logits.append(np.asarray(row, dtype=np.float32).reshape(-1))
            last = forced[step] if forced is not None else int(np.argmax(logits[-1]))
            tokens.append(last)
        return logits, tokens
    finally:
        await decoder.on_engine(decoder.release, session)


async def run_own(decoder, ids: list[int], steps: int) -> list[int]:
    """D's greedy answer from its own prefill of the whole prompt (no pages): the baseline any
    page import is held to."""
    session = await decoder.on_engine(decoder.new_session, len(ids) + steps + 1)
    try:
        row = await decoder.on_engine(decoder.forward, session, ids)
        tokens = []
        for _ in range(steps):
            tokens.append(int(np.argmax(np.asarray(row).reshape(-1))))
            row = await decoder.on_engine(decoder.forward, session, tokens[-1:])
        return tokens
    finally:
        await decoder.on_engine(decoder.release, session)


def same_for(a: list[int], b: list[int]) -> int:
    """How many leading tokens two answers share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


async def measure_prompt(prefiller, decoder, ids: list[int], steps: int, encodings: list[str]) -> dict[str, dict]:
    """One prompt's figures for each lossy encoding, against one FP16 reference.

    A greedy run from lossy pages sees the same logits as the run teacher-forced along FP16's
    answer until it first picks another token, so the forced run alone gives both the KL and how
    many leading tokens the lossy answer shares with FP16's (and step 0 is the same in both)."""
    req = EngineRequest("fp8-p", ids, SamplingParams(max_tokens=1), FirstTokenMode.RECOMPUTE_LAST)
    pages = [p async for p in prefiller.prefill(req) if isinstance(p, KVPage)]
    ref_logits, ref_tokens = await run_from(decoder, pages, ids, None, steps)
    own_tokens = await run_own(decoder, ids, steps)
    shared = {  # the same for every encoding
        "fp16_same_for": same_for(ref_tokens, own_tokens),  # FP16 pages' answer against D's own prefill
        "raw_bytes": sum(p.data.nbytes for p in pages),
        "zstd_bytes": sum(len(compress_planes(p.data)) for p in pages),
    }
    rows = {}
    for encoding in encodings:
        lossy = [over_the_wire(p, encoding) for p in pages]
        forced, _ = await run_from(decoder, lossy, ids, ref_tokens, steps)  # along FP16's answer
        kls = []
        for a, b in zip(ref_logits, forced, strict=True):
            la, lb = log_softmax(a), log_softmax(b)
            kls.append(float(np.sum(np.exp(la) * (la - lb))))
        lossy_same_for = same_for(ref_tokens, [int(np.argmax(row)) for row in forced])
        rows[encoding] = {
            "first_step_max_abs_diff": float(np.max(np.abs(ref_logits[0] - forced[0]))),
            "greedy_agree": lossy_same_for == steps,
            "fp8_same_for": lossy_same_for,  # leading tokens the lossy pages' answer shares with FP16's
            "mean_kl": float(np.mean(kls)),
            "lossy_bytes": sum(
                CODECS[encoding].payload_bytes(*p.data.shape[:1], *p.data.shape[3:], p.data.shape[2]) for p in pages
            ),
            **shared,
        }
    return rows


def measure(prefiller, decoder, steps: int = 32, encodings: tuple[str, ...] = ("fp8",)) -> dict[str, dict]:
    """Every prompt, one direction, each lossy encoding: per encoding, the per-prompt figures and
    their summary."""
    per_prompt = []
    for text in PROMPTS:
        ids = decoder.chat_token_ids([{"role": "user", "content": text}])
        per_prompt.append(asyncio.run(measure_prompt(prefiller, decoder, ids, steps, list(encodings))))
    return {
        encoding: summary(prefiller, decoder, steps, encoding, [r[encoding] for r in per_prompt])
        for encoding in encodings
    }


def summary(prefiller, decoder, steps: int, encoding: str, rows: list[dict]) -> dict:
    raw = sum(r["raw_bytes"] for r in rows)
    return {
        "direction": f"{prefiller.name}->{decoder.name}",
        "encoding": encoding,
        "steps": steps,
        "prompts": len(rows),
        "greedy_agreement": sum(r["greedy_agree"] for r in rows),
        "greedy_agreement_16": sum(r["fp8_same_for"] >= 16 for r in rows),
        "fp16_pages_vs_own_prefill": sum(r["fp16_same_for"] == steps for r in rows),
        "fp16_pages_vs_own_prefill_16": sum(r["fp16_same_for"] >= 16 for r in rows),
        "first_step_max_abs_diff": max(r["first_step_max_abs_diff"] for r in rows),
        "mean_kl": float(np.mean([r["mean_kl"] for r in rows])),
        "max_prompt_kl": max(r["mean_kl"] for r in rows),
        "wire_ratio": sum(r["lossy_bytes"] for r in rows) / raw,
        "zstd_wire_ratio": sum(r["zstd_bytes"] for r in rows) / raw,
        "per_prompt": rows,
    }


def full_page_ratios(prefiller, decoder) -> dict:
    """Wire bytes ÷ FP16 over the full pages of one long prompt (the 20 prompts in one message,
    three times over: 540 tokens, 8 full pages): the short prompts above fill no page, and a page's
    zero tail flatters zstd."""
    text = " ".join(PROMPTS * 3)
    ids = decoder.chat_token_ids([{"role": "user", "content": text}])
    req = EngineRequest("fp8-wire", ids, SamplingParams(max_tokens=1), FirstTokenMode.COMMIT_FIRST)

    async def pages():
        return [p async for p in prefiller.prefill(req) if isinstance(p, KVPage) and p.valid_tokens == p.data.shape[2]]

    full = asyncio.run(pages())
    raw = sum(p.data.nbytes for p in full)
    return {
        "tokens": len(ids),
        "full_pages": len(full),
        **{name: sum(len(codec.encode(p.data)) for p in full) / raw for name, codec in CODECS.items()},
        "zstd": sum(len(compress_planes(p.data)) for p in full) / raw,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--encodings", default="fp8,int8", help="the lossy encodings to measure, comma-separated")
    args = ap.parse_args()
    from engine_adapters import load_adapter
    from engine_adapters.embedded_model import fetch
    from tandem_protocol.settings import data_dir

    path, _ = fetch(data_dir())
    engines = {name: load_adapter(name, path) for name in ("torch", "mlx")}
    for adapter in engines.values():
        adapter.set_prefix_cache_bytes(0)
    encodings = tuple(args.encodings.split(","))
    by_direction = [
        measure(engines[p], engines[d], args.steps, encodings) for p, d in (("torch", "mlx"), ("mlx", "torch"))
    ]
    results = [r[encoding] for encoding in encodings for r in by_direction]
    wire = {name: full_page_ratios(engines[name], engines[name]) for name in engines}
    for adapter in engines.values():
        adapter.close()
    lines = [
        f"# FP8 and INT8 pages against FP16 pages (embedded model, 20 prompts, {args.steps} greedy steps)",
        "",
        "| encoding | direction | = FP16 pages, greedy, all steps | first 16 | baseline: FP16 pages = D's own "
        "prefill, all steps / first 16 | first-step max abs logit diff | mean KL (nats) | worst prompt KL | "
        "wire ÷ FP16 | zstd wire ÷ FP16 (lossless) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['encoding']} | {r['direction']} | {r['greedy_agreement']}/{r['prompts']} | {r['greedy_agreement_16']}/{r['prompts']} | "
            f"{r['fp16_pages_vs_own_prefill']}/{r['prompts']} / {r['fp16_pages_vs_own_prefill_16']}/{r['prompts']} | "
            f"{r['first_step_max_abs_diff']:.4f} | "
            f"{r['mean_kl']:.2e} | {r['max_prompt_kl']:.2e} | {r['wire_ratio']:.4f} | {r['zstd_wire_ratio']:.4f} |"
        )
    lines += ["", "Wire bytes ÷ FP16 over full pages only (one long prompt):", ""]
    lines += [
        f"- {name} pages ({w['full_pages']} full pages of a {w['tokens']}-token prompt): FP8 {w['fp8']:.4f}, "
        f"INT8 {w['int8']:.4f}, zstd {w['zstd']:.4f}"
        for name, w in wire.items()
    ]
    print("\n".join(lines))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = ROOT / "bench" / "results" / f"lossy-pages-quality-{stamp}"
    out.with_suffix(".json").write_text(json.dumps({"directions": results, "full_pages": wire}, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.json and .md")


if __name__ == "__main__":
    main()
