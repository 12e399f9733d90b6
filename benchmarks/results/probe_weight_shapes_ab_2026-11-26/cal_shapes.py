"""python cal_shapes.py one|two OUT: the first-use probe with its GEMV/GEMM weight shapes 2048x2048
(one, today's) or 2048x2048 and 2048x5632 (two)."""
import sys, time
from dataclasses import replace
from flexplan.calibration import microbench as mb
from flexplan.calibration.cli import calibrate
shapes = {"one": ((2048, 2048),), "two": ((2048, 2048), (2048, 5632))}[sys.argv[1]]
mb.MODES["probe"] = replace(mb.MODES["probe"], weight_shapes=shapes)
t = time.perf_counter()
res = calibrate(mode="probe", out=sys.argv[2], progress=False)
print(f"{sys.argv[1]} {sys.argv[2]}: {time.perf_counter() - t:.1f} s", res.doc.get("step_wall_s"))
