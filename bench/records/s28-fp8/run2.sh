#!/usr/bin/env bash
# Twenty-eighth session, call 2 (one H200): FP8 convergence over a full 500 steps (call 1's
# 32,768-token steps ran out of time at 339 bf16 steps): the same 112M Llama shape, data and
# validation as run1.sh, 16,384 tokens a step. Runs: bf16 and fp8 on the planner's plan, then a
# second bf16 run that differs only in its rounds per step (--rounds 1: the same batches and
# maths, other summation orders), so the record shows how far two bf16 runs drift apart by
# rounding alone: the noise floor any fp8-vs-bf16 gap is read against.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
STD=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
mkdir -p /tmp/stdlib
i=0; for f in $(find $STD -name "*.py" -not -path "*/test/*" -not -path "*/tests/*" -not -path "*/site-packages/*" | sort); do
  i=$((i+1)); cp "$f" /tmp/stdlib/$(printf %05d $i).txt; done
echo "text: $i files, $(cat /tmp/stdlib/*.txt | wc -c) bytes from $STD"
M=$PWD/bench/records/s28-fp8/m112.json
run() {  # name limit_s precision [extra flags]
  local name=$1 lim=$2 pr=$3; shift 3
  left=$((565 - (SECONDS - T0))); [ $left -lt $lim ] && lim=$left
  (cd /tmp && timeout $lim dataflow-demo 16 16 1024 $M --tokens-per-step 16384 --steps 500 --data /tmp/stdlib --eval-every 10 --eval-seqs 64 --precision $pr "$@" --json > $OUT/conv-$name.json 2> /tmp/conv-$name.log)
  echo "conv $name rc $? at $((SECONDS-T0)) s"; grep -E "^summary|rror" /tmp/conv-$name.log | head -3 | cut -c1-200
}
run bf16 230 bf16
run fp8 170 fp8
run bf16r1 200 bf16 --rounds 1
head -30 /tmp/conv-fp8.log > $OUT/conv-fp8-head.log; grep -E "^summary|^Chunking" /tmp/conv-*.log >> $OUT/conv-fp8-head.log
python3 -m dataflow.bench.fp8_convergence $OUT/conv-bf16.json $OUT/conv-fp8.json --out $OUT --name fp8_convergence
python3 -m dataflow.bench.fp8_convergence $OUT/conv-bf16.json $OUT/conv-bf16r1.json --out $OUT --name bf16_rounds1_noise_floor
rm -f $OUT/conv-*.json  # the records hold the curves
