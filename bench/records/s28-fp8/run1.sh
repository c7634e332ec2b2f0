#!/usr/bin/env bash
# Twenty-eighth session, call 1 (one H200): FP8 convergence, three runs of the 112M Llama shape
# (m112.json: width 1,024, 10 layers, byte level) from one seed, 500 steps of 32,768 tokens at
# seqlen 1,024 on real text: the image's Python standard library sources, one file = one record
# (a folder of .txt files, so the demo's packed corpus shuffles records by seed each epoch,
# unlike s26's one concatenated file read in order), validated every 10 steps on 64 held-out
# sequences (65,536 tokens; the last files, never trained on). Runs: bf16; fp8 (the recipe:
# E4M3 forward, E5M2 output gradients); fp8 with E4M3 output gradients too (an experiment: the
# device copy's ops_cuda_fp8.py edited in place, last).
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
run() {  # name precision
  (cd /tmp && timeout 190 dataflow-demo 16 16 1024 $M --tokens-per-step 32768 --steps 500 --data /tmp/stdlib --eval-every 10 --eval-seqs 64 --precision $2 --json > $OUT/conv-$1.json 2> /tmp/conv-$1.log)
  echo "conv $1 rc $? at $((SECONDS-T0)) s"; grep -E "^summary|rror" /tmp/conv-$1.log | head -3 | cut -c1-200
}
run bf16 bf16
run fp8 fp8
sed -i 's/"e5m2"/"e4m3"/g' dataflow/ops_cuda_fp8.py; grep -c e4m3 dataflow/ops_cuda_fp8.py
run fp8e4 fp8
git checkout dataflow/ops_cuda_fp8.py 2>/dev/null
head -30 /tmp/conv-fp8.log > $OUT/conv-fp8-head.log; grep -E "^summary|validation loss" /tmp/conv-*.log | tail -12 >> $OUT/conv-fp8-head.log
python3 -m dataflow.bench.fp8_convergence $OUT/conv-bf16.json $OUT/conv-fp8.json --out $OUT --name fp8_convergence
python3 -m dataflow.bench.fp8_convergence $OUT/conv-bf16.json $OUT/conv-fp8e4.json --out $OUT --name fp8e4m3_convergence
rm -f $OUT/conv-*.json  # the records hold the curves
