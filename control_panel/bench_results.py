"""The latest `tandem bench ttft` result, as the panel shows it (Requests page).

The benchmark writes its JSON to `<panel data dir>/bench/ttft-latest.json` (the default data
dir: the panel on the machine the benchmark ran on); the panel reads it when the page is shown.
"""

from __future__ import annotations

import json
from pathlib import Path

LATEST_TTFT = Path("bench") / "ttft-latest.json"


def latest_ttft(data_dir: Path) -> dict | None:
    """Rows for the page, or None when no run has been kept (or the file is not readable)."""
    try:
        result = json.loads((data_dir / LATEST_TTFT).read_text())
        rows = []
        for c in result["cells"]:
            own = c.get("ttft_minus_own_prefill")
            rows.append(
                {
                    "tokens": c["tokens"],
                    "column": c["column"],
                    "ttft_ms": c["ttft"]["median"] * 1000,
                    "over_bound": c.get("ttft_over_bound"),
                    "overhead_ms": own["median"] * 1000 if own else None,
                }
            )
        link = ", ".join(
            f"{k}: {v['bytes_per_second'] / 1e6:,.0f} MB/s"
            for k, v in result["link_measured"].items()
            if isinstance(v, dict)
        )
        return {"started": result["started"], "link": result["link"], "link_measured": link, "rows": rows}
    except (OSError, ValueError, KeyError, TypeError):
        return None
