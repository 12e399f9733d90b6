"""What every execution policy provides to the estimator.

A policy estimates one phase for a vector of candidate M values (GPU-resident layers) at once,
so the planner can search M without a Python loop. Decode inputs are per-step arrays; a policy
reduces each per-layer term over the steps with :func:`mean_over_steps` *after* any ``max``
(overlap is decided step by step, the mean is taken last).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flexplan.estimator.terms import PhaseCosts


def mean_over_steps(x) -> float:
    """Mean over decode steps (identity for prefill scalars)."""
    return float(np.mean(x))


@dataclass
class PhaseTime:
    """Estimates of one phase for each candidate M (arrays aligned with ``gpu_layers``)."""

    gpu_layers: np.ndarray
    time_s: np.ndarray  # TTFT, or mean TPOT over decode steps
    pcie_bytes: np.ndarray  # whole prefill, or mean per decode step
    terms: dict[str, np.ndarray] = field(default_factory=dict)


class Policy:
    name: str = ""
    host_mode: str = "none"  # how host-resident layers run: 'cpu', 'stream' or 'none' (there are none)
    paper: str = ""  # where the formula comes from

    def gpu_layer_options(self, num_layers: int) -> np.ndarray:
        raise NotImplementedError

    def estimate(self, pc: PhaseCosts, num_layers: int, gpu_layers: np.ndarray) -> PhaseTime:
        raise NotImplementedError

    def initial_load_s(self, pc_prefill: PhaseCosts, gpu_layers: np.ndarray) -> np.ndarray:
        """Loading GPU-resident weights before prefill starts (paper footnote 5: included in E2E)."""
        return gpu_layers * pc_prefill.t_load_weights_s + pc_prefill.t_load_head_s


def gpu_ends(pc: PhaseCosts):
    """Hidden states in (host embedding), LM head on the GPU, logits back: (time, bytes)."""
    t = pc.t_hidden_h2d_s + mean_over_steps(pc.t_gpu_head_s) + pc.t_logits_d2h_s
    return t, pc.hidden_bytes + pc.logits_bytes
