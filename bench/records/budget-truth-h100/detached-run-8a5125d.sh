#!/usr/bin/env bash
# a budget_truth cell that outlives one call: START=cell launches it detached (setsid), WAIT=s
# waits up to s seconds for it, then copies its record to $OUT
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/.whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
WATCH=$PWD/.gpu/watch
cd .gpu/new
export PYTHONPATH=$PWD:/tmp/site
echo "tree $(cat COMMIT) boot $(uptime -s)"
if [ -n "${START:-}" ]; then
  rm -rf /tmp/bt /tmp/bt.done; mkdir -p /tmp/bt
  PYTHONPATH=$WATCH:$PYTHONPATH DATAFLOW_WATCH=${WATCH_S:-30} setsid nohup bash -c "python3 -m bench.budget_truth --out /tmp/bt --steps 1 --timeout ${BT_TIMEOUT:-1100} $START > /tmp/bt/outer.log 2>&1; echo \$? > /tmp/bt.done" > /dev/null 2>&1 < /dev/null &
  echo "started $START"
fi
end=$((SECONDS + ${WAIT:-0}))
while [ $SECONDS -lt $end ] && [ ! -f /tmp/bt.done ]; do sleep 20; done
for f in /tmp/bt/*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "^step [0-9]|initialised|pinned|watch|Error|error|Killed" "$f" | cut -c1-200 | tail -${WL:-6}; }; done
[ -f /tmp/bt.done ] && echo "done rc $(cat /tmp/bt.done)"
cp -r /tmp/bt/. $OUT/ 2>/dev/null
true
