import sys, os
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from flexplan.estimator import efficiency
efficiency.FASTER_STATE_ELASTICITY = float(os.environ["F"])
import rederive_cycles
sys.argv = ["rederive_cycles.py"] + sys.argv[1:]
raise SystemExit(rederive_cycles.main())
