"""One table from several `tandem bench ttft` runs (bench/cpu_shaped_table.sh runs one per pair).

    .venv/bin/python bench/ttft_table.py OUT_STEM RUN.json... [--note TEXT]

Writes OUT_STEM.json ({"runs": [...]}, every run whole) and OUT_STEM.md: one row per P/D cell
(the bench's own row format), then each run's link and load line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem_cli.bench_ttft.measure import MIN_RATIO  # noqa: E402
from tandem_cli.bench_ttft.report import cell_row, header  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--note", default="", help="a paragraph put under the title (the machine's load, say)")
    args = ap.parse_args()
    runs = [json.loads(p.read_text()) for p in args.runs]
    cells = sorted((c for r in runs for c in r["cells"]), key=lambda c: (c["tokens"], c["column"]))
    invalid = [c for c in cells if c.get("invalid_bound")]
    rows = [
        "| tokens | column | TTFT median ms (min–max) | bound median ms | TTFT ÷ bound (lowest sample) | "
        "prefill term ms (P's own, median) | link term ms (raw TCP of the wire bytes) | wire MB | "
        "D step ms (recompute-last) | TTFT − P's own prefill ms, median (min–max) | bound |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *(cell_row(c) for c in cells),
        "",
        f"**{len(invalid)} cells under {MIN_RATIO}**: " + ", ".join(f"{c['tokens']} {c['column']}" for c in invalid)
        if invalid
        else f"No cell under {MIN_RATIO}: every P/D sample's TTFT ÷ its own bound is at least {MIN_RATIO} "
        f"(lowest {min(c['ttft_over_bound'] for c in cells if c.get('bound')):.2f}).",
        "",
        "Runs (one per pair; each its own agents, panel and shaped link):",
        "",
        *(f"- {r['started']}: " + header(r).split("\n\n")[0] for r in runs),
    ]
    title = "# TTFT against its lower bound, CPU agents on an 85 MB/s shaped link\n\n"
    bound = header(runs[0]).split("\n\n")[1]
    args.out.with_suffix(".md").write_text(
        title + (args.note + "\n\n" if args.note else "") + bound + "\n\n" + "\n".join(rows) + "\n"
    )
    args.out.with_suffix(".json").write_text(json.dumps({"runs": runs}, indent=1))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
