#!/bin/bash
# Builds what bench/gpu_ttft_run.sh needs carried to the lent GPU machine (Python 3.12, torch CUDA,
# no network, no iproute2): run here from the repository root after `make setup` and
# `tandem model fetch`; then carry [".whl", ".devcarry"] (both git-ignored, ~40 MB together).
#   .whl/                 transformers (our pin; the machine has an older one)
#   .devcarry/wheels312/  our dependencies the machine lacks, at the versions .venv holds
#   .devcarry/tok/        the embedded model's tokenizer files
#   .devcarry/ipr/        Debian's iproute2 and its libraries, unpacked there for `ip` and `tc`
#                         (netns + tbf work on that machine as root)
set -euo pipefail
cd "$(dirname "$0")/.."
PLAT="--platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
fetch() {  # fetch DIR NAME... at .venv's versions, wheels for CPython 3.12
  local dir=$1; shift; local specs=()
  for n in "$@"; do specs+=("$n==$(version "$n")"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLAT -d "$dir" "${specs[@]}" 2>&1 | grep -v "is ignored" || true
}
rm -rf .whl .devcarry/wheels312 .devcarry/tok .devcarry/ipr
fetch .whl transformers  # only it: the machine's tokenizers, huggingface-hub and safetensors suit it
fetch .devcarry/wheels312 fastapi starlette uvicorn httptools h11 pydantic pydantic-core zeroconf ifaddr \
  sqlmodel sqlalchemy greenlet alembic mako argon2-cffi argon2-cffi-bindings cffi pycparser itsdangerous \
  babel python-multipart annotated-types annotated-doc typing-extensions typing-inspection anyio zstandard \
  xxhash opentelemetry-api aiohttp multidict yarl propcache frozenlist aiosignal attrs aiohappyeyeballs \
  uvloop pydantic-settings python-dotenv psutil llguidance cryptography
python3 bench/trim_babel_wheel.py .devcarry/wheels312/babel-*.whl  # the carry is 64 MiB at most
mkdir -p .devcarry/tok
model=$(.venv/bin/python -c "from engine_adapters.embedded_model import model_dir; from tandem_protocol.settings import data_dir; print(model_dir(data_dir()))")
cp "$model"/tokenizer* "$model"/special_tokens_map.json "$model"/chat_template* .devcarry/tok/ 2>/dev/null || true
mkdir -p .devcarry/ipr && (cd .devcarry/ipr && apt-get download -q iproute2 libbpf1 libelf1 libmnl0 libcap2 \
  libxtables12 libtirpc3 libbsd0 libmd0 libdb5.3 libselinux1 libpcre2-8-0 libgssapi-krb5-2 libkrb5-3 \
  libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1 libzstd1 zlib1g >/dev/null 2>&1)
du -sh .whl .devcarry
