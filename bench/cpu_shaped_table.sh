#!/bin/bash
# The CPU shaped-link TTFT table: `tandem bench ttft` on engine pairs, both directions, agents in
# two namespaces joined by a veth pair shaped to 85 MB/s (needs root). One pair at a time (each
# starts its own two agents and panel); each run rewrites its files after every cell, so a run
# cut short keeps what it measured. From the repository root:
#   bash bench/cpu_shaped_table.sh OUTDIR [P:D[:DIRECTION]...]      (default: every pair below)
# Environment: LENGTHS (744,2844), SAMPLES (3), WARMUP (1), ALONE=1 to measure each engine alone
# once, EXTRA (more bench options, e.g. --no-trace).
set -u
OUT=${1:?usage: bench/cpu_shaped_table.sh OUTDIR [P:D[:DIRECTION]...]}; shift
PAIRS=${*:-torch:mlx vllm:mlx sglang:mlx torch:vllm torch:sglang torch:torch:a2b mlx:mlx:a2b vllm:vllm:a2b sglang:sglang:a2b}
declare -A seen
for pair in $PAIRS; do
  IFS=: read -r p d dir <<<"$pair"
  alone=--no-alone
  [ "${ALONE:-0}" = 1 ] && { [ -z "${seen[$p]:-}" ] || [ -z "${seen[$d]:-}" ]; } && alone=--alone
  seen[$p]=1 seen[$d]=1
  mkdir -p "$OUT/$p-$d"
  echo "$(date -u +%H:%M:%S) $p -> $d (${dir:-both}) $alone, load $(cut -d' ' -f1 /proc/loadavg)"
  # shellcheck disable=SC2086
  PYTHONPATH=$PWD .venv/bin/tandem bench ttft --link shaped --rate 85 --lengths "${LENGTHS:-744,2844}" \
    --samples "${SAMPLES:-3}" --warmup "${WARMUP:-1}" --prefill "$p" --decode "$d" --direction "${dir:-both}" \
    $alone ${EXTRA:-} --out "$OUT/$p-$d" --panel-dir "$OUT/$p-$d/panel" >"$OUT/$p-$d/bench.log" 2>&1
  echo "$(date -u +%H:%M:%S) $p -> $d exit $?"
done
