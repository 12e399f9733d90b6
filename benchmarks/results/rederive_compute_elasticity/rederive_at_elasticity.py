# The throw-away wrapper the sweeps ran (E=<elasticity> python rederive_at_elasticity.py FOLDER ...):
# rederive_cycles.py with memory_state.COMPUTE_STATE_ELASTICITY set to $E (NE/OE: variants of
# the trial code, gone since).
import sys, os
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from flexplan.calibration import memory_state
memory_state.COMPUTE_STATE_ELASTICITY = float(os.environ["E"])
if os.environ.get("NE"): memory_state.NORM_E = float(os.environ["NE"])
if os.environ.get("OE"): memory_state.OVERHEAD_E = float(os.environ["OE"])
import rederive_cycles
sys.argv = ["rederive_cycles.py"] + sys.argv[1:]
raise SystemExit(rederive_cycles.main())
