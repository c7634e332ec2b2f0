#!/usr/bin/env bash
# The planner's JSON for 10 cells (dataflow-plan --json on PATH); run before and after the restructure (issue 50): diff -r before after is empty.
out=$1; mkdir -p "$out"
run() { name=$1; shift; dataflow-plan "$@" --json > "$out/$name.json" 2> "$out/$name.err"; echo "$name rc=$?"; }
run 8b-8k-h200      80 24 8192 8b --gpu h200
run 1b-8k-h100      40 16 8192 1b
run 8b-64k-h200     100 24 65536 8b --gpu h200
run tiny-cpu        2 0.25 256 tiny --gpu cpu
run olmoe-8k-h200   120 24 8192 olmoe-1b-7b --gpu h200
run qwen3moe-8k     180 90 8192 qwen3-30b-a3b --gpu h200
run 8b-8k-2gpu      60 24 8192 8b --gpu h200 --gpus 2
run 8b-8k-4gpu-tps  30 24 8192 8b --gpu h200 --gpus 4 --tokens-per-step 1048576
run olmoe-2gpu      95 90 8192 qwen3-30b-a3b --gpu h200 --gpus 2
run 32b-16k-h100  240 40 16384 32b
