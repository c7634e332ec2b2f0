#!/usr/bin/env bash
# Twenty-third session (issue 50, the restructure), one H200: the rope GPU tests the first
# `pytest -m gpu` found failing (fixed since), then the demo on the merged tree (8b 80/24 8k and
# olmoe-1b-7b 120/24 8k, 2 steps each) and olmoe on the base tree 7ee289c (.gpu/old) in the same
# call, so the restructure's speed is compared on one machine. Logs and JSON under $OUT.
# Usage: run.sh [RUN ...] with RUN in olmoe-old, olmoe-new, 8b-old, 8b-new (default: the last
# three but 8b-old). Call 1 ran the default, the trees installed by pip --target then (the
# old one silently did not: its olmoe-old failed); call 2 `run.sh tests olmoe-new olmoe-old`
# (`tests` first: the whole `pytest -m gpu` on the merged tree, 132affb; olmoe-old failed again:
# run from the checkout, `python -m` found the checkout's dataflow/ first); call 3
# `run.sh olmoe-old olmoe-new`, each run from /tmp.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
# each tree laid out as setup.py installs it (memplan/ -> dataflow/memplan/, ...) in a folder of
# its own; PYTHONPATH picks one per run
lay() {  # tree-root dest
    mkdir -p $2 && cp -r $1/dataflow $2/dataflow
    for sub in memplan kernels ring models bench; do cp -r $1/$sub $2/dataflow/$sub; done
}
lay . /tmp/new; lay .gpu/old /tmp/old
DEMO_new=dataflow.cli.demo DEMO_old=dataflow.bench.demo
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
T0=$SECONDS
if [ "${1:-}" = tests ]; then  # the whole GPU suite on the merged tree first
    shift
    PYTHONPATH=/tmp/new:/tmp/site timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
        --timeout 240 tests > $OUT/gpu-tests.log 2>&1
    echo "pytest -m gpu rc $? at $((SECONDS-T0)) s: $(tail -1 $OUT/gpu-tests.log)"
    grep -E "^(FAILED|ERROR)" $OUT/gpu-tests.log | head -20
else
    PYTHONPATH=/tmp/new:/tmp/site timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/kernels/test_rope_scaling_gpu.py tests/kernels/test_cuda_ops.py -k rope 2>&1 | tail -2
fi
demo() {  # name tree(new|old) demo-args...
    local name=$1 v=$2; shift 2
    local demo=DEMO_$v
    # from /tmp: in the checkout, `python -m` would find its dataflow/ folder before PYTHONPATH's
    (cd /tmp && PYTHONPATH=/tmp/$v:/tmp/site timeout ${LIMIT:-200} python3 -m ${!demo} "$@" \
        --steps 2 --json > $OUT/$name.json 2> $OUT/$name.log)
    echo "$name rc $? at $((SECONDS-T0)) s"
}
runs=("$@"); [ ${#runs[@]} -eq 0 ] && runs=(olmoe-old olmoe-new 8b-new)
for run in "${runs[@]}"; do
    case $run in
        olmoe-*) demo $run ${run#olmoe-} 120 24 8192 olmoe-1b-7b ;;
        8b-*) LIMIT=$((560 - (SECONDS - T0) - 30)) demo $run ${run#8b-} 80 24 8192 8b ;;
    esac
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
print(f"{'run':<10} {'step 2 tok/s':>12} {'loss 1':>9} {'loss 2':>9} {'grad norm 2':>11}")
for name in sorted(f[:-5] for f in os.listdir(out) if f.endswith(".json")):
    try:
        s = json.load(open(f"{out}/{name}.json"))["steps"]
        print(f"{name:<10} {s[-1]['tok_per_s']:>12,.0f} {s[0]['loss']:>9.5f} {s[-1]['loss']:>9.5f} "
              f"{s[-1]['grad_norm']:>11.5f}")
    except Exception as e:  # noqa: BLE001 - a failed run prints its reason and the table goes on
        print(f"{name:<10} failed: {e!r}"[:200])
PY
