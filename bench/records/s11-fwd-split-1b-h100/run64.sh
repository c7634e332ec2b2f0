#!/usr/bin/env bash
# session 11 call 5: the reverted split attention forward (tree 92e6411) at 1b dims (head dim 64, 16k chunks, 1M context)
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/.whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
G=$PWD/.gpu
cd .gpu/old; export PYTHONPATH=$PWD:/tmp/site; echo "tree $(cat COMMIT)"
timeout 400 python3 $G/fwdbench1b.py 2>&1 | tee $OUT/fwdbench1b-92e6411.txt | tail -8
