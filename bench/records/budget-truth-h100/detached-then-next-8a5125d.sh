#!/usr/bin/env bash
# wait for the detached cell run31 started (WAIT1 s), copy it to $OUT/first, then run31 with START/WAIT
set -uo pipefail
end=$((SECONDS + ${WAIT1:-0}))
while [ $SECONDS -lt $end ] && [ ! -f /tmp/bt.done ]; do sleep 10; done
mkdir -p $OUT/first
for f in /tmp/bt/*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "^step [0-9]|initialised|Error|error|Killed" "$f" | cut -c1-200 | tail -4; }; done
[ -f /tmp/bt.done ] && echo "first done rc $(cat /tmp/bt.done)"
cp /tmp/bt/*.json /tmp/bt/*.log $OUT/first/ 2>/dev/null
[ -f /tmp/bt.done ] || exit 0
bash .gpu/run31.sh
