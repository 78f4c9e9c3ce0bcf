#!/bin/bash
# The GPU TTFT run (issue 7) on the team's lent H200, which has torch CUDA but no network, no
# vLLM/SGLang and no iproute2 of its own. Run from the repository root on that machine with $OUT
# set, after `bash bench/gpu_carry.sh` here and carrying [".whl", ".devcarry"]:
#   .whl/                  transformers==5.24.0 (our pin; the machine has an older one)
#   .devcarry/wheels312/   `pip download --no-deps --only-binary=:all: --python-version 3.12` of our
#                          dependencies the machine lacks (fastapi, starlette, opentelemetry-api,
#                          uvicorn, httptools, h11, pydantic(+core), zeroconf, ifaddr, sqlmodel,
#                          sqlalchemy, greenlet, alembic, mako, argon2-cffi(+bindings, cffi),
#                          itsdangerous, babel, python-multipart, annotated-*, typing-*, anyio)
#   .devcarry/tok/         the embedded model's tokenizer files
#   .devcarry/ipr/         Debian's iproute2: LINK=shaped runs P and D in network namespaces joined
#                          by a tbf-shaped veth pair (RATE MB/s, default 85), as on the CPU machine
# The converted model (260 MB) does not fit a call, so the run builds a random-weight model with
# SmolLM2-135M's exact config: timing is what is measured, not text. Agent A: torch on CUDA
# (FP16); agent B: torch on the CPU (GPUs hidden); each pinned to one core.
# Results of the last run: bench/results/gpu-h200-*. Extra bench options: EXTRA="--cores-per-agent 4".
# PROBE=744,2844,8160 first runs bench/gpu_prefill_export.py (CHUNKS=256,2048 to compare chunk sizes, PROBE_REPS=5); CUDA_TESTS=1 runs tests/system/test_cuda.py;
# RUN=script.py runs that script (argument: the model directory) instead of the benchmark;
# FOREGROUND=SECONDS runs the benchmark in the call (at most that long) instead of leaving it running.
set -e
REPO=$PWD
rm -rf /tmp/site  # a warm machine keeps the last call's
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .devcarry/wheels312/*.whl
export PYTHONPATH=/tmp/site:$REPO
PY=$(python3 -c 'import sys;print(sys.executable)')
printf "#!$PY\nfrom tandem_cli.main import main\nmain()\n" > "$(dirname "$PY")/tandem"; chmod +x "$(dirname "$PY")/tandem"
python3 - <<'PYEOF'
from pathlib import Path
from tests.conftest import make_tiny_checkpoint
make_tiny_checkpoint(Path('/tmp/smolrand'), 'llama', Path('.devcarry/tok'), seed=1, hidden_size=576,
    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    rope_theta=100000.0, rms_norm_eps=1e-5, vocab_size=49152, max_position_embeddings=8192,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.02)
PYEOF
if [ "${LINK:-loopback}" = shaped ]; then  # `ip` and `tc` from the carried debs, their libraries for them alone
  for f in .devcarry/ipr/*.deb; do dpkg -x "$f" /tmp/ipr; done
  for t in bin/ip sbin/tc; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/ipr/usr/lib/x86_64-linux-gnu:/tmp/ipr/lib/x86_64-linux-gnu exec /tmp/ipr/%s "$@"\n' "$t" > /usr/local/bin/$(basename $t)
    chmod +x /usr/local/bin/$(basename $t)
  done
  tc -V
fi
python3 -c "import tandem_cli.main, node_agent.app, control_panel.ui; print('imports ok')"
[ -n "$PROBE" ] && python3 bench/gpu_prefill_export.py --model /tmp/smolrand --lengths "$PROBE" ${CHUNKS:+--chunks $CHUNKS} --reps ${PROBE_REPS:-5} | tee "$OUT/export.txt"
[ -n "$RUN" ] && { python3 "$RUN" /tmp/smolrand | tee "$OUT/run-script.txt"; exit 0; }  # a scratch script instead of the bench
[ -n "$CUDA_TESTS" ] && TANDEM_TOKENIZER_DIR=.devcarry/tok python3 -m pytest -q tests/system/test_cuda.py 2>&1 | tail -3 | tee "$OUT/test_cuda.txt"
bench() {
  TANDEM_HOME=/tmp/th "$@" "$(dirname "$PY")/tandem" bench ttft --model /tmp/smolrand --prefill torch --decode torch \
    --b-cpu-only --direction a2b --link "${LINK:-loopback}" ${RATE:+--rate $RATE} --lengths "${LENGTHS:-51,184,744,2844,8160}" --samples "${SAMPLES:-3}" --warmup 1 \
    --out "$OUT" ${EXTRA:-} > "$OUT/bench.log" 2>&1
}
if [ -n "$FOREGROUND" ]; then bench timeout "$FOREGROUND" || true; echo done; else bench nohup & echo started; fi
