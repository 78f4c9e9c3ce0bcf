"""What TLS costs the page link and P/D's time to first token: the same agents' code over HTTPS
(their own certificates, pinned) and over plain HTTP, measured in one run, on loopback and on a
`tc tbf` link shaped to 85 MB/s between two network namespaces.

    sudo .venv/bin/python bench/bench_tls.py [--megabytes 128] [--rounds 3] [--rate 85]

Namespace A holds the prefillers (torch, one TLS, one plain) and the loopback decoders (MLX, one
of each, reaching their prefiller over A's own loopback); namespace B holds the decoders across
the shaped link. Every agent has its prefix cache off, so each request computes its whole prompt.
- page stream: POST /v1/bench/link on a decoder, which pulls `--megabytes` of synthetic pages
  from its prefiller through the decoder's own receiver (every frame checked), TLS and plain
  rounds alternating; the median rate of each and their ratio (goal on the shaped link >= 0.95x);
- P/D TTFT: POST /v1/decode on a decoder with its prefiller named (and pinned), prompts of 744 and
  2,844 random tokens, the time to the first token line; the median of `--rounds` and the ratio.
Writes bench/results/tls-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_adapters.embedded_model import is_fetched, model_dir  # noqa: E402
from node_agent.identity import known_certificates  # noqa: E402
from tandem_cli.netns import netns_available, shaped_pair  # noqa: E402
from tandem_cli.processes import ServiceProcess, agent_serve_args  # noqa: E402
from tandem_protocol.client import AgentClient  # noqa: E402
from tandem_protocol.settings import data_dir  # noqa: E402

KEY = "tdm_bench-tls-key-0123456789abcdef"
PROMPTS = (744, 2844)


class Agent:
    def __init__(self, name: str, engine: str, ns: str, host: str, tls: bool, home: Path):
        self.name, self.tls, self.home = name, tls, home / name
        args = agent_serve_args(
            engine, model_dir(data_dir()), "--name", name, "--prefix-cache-bytes", "0", host=host, tls=tls
        )
        self.proc = ServiceProcess(args, env={"TANDEM_CLUSTER_KEY": KEY, "TANDEM_HOME": str(self.home)}, netns=ns)

    def ready(self) -> None:
        self.url = self.proc.wait_ready(600)
        self.fingerprint = known_certificates(self.home).get(self.name) if self.tls else None

    def client(self) -> AgentClient:
        return AgentClient(self.url, KEY, pin=self.fingerprint)


async def link_rate(d: Agent, p: Agent, megabytes: int) -> float:
    client = d.client()
    try:
        m = await client.bench_link(p.url, megabytes, p.fingerprint)
        return m["bytes_per_second"]
    finally:
        await client.aclose()


async def ttft(d: Agent, p: Agent, ids: list[int]) -> float:
    client = d.client()
    body = {"token_ids": ids, "sampling": {"max_tokens": 2}, "prefill_url": p.url}
    if p.fingerprint:
        body["prefill_fingerprint"] = p.fingerprint
    try:
        t0 = time.perf_counter()
        async for line in client.lines("/v1/decode", body):
            if "token" in line:
                return time.perf_counter() - t0
            if "error" in line:
                raise RuntimeError(line["error"])
        raise RuntimeError("no token")
    finally:
        await client.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megabytes", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=85.0, help="the shaped link, MB/s")
    args = ap.parse_args()
    if not netns_available():
        sys.exit("needs root and iproute2 (network namespaces)")
    if not is_fetched(data_dir()):
        sys.exit("the embedded model is not fetched: `tandem model fetch`")
    home = Path(f"/tmp/bench-tls-{random.randrange(1 << 30):x}")
    rng = random.Random(7)
    prompts = {n: [rng.randrange(1000, 40000) for _ in range(n)] for n in PROMPTS}
    results: dict = {"rate_mbytes": args.rate, "megabytes": args.megabytes, "rounds": args.rounds, "links": {}}
    with shaped_pair(args.rate, block=71) as pair:
        a, b = pair.namespaces
        agents = {
            "p_tls": Agent("p-tls", "torch", a, pair.addrs[0], True, home),
            "p_plain": Agent("p-plain", "torch", a, pair.addrs[0], False, home),
            "lo_tls": Agent("lo-tls", "mlx", a, pair.addrs[0], True, home),
            "lo_plain": Agent("lo-plain", "mlx", a, pair.addrs[0], False, home),
            "d_tls": Agent("d-tls", "mlx", b, pair.addrs[1], True, home),
            "d_plain": Agent("d-plain", "mlx", b, pair.addrs[1], False, home),
        }
        try:
            for agent in agents.values():
                agent.ready()
            for link, (dt, dp) in {"loopback": ("lo_tls", "lo_plain"), "shaped": ("d_tls", "d_plain")}.items():
                pairs = {"tls": (agents[dt], agents["p_tls"]), "plain": (agents[dp], agents["p_plain"])}
                rates: dict[str, list[float]] = {"tls": [], "plain": []}
                times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in PROMPTS} for k in pairs}
                for d, p in pairs.values():  # warm: connections, the engines' first run
                    asyncio.run(link_rate(d, p, 8))
                    asyncio.run(ttft(d, p, prompts[PROMPTS[0]][:128]))
                for _ in range(args.rounds):
                    for kind, (d, p) in pairs.items():
                        rates[kind].append(asyncio.run(link_rate(d, p, args.megabytes)))
                    for n in PROMPTS:
                        for kind, (d, p) in pairs.items():
                            times[kind][n].append(asyncio.run(ttft(d, p, prompts[n])))
                row = {
                    "page_stream_mb_s": {k: statistics.median(v) / 1e6 for k, v in rates.items()},
                    "ttft_s": {k: {n: statistics.median(v) for n, v in t.items()} for k, t in times.items()},
                    "samples": {"rates": rates, "ttft": times},
                }
                row["page_stream_ratio"] = row["page_stream_mb_s"]["tls"] / row["page_stream_mb_s"]["plain"]
                row["ttft_ratio"] = {n: row["ttft_s"]["tls"][n] / row["ttft_s"]["plain"][n] for n in PROMPTS}
                results["links"][link] = row
                print(
                    f"{link:9s} page stream TLS {row['page_stream_mb_s']['tls']:8.1f} MB/s  plain "
                    f"{row['page_stream_mb_s']['plain']:8.1f} MB/s  ratio {row['page_stream_ratio']:.3f}"
                )
                for n in PROMPTS:
                    print(
                        f"{link:9s} P/D TTFT {n:5d} tokens  TLS {row['ttft_s']['tls'][n] * 1000:7.0f} ms  plain "
                        f"{row['ttft_s']['plain'][n] * 1000:7.0f} ms  ratio {row['ttft_ratio'][n]:.3f}"
                    )
        finally:
            for agent in agents.values():
                agent.proc.stop()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = ROOT / "bench" / "results" / f"tls-{stamp}"
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    lines = [
        f"# TLS vs plain HTTP (same run; shaped link {args.rate:g} MB/s; {args.megabytes} MB per stream; "
        f"median of {args.rounds})",
        "",
        "| link | page stream TLS MB/s | plain MB/s | TLS ÷ plain | TTFT 744 TLS / plain ms | ratio | "
        "TTFT 2,844 TLS / plain ms | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for link, row in results["links"].items():
        t, r = row["ttft_s"], row["ttft_ratio"]
        lines.append(
            f"| {link} | {row['page_stream_mb_s']['tls']:.1f} | {row['page_stream_mb_s']['plain']:.1f} | "
            f"{row['page_stream_ratio']:.3f} | {t['tls'][744] * 1000:.0f} / {t['plain'][744] * 1000:.0f} | "
            f"{r[744]:.3f} | {t['tls'][2844] * 1000:.0f} / {t['plain'][2844] * 1000:.0f} | {r[2844]:.3f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.json and .md")


if __name__ == "__main__":
    main()
