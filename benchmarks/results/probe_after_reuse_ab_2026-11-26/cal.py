"""python cal.py on|off OUT [--check]: the first-use probe with microbench.PROBE_REUSE_AFTER on
(a row's after-readings are its before-readings when those are at most PROBE_REUSE_S old) or off
(every row reads the probes after its runs); needs `knob.diff` applied (not in the code). --check: where a reading is reused, also probe afresh
and print the ratio fresh / reused per probe."""
import math
import statistics
import sys
import time

from flexplan.calibration import microbench as mb
from flexplan.calibration.cli import calibrate

mb.PROBE_REUSE_AFTER = sys.argv[1] == "on"
ratios = []
if "--check" in sys.argv:
    orig = mb._probe_now

    def checked(reuse_s=0.0):
        age = time.perf_counter() - mb._last_reading["at"]
        if reuse_s > 0 and age <= reuse_s:
            reused = dict(mb._last_reading["values"])
            fresh = orig(0.0)
            ratios.append((age, {k: fresh[k] / reused[k] for k in fresh.keys() & reused.keys()}))
            return reused
        return orig(reuse_s)
    mb._probe_now = checked
t = time.perf_counter()
res = calibrate(mode="probe", out=sys.argv[2], progress=False)
print(f"{sys.argv[1]} {sys.argv[2]}: {time.perf_counter() - t:.1f} s")
if ratios:
    ages = [a for a, _ in ratios]
    print(f"reused readings: {len(ratios)}, age median {statistics.median(ages):.3f} s, max {max(ages):.3f}")
    for k in ratios[0][1]:
        v = [r[k] for _, r in ratios if k in r]
        print(f"  {k}: fresh/reused median {statistics.median(v):.3f}, |log| median "
              f"{statistics.median(abs(math.log(x)) for x in v):.3f}, min {min(v):.3f} max {max(v):.3f}")
