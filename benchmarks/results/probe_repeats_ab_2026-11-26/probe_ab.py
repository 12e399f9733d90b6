import sys, time
from dataclasses import replace
from flexplan.calibration import microbench as mb
from flexplan.calibration.cli import calibrate
repeats = int(sys.argv[1]); out = sys.argv[2]
mb.MODES["probe"] = replace(mb.MODES["probe"], repeats=repeats)
t = time.perf_counter()
res = calibrate("probe", out=out, progress=False)
print(out, "repeats", repeats, "wall", round(time.perf_counter() - t, 1), res.doc["step_wall_s"])
