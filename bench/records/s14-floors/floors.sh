#!/usr/bin/env bash
# The ceilings of the latest recorded run of each tracked cell (CPU only; reads the records).
R=bench/records
python -m bench.floors --out $R/s14-floors/floors.json \
  $R/s14-h100-cd7016f/demo-8b-8k-cd7016f.json:10000 \
  $R/s14-h100-72e67c3/demo-8b-8k-deferred-72e67c3.json:10000 \
  $R/s13-final-h100-cb56c17/demo-8b-8k-cb56c17.json:10000 \
  $R/s13-final-h100-cb56c17/demo-1b-8k-cb56c17.json:50000 \
  $R/s13-final-h100-3cca050/demo-15b-8k-3cca050.json:5000 \
  $R/s14-h100-d2bba44/bt/8b-s65536-h96-d30.demo.json:5100 \
  $R/s13-final-h100-cb56c17/bt/8b-s65536-h96-d30.demo.json:5100 \
  $R/s14-final-h100-8f6187e/bt/8b-s131072-h120-d24.demo.json:3400 \
  $R/s14-h100-cd7016f/bt/8b-s131072-h120-d24.demo.json:3400 \
  $R/s13-h100-6b7f5ac/bt/8b-s131072-h120-d24.demo.json:3400 \
  $R/s14-h100-d2bba44/bt/8b-s262144-h120-d24.demo.json:1700 \
  $R/s13-segments-h100-8cf2184/bt/8b-s262144-h120-d24.demo.json:1700 \
  $R/s13-524k-h100-4dc253f/8b-s524288-h120-d24.demo.json \
  $R/budget-truth-h100/1b-s1048576-h120-d24-8a5125d.demo.json
