"""python cal.py COPIES OUT: calibrate --quick with microbench.PREFILL_COPIES = COPIES."""
import sys, time
from flexplan.calibration import microbench as mb
from flexplan.calibration.cli import calibrate
mb.PREFILL_COPIES = int(sys.argv[1])
t = time.perf_counter()
res = calibrate(mode="quick", out=sys.argv[2], progress=False)
print(f"copies {sys.argv[1]} {sys.argv[2]}: {time.perf_counter() - t:.1f} s; steps", {k: v for k, v in res.doc.get("step_wall_s", {}).items() if "layers" in k})
