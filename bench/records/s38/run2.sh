#!/usr/bin/env bash
# Thirty-eighth session, call 3: the ring's GPU tests with the vocabulary-parallel head, the
# overlapped rounds and the split update now over rings (replicas) of 2, 3 and 4 ranks sharing
# the GPU. One log in one tar.
set -uo pipefail
source bench/records/device_setup.sh
R=/tmp/s38c3; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt
timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ring/test_ring_gpu_vocab.py tests/ring/test_ring_gpu_overlap.py tests/ring/test_ring_gpu_split.py -rs --durations=15 > $R/gpu-ring.log 2>&1
echo "rc $? at $SECONDS s"; grep -E "passed|failed|^FAILED" $R/gpu-ring.log | tail -8
tar czf $OUT/call3.tgz -C /tmp s38c3
