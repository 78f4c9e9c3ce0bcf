#!/bin/bash
# The CPU shaped-link TTFT table: `tandem bench ttft` on every engine pair, both directions, at
# 744 and 2,844 tokens, agents in two namespaces joined by a veth pair shaped to 85 MB/s (needs
# root). One pair at a time (each starts its own two agents and panel). Run from the repository
# root: bash bench/cpu_shaped_table.sh OUTDIR [PAIR...], a PAIR as P:D[:DIRECTION] (default: all
# below). Engines alone are measured once each (--no-alone where measured before).
set -u
OUT=${1:?usage: bench/cpu_shaped_table.sh OUTDIR [P:D[:DIRECTION]...]}; shift
PAIRS=${*:-torch:mlx vllm:mlx sglang:mlx torch:vllm torch:sglang torch:torch:a2b mlx:mlx:a2b vllm:vllm:a2b sglang:sglang:a2b}
declare -A seen
for pair in $PAIRS; do
  IFS=: read -r p d dir <<<"$pair"
  alone=--no-alone
  [ -z "${seen[$p]:-}" ] || [ -z "${seen[$d]:-}" ] && alone=--alone
  seen[$p]=1 seen[$d]=1
  mkdir -p "$OUT/$p-$d"
  echo "$(date -u +%H:%M:%S) $p -> $d (${dir:-both}) $alone, load $(cut -d' ' -f1 /proc/loadavg)"
  PYTHONPATH=$PWD .venv/bin/tandem bench ttft --link shaped --rate 85 --lengths 744,2844 --samples 3 --warmup 1 \
    --prefill "$p" --decode "$d" --direction "${dir:-both}" $alone --out "$OUT/$p-$d" --panel-dir "$OUT/$p-$d/panel" \
    >"$OUT/$p-$d/bench.log" 2>&1
  echo "$(date -u +%H:%M:%S) $p -> $d exit $?"
done
