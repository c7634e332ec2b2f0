#!/usr/bin/env bash
# One device call: install carried wheels, run the GPU tests, then first light for the configs
# given as arguments. Logs under $OUT. Usage: bench/gpu_session.sh [tests] [CONFIG,...]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
python3 -c "import cupy, numba, ml_dtypes, cudnn; print('cupy', cupy.__version__, 'numba', numba.__version__)"
python3 -c "import pynvml, psutil, pyarrow" 2>&1 | tail -1
if [ "${1:-}" = "tests" ]; then
    shift
    python3 -m pytest -m gpu tests -q -x -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.log | tail -15
fi
if [ -n "${1:-}" ]; then
    python3 bench/archive/first_light.py --only "$1" --steps "${STEPS:-2}" --rounds "${ROUNDS:-4}" \
        --logdir $OUT --out $OUT/first-light.json
fi
