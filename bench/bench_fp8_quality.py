"""What FP8 and INT8 pages cost in quality, against FP16 pages of the same prefill, on the embedded model.

    .venv/bin/python bench/bench_fp8_quality.py [--steps 32] [--encodings fp8,int8] [--batched]

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
D steps all of these runs of all prompts in lockstep, each run alone (`forward`): a batched step
(`forward_rows`, `--batched`) gives the same tokens but not the same logits bit for bit on the
embedded model (up to ~2.5e-3 apart on MLX, ~1.5e-2 on torch), so its figures differ in their
fourth digit; it is ~8x faster.
Writes bench/results/fp8-quality-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
from dataclasses import dataclass
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


@dataclass
class Row:
    """One decode of one prompt on D: from `pages` of ids[:-1] (None: D's own prefill of the whole
    prompt), greedy, or teacher-forced along the greedy answer of row `follows`."""

    ids: list[int]
    pages: list[KVPage] | None = None
    follows: int | None = None


def as_row(logits) -> np.ndarray:
    return np.asarray(logits, dtype=np.float32).reshape(-1)


def decode_rows(decoder, rows: list[Row], steps: int, batched: bool = False) -> list[list[np.ndarray]]:
    """Each row's logits at each of `steps` steps (on D's engine thread). A row from pages first
    computes the last prompt token; a row from D's own prefill has its first logits from that
    prefill. Then all rows step in lockstep, each taking its own argmax or the token its leader
    chose at the step before: each row alone (`forward`), or all in one `forward_rows` if
    `batched` (the same tokens, logits not bit-identical: see the module doc)."""
    sessions, logits = [], [[] for _ in rows]
    try:
        for row, out in zip(rows, logits, strict=True):
            sessions.append(decoder.new_session(len(row.ids) + steps + 1))
            if row.pages is None:
                out.append(as_row(decoder.forward(sessions[-1], row.ids)))
            else:
                for page in row.pages:
                    decoder.import_kv(sessions[-1], page.start, page.kv)
                decoder.set_length(sessions[-1], len(row.ids) - 1)

        def next_token(r: int) -> int:
            done = len(logits[r])
            if done == 0:
                return rows[r].ids[-1]
            leader = r if rows[r].follows is None else rows[r].follows
            return int(np.argmax(logits[leader][done - 1]))

        while todo := [r for r, out in enumerate(logits) if len(out) < steps]:
            tokens = [next_token(r) for r in todo]
            if batched:
                step = decoder.forward_rows([sessions[r] for r in todo], tokens)
            else:
                step = [decoder.forward(sessions[r], [t]) for r, t in zip(todo, tokens, strict=True)]
            for r, row_logits in zip(todo, step, strict=True):
                logits[r].append(as_row(row_logits))
        return logits
    finally:
        for session in sessions:
            decoder.release(session)


def same_for(a: list[int], b: list[int]) -> int:
    """How many leading tokens two answers share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def greedy(logits: list[np.ndarray]) -> list[int]:
    return [int(np.argmax(row)) for row in logits]


def prompt_figures(pages, ref, own, lossy_runs: dict[str, list[np.ndarray]], steps: int) -> dict[str, dict]:
    """One prompt's figures for each lossy encoding, against one FP16 reference: `ref` and `own`
    D's logits along its greedy answers from FP16 pages and from its own prefill, `lossy_runs` its
    logits from each encoding's pages teacher-forced along `ref`'s answer.

    A greedy run from lossy pages sees the same logits as the run teacher-forced along FP16's
    answer until it first picks another token, so the forced run alone gives both the KL and how
    many leading tokens the lossy answer shares with FP16's (and step 0 is the same in both)."""
    ref_tokens = greedy(ref)
    shared = {  # the same for every encoding
        "fp16_same_for": same_for(ref_tokens, greedy(own)),  # FP16 pages' answer against D's own prefill
        "raw_bytes": sum(p.data.nbytes for p in pages),
        "zstd_bytes": sum(len(compress_planes(p.data)) for p in pages),
    }
    rows = {}
    for encoding, forced in lossy_runs.items():
        kls = []
        for a, b in zip(ref, forced, strict=True):
            la, lb = log_softmax(a), log_softmax(b)
            kls.append(float(np.sum(np.exp(la) * (la - lb))))
        lossy_same_for = same_for(ref_tokens, greedy(forced))
        rows[encoding] = {
            "first_step_max_abs_diff": float(np.max(np.abs(ref[0] - forced[0]))),
            "greedy_agree": lossy_same_for == steps,
            "fp8_same_for": lossy_same_for,  # leading tokens the lossy pages' answer shares with FP16's
            "mean_kl": float(np.mean(kls)),
            "lossy_bytes": sum(
                CODECS[encoding].payload_bytes(*p.data.shape[:1], *p.data.shape[3:], p.data.shape[2]) for p in pages
            ),
            **shared,
        }
    return rows


def measure(
    prefiller, decoder, steps: int = 32, encodings: tuple[str, ...] = ("fp8",), batched: bool = False
) -> dict[str, dict]:
    """Every prompt, one direction, each lossy encoding: per encoding, the per-prompt figures and
    their summary. P prefills each prompt; then D decodes every prompt's runs (FP16 pages, its own
    prefill, each lossy encoding's pages) in lockstep (`decode_rows`)."""
    prompts = [decoder.chat_token_ids([{"role": "user", "content": text}]) for text in PROMPTS]

    async def prefill(ids: list[int]) -> list[KVPage]:
        req = EngineRequest("fp8-p", ids, SamplingParams(max_tokens=1), FirstTokenMode.RECOMPUTE_LAST)
        return [p async for p in prefiller.prefill(req) if isinstance(p, KVPage)]

    pages = [asyncio.run(prefill(ids)) for ids in prompts]
    rows, width = [], 2 + len(encodings)  # per prompt: FP16 pages, own prefill, each encoding's pages
    for ids, sent in zip(prompts, pages, strict=True):
        ref = len(rows)
        rows += [Row(ids, sent), Row(ids)]
        rows += [Row(ids, [over_the_wire(p, e) for p in sent], follows=ref) for e in encodings]  # along FP16's answer
    logits = asyncio.run(decoder.on_engine(decode_rows, decoder, rows, steps, batched))
    per_prompt = []
    for i, sent in enumerate(pages):
        ref, own, *lossy = logits[i * width : (i + 1) * width]
        per_prompt.append(prompt_figures(sent, ref, own, dict(zip(encodings, lossy, strict=True)), steps))
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
    ap.add_argument("--batched", action="store_true", help="decode in batched steps (~8x faster, see above)")
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
        measure(engines[p], engines[d], args.steps, encodings, args.batched)
        for p, d in (("torch", "mlx"), ("mlx", "torch"))
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
