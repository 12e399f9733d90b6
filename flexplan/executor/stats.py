"""What a run achieved, next to what the plan predicted (gpt-fast style: bandwidth and FLOP/s).

TTFT is the time from the ``generate()`` call to the end of the prefill forward; TPOT is
(E2E - TTFT) / (new tokens - 1). FLOPs per step come from flexplan.workload.costs (FlexInfer
Table 2: C_Prefill, C_Decode, plus the LM head); link bandwidth is bytes moved over the link in
the phase divided by the phase's time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from flexplan.executor.link import D2H, H2D
from flexplan.plan_types import Plan
from flexplan.workload import costs
from flexplan.workload.model import ModelSpec


def step_flops(spec: ModelSpec, batch: int, query_len: int, past_len: int) -> float:
    """FLOPs of one forward step over all layers plus the LM head (last position only):
    C_Prefill (no past), C_Decode (one token on a past) or, for a chunk of ``query_len`` tokens on
    top of ``past_len`` cached ones, C_Prefill of the whole minus C_Prefill of the past (GEMMs on
    the chunk's tokens, attention of its queries over the past and causally within the chunk)."""
    if past_len == 0:
        per_layer = costs.c_prefill(spec, batch, query_len)
    elif query_len == 1:
        per_layer = float(costs.c_decode(spec, batch, past_len + 1))
    else:
        per_layer = costs.c_prefill(spec, batch, past_len + query_len) - costs.c_prefill(spec, batch, past_len)
    return spec.num_layers * per_layer + costs.c_lm_head(spec, batch)


@dataclass
class PhaseStats:
    phase: str
    time_s: float = 0.0
    steps: int = 0
    tokens: int = 0  # tokens processed: batch x query length, summed over steps
    flops: float = 0.0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    # decode steps not yet in ``flops``: (id of the spec, batch) -> (spec, their context lengths), counted by
    # :meth:`settle` in one vectorised C_Decode (per step it cost more than a native decode's overhead)
    pending_decode: dict = field(default_factory=dict, repr=False, compare=False)

    def count_step(self, spec: ModelSpec, batch: int, query_len: int, past_len: int) -> None:
        """Add one forward step's FLOPs (:func:`step_flops`); a decode step's wait for :meth:`settle`."""
        if query_len == 1 and past_len > 0:  # keyed by identity: hashing a ModelSpec costs what this saves
            self.pending_decode.setdefault((id(spec), batch), (spec, []))[1].append(past_len + 1)
        else:
            self.flops += step_flops(spec, batch, query_len, past_len)

    def settle(self) -> None:
        """Count the pending decode steps into ``flops`` (as :func:`step_flops` would one by one)."""
        for (_, batch), (spec, contexts) in self.pending_decode.items():
            per_layer = costs.c_decode(spec, batch, np.asarray(contexts, dtype=float))
            self.flops += float(np.sum(spec.num_layers * per_layer + costs.c_lm_head(spec, batch)))
        self.pending_decode.clear()

    @property
    def link_bytes(self) -> int:
        return self.h2d_bytes + self.d2h_bytes

    @property
    def link_bandwidth_bytes_per_s(self) -> float:
        """Achieved: bytes moved over the link in this phase per second of this phase."""
        return self.link_bytes / self.time_s if self.time_s > 0 else 0.0

    @property
    def flops_per_s(self) -> float:
        self.settle()
        return self.flops / self.time_s if self.time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        self.settle()
        d = asdict(self)
        d.pop("pending_decode")
        d["link_bandwidth_bytes_per_s"] = self.link_bandwidth_bytes_per_s
        d["flops_per_s"] = self.flops_per_s
        return d


@dataclass
class RunStats:
    plan: Plan
    placement: str  # what ran where, per phase
    accelerator: str
    cpu_backend: str  # "stock PyTorch ..." or "IPEX ..."
    cpu_backend_why: str
    cpu_threads: int
    cpu_threads_source: str  # "calibrated: ...", "given by the caller" or "all usable cores (...)"
    cpu_linear_kernel: str  # cpu_linear.KERNELS: "flexplan-blocked", "onednn-packed" or "F.linear"
    cpu_decode_ops: str  # cpu_decode.describe(): native fused norm/rotary/attention, or transformers' ops
    host_allocator: str  # host_allocator.keep_freed_memory(): glibc malloc tuned, or left as it is and why
    batch_size: int
    input_len: int
    new_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    predicted_ttft_s: float
    predicted_tpot_s: float
    prefill: PhaseStats
    decode: PhaseStats
    h2d_bytes: int  # whole run, switch included
    d2h_bytes: int
    switch_bytes: int  # KV moved at the prefill -> decode switch
    memory_state: str = ""  # the host memory state the plan's predictions used ("memory state: ..."), if any
    native_stack_steps: int = 0  # decode steps run by cpu_decode.FusedStack (all layers in one native call)
    buffers_allocated: dict[str, int] = field(default_factory=dict)  # during this run, per memory
    correction: str = ""  # what online correction learned from this run (and any re-plan it caused)
    other_processes_cpu_share: float | None = None  # of all cores' time during the run (None: unknown)

    @property
    def phases(self) -> dict[str, PhaseStats]:
        return {"prefill": self.prefill, "decode": self.decode}

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("plan", "prefill", "decode")}
        d["plan"] = self.plan.to_dict()
        d["prefill"] = self.prefill.to_dict()
        d["decode"] = self.decode.to_dict()
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}

    def summary(self) -> str:
        def pred(x: float) -> str:
            return f"{x * 1e3:.2f} ms" if math.isfinite(x) else "n/a"

        def pred_mb(x: float) -> str:
            return f"{x / 1e6:.2f} MB" if math.isfinite(x) else "n/a"

        lines = [
            f"plan: {self.placement} on {self.accelerator}; CPU: {self.cpu_backend} ({self.cpu_backend_why}), "
            f"{self.cpu_threads} threads ({self.cpu_threads_source}), linears via {self.cpu_linear_kernel}, {self.cpu_decode_ops}; "
            f"host memory: {self.host_allocator}",
            f"TTFT {self.ttft_s * 1e3:.2f} ms (predicted {pred(self.predicted_ttft_s)}), "
            f"TPOT {self.tpot_s * 1e3:.2f} ms (predicted {pred(self.predicted_tpot_s)}), "
            f"E2E {self.e2e_s:.3f} s for {self.new_tokens} new tokens x batch {self.batch_size}",
        ]
        if self.memory_state:
            lines.append(f"predictions for the host {self.memory_state}")
        for p, choice in ((self.prefill, self.plan.prefill), (self.decode, self.plan.decode)):
            per_step = p.link_bytes / max(p.steps, 1) if p.phase == "decode" else p.link_bytes
            lines.append(
                f"{p.phase}: link achieved {p.link_bandwidth_bytes_per_s / 1e9:.2f} GB/s "
                f"({p.h2d_bytes / 1e6:.2f} MB h2d, {p.d2h_bytes / 1e6:.2f} MB d2h; "
                f"{per_step / 1e6:.2f} MB{' per step' if p.phase == 'decode' else ''}, predicted "
                f"{pred_mb(choice.pcie_bytes)}), compute achieved {p.flops_per_s / 1e12:.3f} TFLOP/s "
                f"over {p.steps} steps"
                + (f", {self.native_stack_steps} by the native decode stack" if p.phase == "decode"
                   and self.native_stack_steps else ""))
        if self.correction:
            lines.append(self.correction)
        return "\n".join(lines)


