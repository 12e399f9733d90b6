"""python cal.py REUSE_S OUT [--check]: the first-use probe with microbench.PROBE_REUSE_S = REUSE_S.
--check: where a reading is reused, also probe afresh and print the ratio fresh / reused per probe."""
import sys, time, math
from flexplan.calibration import microbench as mb
from flexplan.calibration.cli import calibrate
mb.PROBE_REUSE_S = float(sys.argv[1])
ratios = []
if "--check" in sys.argv:
    orig = mb._probe_now
    def checked(reuse_s=0.0):
        if reuse_s > 0 and time.perf_counter() - mb._last_reading["at"] <= reuse_s:
            age = time.perf_counter() - mb._last_reading["at"]
            reused = dict(mb._last_reading["values"])
            fresh = orig(0.0)
            ratios.append((age, {k: fresh[k] / reused[k] for k in fresh.keys() & reused.keys()}))
            return reused
        return orig(reuse_s)
    mb._probe_now = checked
t = time.perf_counter()
res = calibrate(mode="probe", out=sys.argv[2], progress=False)
print(f"{sys.argv[2]}: {time.perf_counter() - t:.1f} s")
if ratios:
    import statistics
    print("reused readings:", len(ratios), "age median %.3f s max %.3f" % (statistics.median(a for a, _ in ratios), max(a for a, _ in ratios)))
    for k in ratios[0][1]:
        v = [r[k] for _, r in ratios if k in r]
        print(f"  {k}: fresh/reused median {statistics.median(v):.3f}, |log| median {statistics.median(abs(math.log(x)) for x in v):.3f}, min {min(v):.3f} max {max(v):.3f}")
