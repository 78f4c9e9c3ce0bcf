"""The Requests page: the request log, a TTFT bar per request, and the last TTFT benchmark."""

from __future__ import annotations

from fastapi import APIRouter
from sqlmodel import col, select

from ..bench_results import latest_ttft
from ..deps import SIGNED_IN, DbSession, Panel, Render
from ..models import RequestLog

router = APIRouter(include_in_schema=False, dependencies=SIGNED_IN)


@router.get("/requests")
async def requests_page(panel: Panel, s: DbSession, render: Render):
    rows = list(s.exec(select(RequestLog).order_by(col(RequestLog.created).desc()).limit(200)))
    chart = ttft_chart(list(reversed(rows[:60])))
    return render("requests.html", rows=rows, chart=chart, bench=latest_ttft(panel.data_dir))


def ttft_chart(rows: list[RequestLog], width: int = 720, height: int = 160) -> dict:
    """Bars of TTFT per request (oldest left), as numbers the template draws as inline SVG."""
    values = [r.ttft_ms for r in rows]
    top = max([v for v in values if v is not None] or [1.0])
    pad_left, pad_bottom = 72, 20
    plot_w, plot_h = width - pad_left - 8, height - pad_bottom - 8
    n = max(len(rows), 1)
    step = min(plot_w / n, 36.0)  # a few requests still look like bars, not one wall
    bars = []
    for i, r in enumerate(rows):
        v = r.ttft_ms
        h = 0 if v is None else max(1.0, plot_h * v / top)
        bars.append(
            {
                "x": round(pad_left + i * step + step * 0.1, 1),
                "w": round(max(step * 0.8, 1), 1),
                "y": round(8 + plot_h - h, 1),
                "h": round(h, 1),
                "ms": v,
                "route": r.route,
                "outcome": r.outcome,
                "model": r.model,
            }
        )
    return {
        "width": width,
        "height": height,
        "bars": bars,
        "top": round(top),
        "pad_left": pad_left,
        "base_y": 8 + plot_h,
        "plot_w": plot_w,
        "empty": not any(v is not None for v in values),
    }
