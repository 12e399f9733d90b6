"""What each policy would cost: FlexInfer's TTFT/TPOT estimator (Equations 1-3 and extensions)."""

from flexplan.estimator.efficiency import DefaultEfficiency, Efficiency
from flexplan.estimator.phase_costs import phase_costs
from flexplan.estimator.policies import REGISTRY
from flexplan.estimator.terms import PhaseCosts, Shape

__all__ = ["REGISTRY", "DefaultEfficiency", "Efficiency", "PhaseCosts", "Shape", "phase_costs"]
