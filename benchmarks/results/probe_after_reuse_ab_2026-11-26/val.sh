#!/bin/bash
# val.sh ROUND: validate the round's two probe files on the same runs, SmolLM2 and the random Llama
r=$1
for m in smollm2 random-llama; do
  python -c "from flexplan.calibration.stream import stream_triad_bytes_per_s as t; print('triad before', round(t(128*2**20, repeats=3)/1e9,1))"
  flexplan validate --model $m --grid "b=1,4,8 i=32,128 o=16,64" --repeats 3 --no-warm --no-plot \
     --calibrations on=/tmp/abr/on_$r.yaml,off=/tmp/abr/off_$r.yaml --out /tmp/abr/pv-$r-$m 2>&1 | grep -v Warn | grep -E "calibration '(on|off)'|spread"
done
