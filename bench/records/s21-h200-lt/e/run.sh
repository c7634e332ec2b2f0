#!/usr/bin/env bash
# Twenty-first session, call E (1 GPU): why the demo's expert ops take ~40 % longer than the bench's loop.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/.whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
cd .gpu/new; export PYTHONPATH=$PWD:/tmp/site; C=$(cat COMMIT); echo "tree $C"; T0=$SECONDS
R=$OUT/r; rm -rf $R; mkdir -p $R
pack() { (cd $OUT && tar czf all.tgz r); }
for a in "" "--as-engine"; do
  timeout 60 python3 -m dataflow.bench.moe_experts_bench olmoe-1b-7b --tokens 16384 $a --out $R/moe-bench$a.json > $R/moe-bench$a.log 2>&1
  echo "moe bench $a rc $? at $((SECONDS-T0)) s"; tail -5 $R/moe-bench$a.log
done
pack
timeout 150 /tmp/site/bin/py-spy record --idle --threads --rate 100 --format raw -o $R/pyspy.txt -- python3 -m dataflow.bench.demo 120 24 8192 olmoe-1b-7b --steps 1 > $R/demo-pyspy.log 2>&1
echo "pyspy demo rc $? at $((SECONDS-T0)) s"; grep -E "^step 1:" $R/demo-pyspy.log | cut -c1-250
python3 - $R/pyspy.txt <<'PY'
import collections, sys
leaf, inc, tot = collections.Counter(), collections.Counter(), 0
for line in open(sys.argv[1]):
    st, _, n = line.rstrip("\n").rpartition(" ")
    n = int(n); fr = st.split(";")
    if "MainThread" not in fr[0] or not any("Executor.step" in f for f in fr): continue
    tot += n; leaf[fr[-1]] += n
    for f in set(fr): inc[f] += n
print("main-thread samples in Executor.step", tot)
for f, n in leaf.most_common(12): print(f"{100*n/tot:6.1f}% leaf {f[:150]}")
for f, n in inc.most_common(40):
    if any(k in f for k in ("moe", "experts", "launch", "_wait", "offsets", "Ffn")): print(f"{100*n/tot:6.1f}% incl {f[:150]}")
PY
pack; rm -rf $R
