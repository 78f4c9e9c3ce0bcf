"""`tandem bench ttft`: time to first token through the panel's OpenAI API, each engine alone and
P→D, against a lower bound measured for each request in the same run:

    bound = max(P's own prefill of the request, a raw TCP stream of its wire bytes on the same path)
            + one decode step on D where D recomputes the last prompt token (vLLM's way)

(measure.py says how each term is measured and why each is a lower bound). A cell with
TTFT ÷ bound under 0.98 in any sample is flagged as an invalid bound, and the command fails.

The benchmark starts its own cluster (cluster.py: two agents on the embedded model and a panel),
either on loopback or with each agent in its own network namespace, joined by a veth pair shaped
with `tc tbf` to a given rate (`--link shaped`, tandem_cli/netns.py); the panel reaches both over
unshaped veths, agents reach each other only over the shaped one. Each agent is pinned to its own
CPU. Per cell: a warm-up, then `--samples` requests, one at a time, greedy, streaming, distinct
random prompts (no prefix reuse); TTFT is the time from sending the request to the first
streamed chunk. The raw TCP and page-stream probes at either end are tandem_cli/bench_probes.py.

`--panel URL` benchmarks a panel that is already running instead (running_panel.py).

Output (in --out, report.py): ttft-<link>-<time>.json (every sample and every bound term), .md
(the table) and .png (TTFT and bound against prompt length).

`--delay-ms` adds a delay each way with `netem` under the token bucket where the kernel has it;
where it has not (this CI machine's kernel), the link has a rate but no added delay, the output
says so, and the measured round-trip time is recorded either way.
"""

from .cluster import cluster
from .command import bench_ttft
from .link import loopback_link, shaped_link
from .probe_agents import prompt_ids

__all__ = ["bench_ttft", "cluster", "loopback_link", "prompt_ids", "shaped_link"]
