T='from flexplan.calibration.stream import stream_triad_bytes_per_s as t; print("triad", round(t(128*2**20, repeats=3)/1e9,1))'
for r in a b; do
  date; python -c "$T"
  if [ $r = a ]; then python "$(dirname "$0")"/cal.py 4 /tmp/abq/c4_$r.yaml; python "$(dirname "$0")"/cal.py 1 /tmp/abq/c1_$r.yaml
  else python "$(dirname "$0")"/cal.py 1 /tmp/abq/c1_$r.yaml; python "$(dirname "$0")"/cal.py 4 /tmp/abq/c4_$r.yaml; fi
  for m in smollm2 random-llama; do
    python -c "$T"
    flexplan validate --model $m --grid "b=1,4,8 i=32,128 o=16,64" --repeats 3 --no-warm --no-plot \
      --calibrations c4=/tmp/abq/c4_$r.yaml,c1=/tmp/abq/c1_$r.yaml --out /tmp/abq/pv-$r-$m 2>&1 | grep -v Warn | grep -E "calibration '(c4|c1)'|spread"
  done
done
date
