#!/usr/bin/env bash
# Written in the thirty-second session (no GPU was lent after its call 1; for the next session):
# guessed FP8 scales (DATAFLOW_FP8_SCALES=guessed, 717eb5b+). The FP8 GPU tests, the ring's
# CuPy tests (split updates, vocabulary-parallel head);
# then the 112M shape of the twenty-eighth session's convergence run, 150 steps of real text in
# fp8 with guessed and with current scales (their losses bit for bit: guessing must not move a
# bit; and the share of guesses that held); then the 8b pair at 8192 in 80/24 through bench.budget_truth
# (NVML and RSS sampled), fp8 guessed beside its bf16 twin, then fp8 current where time is left.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
export DATAFLOW_FP8_SCALES=guessed  # (the engine test sets it itself)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs tests/kernels/test_fp8_cuda.py tests/dataflow/test_gpu_precision_fp8.py > $OUT/gpu-tests.log 2>&1
rc=$?
echo "pytest rc $rc at $((SECONDS-T0)) s: $(tail -1 $OUT/gpu-tests.log)"
grep -E "^FAILED|^ERROR|Error" $OUT/gpu-tests.log | head -12 | cut -c1-300
[ $rc -eq 0 ] || { tail -60 $OUT/gpu-tests.log | cut -c1-240; exit 1; }
# the ring's CuPy paths of the same session (split updates and the vocabulary-parallel head on
# one GPU over shared memory), also written without a GPU: their own log, not a stop
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs tests/kernels/test_cuda_sumsq_blocks.py tests/kernels/test_cuda_vocab_head.py tests/ring/test_ring_gpu_split.py tests/ring/test_ring_gpu_vocab.py > $OUT/gpu-tests-ring.log 2>&1
echo "ring pytest rc $? at $((SECONDS-T0)) s: $(tail -1 $OUT/gpu-tests-ring.log)"
grep -E "^FAILED|^ERROR" $OUT/gpu-tests-ring.log | head -8 | cut -c1-240
STD=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
mkdir -p /tmp/stdlib
i=0; for f in $(find $STD -name "*.py" -not -path "*/test/*" -not -path "*/tests/*" -not -path "*/site-packages/*" | sort); do
  i=$((i+1)); cp "$f" /tmp/stdlib/$(printf %05d $i).txt; done
echo "text: $i files, $(cat /tmp/stdlib/*.txt | wc -c) bytes from $STD"
M=$PWD/bench/records/s28-fp8/m112.json
for scales in guessed current; do  # the same run both ways: guessing must not move a bit
  (cd /tmp && DATAFLOW_FP8_SCALES=$scales timeout 120 dataflow-demo 16 16 1024 $M --tokens-per-step 16384 --steps 150 --data /tmp/stdlib --precision fp8 --json > $OUT/m112-$scales.json 2> /tmp/m112-$scales.log)
  echo "m112 fp8 $scales rc $? at $((SECONDS-T0)) s"; grep -E "^summary|rror|fp8 scales" /tmp/m112-$scales.log | head -4 | cut -c1-200
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
try:
    g, c = (json.load(open(f"{out}/m112-{k}.json")) for k in ("guessed", "current"))
    old = json.load(open("bench/records/s28-fp8/call2/fp8_convergence.json"))["fp8_losses"]
    lg, lc = ([s["loss"] for s in d["steps"]] for d in (g, c))
    first = next((i + 1 for i, (a, b) in enumerate(zip(lg, lc)) if a != b), None)
    print(f"m112 fp8: {len(lg)} / {len(lc)} steps guessed / current; first step where they "
          f"differ: {first} (None: bit for bit); fp8_scales {g.get('fp8_scales')}; "
          f"current's fp8_scales {c.get('fp8_scales')} (None expected)")
    print(f"  against s28's curve: {sum(a == b for a, b in zip(lc, old))} of {len(lc)} equal "
          f"(plan hash now {c['plan_hash']})")
except Exception as e:  # noqa: BLE001
    print(f"m112 summary failed: {e!r}"[:300])
PY
for run in fp8:guessed bf16:current fp8cur:current; do  # the last where time is left
  name=${run%%:*}; pr=${name%cur}; scales=${run##*:}
  left=$((575 - (SECONDS - T0)))
  [ $left -gt 100 ] || break
  DATAFLOW_FP8_SCALES=$scales timeout $((left - 5)) python3 -m dataflow.bench.budget_truth --steps 2 --timeout $((left - 15)) --precision $pr --out $OUT/$name 8b:8192:80:24 2>&1 | tail -2 | tee -a $OUT/bt.log
  rm -f $OUT/$name/*.log
done
python3 - <<'PY'
import glob, json, os
out = os.environ["OUT"]
for f in sorted(glob.glob(f"{out}/*/*.demo.json")):
    try:
        d = json.load(open(f))
        s = d["steps"][-1]
        print(f"{f.split('/')[-2]:<5} step {s['step']} {s['tok_per_s']:>9,.0f} tok/s pred "
              f"{d['plan']['prediction']['tok_per_s']:>9,.0f} fp8_scales {d.get('fp8_scales')}")
    except Exception as e:  # noqa: BLE001
        print(f"{f}: {e!r}"[:200])
PY
