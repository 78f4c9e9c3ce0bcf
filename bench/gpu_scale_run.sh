#!/bin/bash
# The GPU run at real size (issue 23) on the lent H200/H100: a random-weight checkpoint with
# Llama-3.1-8B's exact geometry (bench/gpu_build_llama8b.py, built on the GPU: timing is what is
# measured, not text); torch CUDA FP16 as P and a second torch CUDA process on the same GPU as D;
# P and D in network namespaces joined by a veth shaped with tc tbf (LINK=shaped, RATE MB/s:
# 1170 for 10 GbE, 117 for 1 GbE), or loopback. Each cell: P alone (node/a-torch), P/D with FP16
# pages, P/D with FP8 pages; TTFT, bound, TTFT ÷ bound (tandem bench ttft).
# Carry [".whl", ".devcarry"] (`bash bench/gpu_carry.sh` here first). Run from the repository root
# on that machine with $OUT set:   LINK=shaped RATE=1170 LENGTHS=2048,8192,32768 bash bench/gpu_scale_run.sh
# (or LINKS="loopback shaped:1170 shaped:117" for all three in one call).
# The built model stays in /tmp/llama8b while the machine is warm (the next call reuses it).
# BENCH=sender instead measures P's prefill inside P/D ÷ P alone for the loop's page sender and the
# sender thread, plain and TLS, over loopback (bench/bench_sender.py; issue 23, deliverable 2):
#   BENCH=sender TOKENS=8192 ROUNDS=3 bash bench/gpu_scale_run.sh
# Before the benchmark, in the same call: CUDA_TESTS=1 runs tests/system/test_cuda.py (CUDA_K: pytest's -k); PROBE=8192 runs
# bench/gpu_prefill_export.py on the 8B checkpoint (CHUNKS=512,2048 compares chunk sizes).
# TRACE=1 traces one more P/D request per cell (where its time goes; bench ttft --trace).
# EXTRA=--int8 adds a column of P/D with INT8 pages (coded on both GPUs, as FP8's are).
set -e
DEADLINE=$(( $(date +%s) + ${SECONDS_LEFT:-540} ))  # the whole call, model build included
REPO=$PWD
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .devcarry/wheels312/*.whl
export PYTHONPATH=/tmp/site:$REPO
PY=$(python3 -c 'import sys;print(sys.executable)')
printf "#!$PY\nfrom tandem_cli.main import main\nmain()\n" > "$(dirname "$PY")/tandem"; chmod +x "$(dirname "$PY")/tandem"
if [ ! -f /tmp/llama8b/config.json ]; then
  python3 bench/gpu_build_llama8b.py /tmp/llama8b .devcarry/tok | tee "$OUT/build.txt"
fi
if [ -n "${CUDA_TESTS:-}" ]; then
  TANDEM_TOKENIZER_DIR=.devcarry/tok timeout 240 python3 -m pytest -q -p no:cacheprovider tests/system/test_cuda.py \
    -k "${CUDA_K:-}" 2>&1 | grep -v "^[0-9.]*s \(call\|setup\|teardown\)" | tail -40 | tee "$OUT/test_cuda.txt" || true
fi
if [ -n "${PROBE:-}" ]; then
  timeout 240 python3 bench/gpu_prefill_export.py --model /tmp/llama8b --lengths "$PROBE" ${CHUNKS:+--chunks $CHUNKS} --reps "${PROBE_REPS:-3}" 2>&1 | tail -12 | tee "$OUT/export.txt" || true
fi
if [ "${BENCH:-}" = sender ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  for t in plain tls; do  # two 8B agents on the GPU at a time (both senders), not four
    share=$([ $t = plain ] && echo 2 || echo 1)  # plain gets half the time left, TLS the rest
    timeout -s INT -k 20 $(( (DEADLINE - $(date +%s)) / share )) python3 bench/bench_sender.py --model /tmp/llama8b --device cuda --transports $t \
      --tokens "${TOKENS:-8192}" --rounds "${ROUNDS:-3}" --out "$OUT" ${EXTRA:-} 2>&1 | tail -20 | tee "$OUT/bench-$t.txt"
  done
  exit 0
fi
# LINKS runs several links in one call (a machine is scarce: one call, one model build), in order,
# each in $OUT/<link>[-<rate>]/, sharing what is left of SECONDS_LEFT: LINKS="loopback shaped:1170 shaped:117".
LINKS=${LINKS:-${LINK:-loopback}${RATE:+:$RATE}}
case " $LINKS " in *" shaped"*)  # `ip` and `tc` from the carried debs, their libraries for them alone
  for f in .devcarry/ipr/*.deb; do dpkg -x "$f" /tmp/ipr; done
  for t in bin/ip sbin/tc; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/ipr/usr/lib/x86_64-linux-gnu:/tmp/ipr/lib/x86_64-linux-gnu exec /tmp/ipr/%s "$@"\n' "$t" > /usr/local/bin/$(basename $t)
    chmod +x /usr/local/bin/$(basename $t)
  done;;
esac
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for spec in $LINKS; do
  IFS=: read -r link rate <<<"$spec"
  left=$(( DEADLINE - $(date +%s) ))
  [ "$left" -gt 30 ] || { echo "no time left for $spec"; break; }
  dir="$OUT/$link${rate:+-$rate}"; mkdir -p "$dir"
  echo "== $spec ($left s left)"
  TANDEM_HOME=/tmp/th timeout -s INT -k 20 "$left" "$(dirname "$PY")/tandem" bench ttft --model /tmp/llama8b \
    --prefill torch --decode torch --direction a2b --link "$link" ${rate:+--rate $rate} \
    --lengths "${LENGTHS:-2048,8192,32768}" --samples "${SAMPLES:-2}" --warmup "${WARMUP:-1}" --max-tokens 8 --fp8 \
    --staging "${STAGING:-512MiB}" --cores-per-agent "${CORES:-4}" $([ -n "${TRACE:-}" ] && echo --trace || echo --no-trace) --out "$dir" ${EXTRA:-} 2>&1 | tail -40 | tee "$dir/bench.txt" || true
done
