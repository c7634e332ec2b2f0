#!/usr/bin/env bash
# Thirty-seventh session, call 5 (the budget's last ~390 s): the ring's GPU tests, the new
# overlapped-rounds one among them (CuPy ranks sharing the GPU over shared memory), one log.
set -uo pipefail
source bench/records/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ring -rs > $OUT/gpu-ring.log 2>&1
echo "rc $? at $SECONDS s"; tail -6 $OUT/gpu-ring.log
