#!/usr/bin/env bash
# Run on the GPU machine (device tool) with the cp312 Mooncake wheel carried in .whl-mc (and, should the image
# lack them, its runtime libraries in .whl-mc/lib): TTFT of prefixes another instance put to the remote tier,
# against recompute (ttft), and kvtier's put / fetch GB/s against Mooncake's raw calls (bench).
# Usage: bash bench/run_remote_device.sh [ttft|bench|all]   (results under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
pip install --no-deps --no-index --target /tmp/mcpkg .whl-mc/*.whl >/dev/null || exit 1
export PYTHONPATH=$PWD:/tmp/mcpkg PATH=/tmp/mcpkg/bin:$PATH LD_LIBRARY_PATH=$PWD/.whl-mc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export GLOG_minloglevel=1
WHAT=${1:-all}
status=0
if [ "$WHAT" = ttft ] || [ "$WHAT" = all ]; then
  python3 bench/bench_remote_ttft.py --out "$OUT/remote_ttft_h200.json" 2>&1 | grep -v "^[IW][0-9]" \
    | tee "$OUT/remote_ttft_h200.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  python3 bench/bench_remote.py --out "$OUT/remote_h200.json" 2>&1 | grep -v "^[IW][0-9]" | tee "$OUT/remote_h200.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit $status
