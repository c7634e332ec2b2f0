#!/usr/bin/env bash
# Twenty-sixth session, call 4 (one H200): the FP8 GPU tests (with operand reuse), the convergence
# pair (a 112M-parameter Llama shape, bench/records/s26-fp8/m112.json, byte-level, 500 steps of
# 32,768 tokens at seqlen 1024 on real text: the image's Python standard library sources, ~10 MB
# as it came out (20 MB asked): read ~1.6 times over; bf16 and fp8 from one seed), then `run.sh`'s pairs given as args.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/dataflow/test_gpu_precision_fp8.py tests/kernels/test_fp8_cuda.py > $OUT/t_fp8.log 2>&1
echo "fp8 tests rc $? at $((SECONDS-T0)) s"; grep -E "passed|failed|^FAILED|^E " $OUT/t_fp8.log | head -8 | cut -c1-220
STD=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
find $STD -name "*.py" -not -path "*/test/*" | sort | xargs cat | head -c 20000000 > /tmp/stdlib.txt
echo "text: $(wc -c < /tmp/stdlib.txt) bytes from $STD"
M=$PWD/bench/records/s26-fp8/m112.json
for pr in bf16 fp8; do
  (cd /tmp && timeout 200 dataflow-demo 16 16 1024 $M --tokens-per-step 32768 --steps 500 --data /tmp/stdlib.txt --precision $pr --json > $OUT/conv-$pr.json 2> /tmp/conv-$pr.log)
  echo "conv $pr rc $? at $((SECONDS-T0)) s"; grep -E "^summary|rror" /tmp/conv-$pr.log | head -3 | cut -c1-200
done
head -40 /tmp/conv-fp8.log > $OUT/conv-fp8-head.log; grep -E "^summary" /tmp/conv-*.log >> $OUT/conv-fp8-head.log
python3 -m dataflow.bench.fp8_convergence $OUT/conv-bf16.json $OUT/conv-fp8.json --out $OUT
rm -f $OUT/conv-bf16.json $OUT/conv-fp8.json  # the record holds both curves
END=$((575 - (SECONDS - T0))) bash bench/records/s26-fp8/run.sh --no-tests "$@"
