#!/bin/bash
# The first device run (issue 40): versions, install from carried wheels, tiny families on
# the GPU against the CPU. Writes into $OUT (default /tmp/out).
# The wheels the device image lacks are downloaded here first, into .gpu_wheels (listed in
# .git/info/exclude) and carried with the run (carry: [".gpu_wheels"]):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu_wheels \
#     pyzmq gguf llguidance fastapi starlette uvicorn msgspec
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi; python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())"; } > "$OUT/env.txt" 2>&1
{ python3 -m pip install --no-deps --no-index .gpu_wheels/*.whl \
  && python3 -m pip install --no-deps --no-build-isolation -e . \
  && python3 -c "import xlm; print('import xlm ok')"; } > "$OUT/install.txt" 2>&1
timeout 300 python3 benchmarks/gpu/first_run.py > "$OUT/first_run.jsonl" 2> "$OUT/first_run.err"
echo "first_run rc=$?" >> "$OUT/install.txt"
tail -c 3000 "$OUT/first_run.err"; cat "$OUT/first_run.jsonl" | cut -c1-600
