"""The product's page stream against raw TCP on a shaped veth, pull after pull, per page sender.

    sudo .venv/bin/python bench/bench_page_stream_shaped.py MODEL_DIR [--senders thread,loop] [--rate 1170] [--pulls 3]

One torch agent (pinned to CPU 0) in one namespace, the decoder's receiver (`tandem_cli.bench_probes
pages`, pinned to CPU 1) in the other, joined by a veth shaped with tc tbf (tandem_cli/netns.py);
each pull is 256 MB of synthetic pages (GET /v1/bench/pages) against a raw TCP copy of the same
size just before it. One pull is noisy on a loaded machine (`tandem bench ttft` keeps the best of
three since 78e0d81); results: bench/results/page-stream-shaped-1170-20261205.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem_cli.bench_ttft.link import page_stream, random_block, raw_tcp, shaped_link  # noqa: E402
from tandem_cli.processes import ServiceProcess, agent_serve_args  # noqa: E402

KEY = "k" * 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--senders", default="thread,loop")
    ap.add_argument("--rate", type=float, default=1170.0, help="MB/s")
    ap.add_argument("--pulls", type=int, default=3)
    args = ap.parse_args()
    with shaped_link(args.rate, 0.0, random_block()) as net:
        a, b = net.places
        for sender in args.senders.split(","):
            serve = agent_serve_args(
                "torch", args.model, "--name", "a", "--prefix-cache-bytes", "0", "--page-sender", sender, host=a.host
            )
            env = {"TANDEM_HOME": tempfile.mkdtemp(), "TANDEM_CLUSTER_KEY": KEY}
            agent = ServiceProcess(serve, env=env, netns=a.netns, cpus="0")
            try:
                url = f"http://{a.addr}:{agent.wait_ready(600).rsplit(':', 1)[1]}"
                info = httpx.get(url + "/v1/info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
                for i in range(args.pulls):
                    raw = raw_tcp(a, b, 256, ("0", "1"))["bytes_per_second"]
                    pages = page_stream(url, info, b, KEY, 256, "1")["bytes_per_second"]
                    print(
                        f"{sender} pull {i + 1}: raw TCP {raw / 1e6:.0f} MB/s, page stream {pages / 1e6:.0f} MB/s = {pages / raw:.2f}x",
                        flush=True,
                    )
            finally:
                agent.stop()


if __name__ == "__main__":
    main()