def collect(executor, t_start_s: float, t_end_s: float, batch: int, input_len: int, new_tokens: int,
            allocations_before: dict[str, int], cpu_threads_source: str = "") -> RunStats:
    """RunStats of the request that ran between ``t_start_s`` and ``t_end_s`` on ``executor``."""

    link, plan = executor.link, executor.plan
    e2e = t_end_s - t_start_s
    ttft = (executor.prefill_end_s - t_start_s) if executor.prefill_end_s is not None else e2e
    tpot = (e2e - ttft) / (new_tokens - 1) if new_tokens > 1 else math.nan
    phases = {}
    for ph in ("prefill", "decode"):
        ps = executor.phase_stats.get(ph) or PhaseStats(ph)
        ps.settle()
        ps.h2d_bytes = link.bytes_moved(H2D, phase=ph)
        ps.d2h_bytes = link.bytes_moved(D2H, phase=ph)
        phases[ph] = ps
    switch = sum(t.nbytes for t in link.transfers if t.kind == "kv-switch" and t.direction in (H2D, D2H))
    allocated = {k: v - allocations_before.get(k, 0) for k, v in link.allocations.items()
                 if v - allocations_before.get(k, 0)}
    return RunStats(
        plan=plan, placement=executor.placement.describe(), accelerator=link.name if executor.placement.uses_accelerator
        else "none", cpu_backend=executor.backend.name, cpu_backend_why=executor.backend.why,
        cpu_threads=executor.backend.threads, cpu_threads_source=cpu_threads_source or "as configured",
        cpu_linear_kernel=executor.backend.linear_kernel,
        cpu_decode_ops=executor.cpu_decode_ops, host_allocator=executor.backend.allocator, batch_size=batch,
        input_len=input_len, new_tokens=new_tokens, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e,
        predicted_ttft_s=plan.ttft_s, predicted_tpot_s=plan.tpot_s, prefill=phases["prefill"],
        decode=phases["decode"], h2d_bytes=link.bytes_moved(H2D), d2h_bytes=link.bytes_moved(D2H),
        switch_bytes=switch, buffers_allocated=allocated, native_stack_steps=executor.native_stack_steps,
        memory_state=memory_state_of(plan))


def memory_state_of(plan: Plan) -> str:
    """The "memory state: ..." part of the plan's efficiency source (calibration/memory_state.py
    writes it when planning on a calibrated local machine); "" when the plan has none."""

    return plan.factors.state_note
