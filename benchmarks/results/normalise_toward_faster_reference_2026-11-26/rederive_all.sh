#!/bin/bash
# rederive_all.sh TAG: re-derive kept runs 7-14 with the working tree's code
cd "$(dirname "$0")/../.."
for r in 7 8 9 10 11 12 13 14; do
  echo "== run $r"
  python rederive_cycles.py results/calibration_cycles_avx512_run$r-files --name /tmp/rd_$1_run$r 2>&1 | grep -E "^(smollm2|random-llama) "
done
