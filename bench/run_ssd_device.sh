#!/usr/bin/env bash
# Run on the GPU machine (device tool): the SSD store against the machine's disk and a RAM-backed directory, then
# TTFT of SSD-resident prefixes against recompute (a random Qwen3 at 8B shapes on CUDA graphs, 8 IO threads: the
# machine has 16 cores), admission by cost on and off.
# Usage: bash bench/run_ssd_device.sh [ssd|ttft|all]   (results under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
WHAT=${1:-all}
{ df -h / /var/tmp /dev/shm; free -g; nproc; } 2>&1 | tee "$OUT/disks.txt"
RAM=/dev/shm/kvtier-ssd
shm_gb=$(df --output=avail -BG /dev/shm | tail -1 | tr -dc 0-9)
if [ "${shm_gb:-0}" -lt 24 ]; then echo "/dev/shm has ${shm_gb} GiB: no RAM-backed runs"; RAM=""; fi
status=0
if [ "$WHAT" = ssd ] || [ "$WHAT" = all ]; then
  python3 bench/bench_ssd.py --dir /var/tmp/kvtier-ssd ${RAM:+--ram-dir $RAM} --reps 5 --out "$OUT/ssd_h200.json" 2>&1 \
    | tee "$OUT/ssd_h200.log" || status=1
fi
if [ "$WHAT" = ttft ] || [ "$WHAT" = all ]; then
  python3 bench/bench_ssd_ttft.py --dir /var/tmp/kvtier-ttft ${RAM:+--ram-dir ${RAM}-ttft} --ssd-io-threads 8 \
    --out "$OUT/ssd_ttft_h200.json" 2>&1 | tee "$OUT/ssd_ttft_h200.log" || status=1
fi
exit $status
