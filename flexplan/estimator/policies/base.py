"""What every execution policy provides to the estimator.

A policy estimates one phase for a vector of candidate M values (GPU-resident layers) at once,
so the planner can search M without a Python loop. Decode inputs are per-step arrays; a policy
reduces each per-layer term over the steps with :func:`mean_over_steps` *after* any ``max``
(overlap is decided step by step, the mean is taken last).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flexplan.errors import InvalidInputError
from flexplan.estimator.terms import PhaseCosts
from flexplan.placement import RESIDENT, LayerMode, PhasePlacement


def mean_over_steps(x) -> float:
    """Mean over decode steps (identity for prefill scalars); np.mean's sum and division, without
    its dispatch (the estimator asks thousands of times per plan)."""
    if isinstance(x, np.ndarray) and x.ndim:
        return float(np.add.reduce(x, axis=None, dtype=float) / x.size)
    return float(np.mean(x))


@dataclass
class PhaseTime:
    """Estimates of one phase for each candidate M (arrays aligned with ``gpu_layers``)."""

    gpu_layers: np.ndarray
    time_s: np.ndarray  # TTFT, or mean TPOT over decode steps
    pcie_bytes: np.ndarray  # whole prefill, or mean per decode step
    terms: dict[str, np.ndarray] = field(default_factory=dict)


class Policy:
    """One policy: its placement rule, its M options and its estimator formula. Its name is the
    one it is registered under (``flexplan.estimator.policies``), nowhere else.

    The default placement rule: the first N - M layers in ``host_mode`` (None: there are none),
    the last M resident on the accelerator; the head with the last layer."""

    name: str = ""  # set by the registry
    host_mode: LayerMode | None = None
    needs_gpu_layers: bool = False  # M is the caller's choice (else the single option)
    vectorised: bool = True  # placement() takes an array of M
    paper: str = ""  # where the formula comes from
    reproduces: str = ""  # the published system this policy is, when it is the baseline to beat (explain)

    def gpu_layer_options(self, num_layers: int) -> np.ndarray:
        raise NotImplementedError

    def placement(self, num_layers: int, gpu_layers, phase: str) -> PhasePlacement:
        """Where each layer of ``phase`` lives and computes with M = ``gpu_layers`` (an int, or an
        array of M when :attr:`vectorised`)."""
        runs = ((self.host_mode, num_layers - gpu_layers),) if self.host_mode is not None else ()
        return PhasePlacement(runs + ((RESIDENT, gpu_layers),))

    def gpu_layers_for(self, num_layers: int, gpu_layers: int | None) -> int:
        """M a forced plan runs with: the caller's (checked) when the policy takes one, else its only option."""
        if not self.needs_gpu_layers:
            return int(self.gpu_layer_options(num_layers)[0])

        if gpu_layers is None:
            raise InvalidInputError(f"policy {self.name} needs gpu_layers (how many layers sit on the GPU), "
                                    f"e.g. {{'{self.name}': ..., 'gpu_layers': {max(1, num_layers // 2)}}}")
        if not 0 <= int(gpu_layers) <= num_layers:
            raise InvalidInputError(f"gpu_layers must be between 0 and {num_layers}, got {gpu_layers}")
        return int(gpu_layers)

    def needs_accelerator(self, num_layers: int) -> bool:
        """Whether any placement this policy makes computes on the accelerator."""
        opts = self.gpu_layer_options(num_layers)
        return any(self.placement(num_layers, int(m), ph).uses_accelerator
                   for m in {*opts[:1], *opts[-1:]} for ph in ("prefill", "decode"))

    def not_applicable(self, model) -> str:
        """Why this policy cannot run ``model`` (a workload.ModelSpec) at all; "" when it can."""
        return ""

    def estimate(self, pc: PhaseCosts, num_layers: int, gpu_layers: np.ndarray) -> PhaseTime:
        raise NotImplementedError

    def split_choice(self, pc: PhaseCosts, num_layers: int, gpu_layers: int):
        """The operator split (plan_types.SplitPoints) the plan records for M = ``gpu_layers``; None:
        this policy places whole layers (or operator groups fixed by its modes)."""
        return None

    def fixed_split(self, model):
        """The split of a plan fixed by hand without an estimate (executor.fixed_plan); None: none."""
        return None

    def initial_load_s(self, pc_prefill: PhaseCosts, gpu_layers: np.ndarray) -> np.ndarray:
        """Loading GPU-resident weights before prefill starts (paper footnote 5: included in E2E)."""
        return gpu_layers * pc_prefill.t_load_weights_s + pc_prefill.t_load_head_s


def gpu_ends(pc: PhaseCosts):
    """Hidden states in (host embedding), LM head on the GPU, logits back: (time, bytes)."""
    t = pc.t_hidden_h2d_s + mean_over_steps(pc.t_gpu_head_s) + pc.t_logits_d2h_s
    return t, pc.hidden_bytes + pc.logits_bytes
