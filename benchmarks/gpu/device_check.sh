#!/bin/bash
# Issue 40's prepared device run: install from the carried wheels, the GPU tests, then the
# measurements of device_check.py, each phase in its own process under its own time limit
# (a phase that runs out keeps the JSON lines it wrote). Output in $1 (default $OUT).
#   on the device:  bash benchmarks/gpu/device_check.sh            (carry: [".gpu_wheels"])
#   CPU dry run:    JAX_PLATFORMS=cpu bash benchmarks/gpu/device_check.sh DIR tiny
# Phase limits (seconds; decode's per variant) come from DEVICE_CHECK_LIMITS="xlm=170 ..."
# if set.
# The wheels the device image lacks, downloaded here first into .gpu_wheels:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 -d .gpu_wheels \
#     pyzmq gguf llguidance fastapi starlette uvicorn msgspec
OUT=${1:-${OUT:-/tmp/out}}; SHAPE=${2:-8b}; mkdir -p "$OUT"
declare -A LIMIT=([env]=15 [bandwidth]=15 [xlm]=230 [decode]=50 [torch]=110 [kernel]=50 [tests]=120)
for kv in $DEVICE_CHECK_LIMITS; do LIMIT[${kv%%=*}]=${kv#*=}; done
PY=${PYTHON:-python3}
if [ -d .gpu_wheels ] && [ "$SHAPE" != tiny ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_wheels/*.whl \
    > "$OUT/install.txt" 2>&1 && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# DEVICE_CHECK_PHASES picks and orders the phases (default all); "tests" runs pytest -m gpu
# (the kernels against the reference, the engine against transformers on the GPU: tests/gpu;
# they skip without a GPU, so the dry run leaves it out).
PHASES=${DEVICE_CHECK_PHASES:-env bandwidth xlm decode torch kernel tests}
[ "$SHAPE" = tiny ] && PHASES=${PHASES/tests/}
# "decode" runs the one-request decode once per XLA_FLAGS variant, one process each, the
# variants separated by "|" in DEVICE_CHECK_XLA_VARIANTS (its records carry xla_flags).
VARIANTS=${DEVICE_CHECK_XLA_VARIANTS:---xla_gpu_enable_command_buffer=}
for phase in $PHASES; do
  if [ "$phase" = tests ]; then
    # SIGINT at the limit: pytest then still prints the failures it has seen.
    JAX_PLATFORMS=cuda,cpu timeout -s INT -k 20 "${LIMIT[tests]}" $PY -m pytest -m gpu -n 0 \
      -q -rfE --tb=short -p no:cacheprovider tests/pallas_kernels tests/gpu > "$OUT/tests.log" 2>&1
  elif [ "$phase" = decode ]; then
    IFS='|' read -ra FLAGS <<< "$VARIANTS"
    for i in "${!FLAGS[@]}"; do
      XLA_FLAGS="${FLAGS[$i]}" timeout "${LIMIT[decode]}" $PY benchmarks/gpu/device_check.py \
        decode --shape "$SHAPE" --out "$OUT" > "$OUT/decode$i.log" 2>&1
      echo "{\"phase\": \"decode\", \"xla_flags\": \"${FLAGS[$i]}\", \"rc\": $?}" \
        >> "$OUT/device_check.jsonl"
    done
    continue
  else
    timeout "${LIMIT[$phase]}" $PY benchmarks/gpu/device_check.py "$phase" --shape "$SHAPE" \
      --out "$OUT" > "$OUT/$phase.log" 2>&1
  fi
  echo "{\"phase\": \"$phase\", \"rc\": $?}" >> "$OUT/device_check.jsonl"
done
cat "$OUT/device_check.jsonl"
