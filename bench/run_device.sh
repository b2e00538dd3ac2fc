#!/usr/bin/env bash
# Run on the GPU machine (device tool): install carried sglang wheels, then the transfer benchmark.
# Usage: bash bench/run_device.sh [sections] [extra bench_transfer args]
# The wheels come from the carried folder $KVTIER_WHEELS (default .whl; .whl-sgl, which tests/gpu_sglang.sh fills,
# holds them too).
set -uo pipefail
export PYTHONUNBUFFERED=1
WHEELS=${KVTIER_WHEELS:-.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.txt"
python3 bench/bench_transfer.py --out "$OUT/transfer_h200.json" --sections "${1:-sizes,gemm,bidir,latency,overhead,sweep}" ${2:-} 2>&1 | tee "$OUT/bench.log"
