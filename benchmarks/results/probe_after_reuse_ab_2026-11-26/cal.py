"""python cal.py on|off OUT [--check]: the first-use probe with microbench.PROBE_REUSE_AFTER on
(a row's after-readings are its before-readings when those are at most PROBE_REUSE_S old) or off
(every row reads the probes after its runs); needs `knob.diff` applied (not in the code). Runs
../probe_reading_reuse_2026-11-26/cal.py at PROBE_REUSE_S 0.25 (its --check: where a reading is
reused, also probe afresh and print the ratio fresh / reused per probe)."""
import runpy
import sys
from pathlib import Path

from flexplan.calibration import microbench as mb

mb.PROBE_REUSE_AFTER = sys.argv[1] == "on"
sys.argv = [sys.argv[0], "0.25", *sys.argv[2:]]
runpy.run_path(str(Path(__file__).resolve().parents[1] / "probe_reading_reuse_2026-11-26" / "cal.py"), run_name="__main__")
