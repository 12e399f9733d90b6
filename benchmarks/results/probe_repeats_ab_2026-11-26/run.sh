set -u
cd /work/main
for round in a b; do
  if [ $round = a ]; then order="3 7"; else order="7 3"; fi
  for r in $order; do python /tmp/rab/probe_ab.py $r /tmp/rab/probe-r$r-$round.yaml 2>&1 | tail -1; done
  for m in smollm2 random-llama; do
    python -m flexplan validate --model $m --grid "b=1,4,8 i=32,128 o=16,64" --repeats 3 --no-warm --no-plot \
      --calibrations r3=/tmp/rab/probe-r3-$round.yaml,r7=/tmp/rab/probe-r7-$round.yaml --out /tmp/rab/v-$round-$m > /tmp/rab/pv-$round-$m.txt 2>&1
    echo "$round $m rc $?"; grep "calibration 'r" /tmp/rab/pv-$round-$m.txt
  done
done
