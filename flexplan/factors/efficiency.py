"""Shape-dependent efficiency factors from a calibration file (FlexInfer section 5.2).

A calibration file holds absolute measurements (seconds, bytes/s). The factors are computed
here, at load time, against the peak figures of the :class:`Hardware` being planned for, so
that the estimator's ADDITIVE per-layer formula (``flexplan/estimator/terms.py``)

    t = C / (TH x Eff_comp(tokens)) + D / (BW x Eff_mem(tokens)) + KV / (BW x Eff_attn(ctx)) + overhead

reproduces each measured time at the calibrated shape, as far as physics allows:

- Times first: each one lowered to the fastest time of the same op on at least as much work
  (:func:`no_faster_with_more_work`): more work is never faster, and noise only adds time.
- Eff_mem from the GEMV at the fewest tokens (compute there is taken as fully hidden,
  Eff_comp = 1): ``D / (BW x (t - C / TH))``; weights stream at that rate at every token count.
- Eff_comp(tokens) from what is left once the memory term is paid:
  ``C / (TH x (t - D / (BW x Eff_mem)))``, growing no faster than the tokens do (the compute
  term never falls as tokens grow); when nothing is left, compute is hidden at that bound.
- Eff_attn(ctx) from SDPA decode attention, after its compute term at Eff_comp(batch); the mean
  over the measured batch sizes (the protocol's factor depends on ctx only), its growth capped
  so that ctx / Eff_attn(ctx) never falls.
- Real decoder layers (``layer_fit.py``): the per-layer overhead of a decode step, and the
  compute factor over the tokens the calibrated prefill layers span (replacing the GEMM's there).
- Per-op dispatch cost (a tiny matmul / SDPA call) is taken out of each op's time: the
  estimator charges it once per layer, in the per-layer overhead (non-negative, non-decreasing
  in tokens).

CPU factors are kept per compute dtype (the planner weighs the CPU's fast dtype against
float32; PyTorch's bf16 GEMV can be slower than fp32 where bf16 GEMMs are faster).

Between measured points the factors are interpolated linearly in log(tokens), log(ctx) or
log(bytes) (compute and link: log-log) and held constant beyond the ends; they lie in (0,
EFF_MAX]. These constraints make every policy's predictions non-decreasing in batch, input length
and context for any file (tests/test_calibration_properties.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flexplan.estimator.efficiency import DefaultEfficiency, FactorSource
from flexplan.estimator.terms import c_gemm, d_gemm, t_compute_s, t_memory_s
from flexplan.factors.layer_fit import LayerOverhead, derive_layers
from flexplan.factors.memory_state import normalised
from flexplan.factors.tables import EFF_MAX, Table, _attention_spec, _num, _stat_s, capped_growth
from flexplan.hardware.spec import DTYPE_BYTES, Hardware
from flexplan.workload import costs

MAX_DISPATCH_SHARE = 0.25  # dispatch is a correction: never more than this share of an op's time
# a GPU layer's kernel launches (~30 of 5-10 us) take well under this; a measured per-layer overhead
# above it timed something else (a one-off cost: cuDNN planning its attention per new shape) and would price
# every GPU layer orders of magnitude too slow
GPU_LAYER_OVERHEAD_MAX_S = 5e-3


def no_faster_with_more_work(rows: list[dict], group, work) -> list[float]:
    """Each row's time (:func:`_stat_s`), lowered to the fastest time of any row of its ``group``
    that does at least as much ``work``: the same op on more tokens (a longer KV cache, a larger
    batch) cannot be faster, so a row slower than a larger one met interference (on a shared
    few-core machine a multi-threaded op can wait a whole scheduler slice). Noise only ever adds
    time, so the lower figure is the one kept; else a single slow point at batch 1 (the
    fewest-token GEMV, the batch-1 layer) would make batch 1 predict slower than batch 4."""
    times = [_stat_s(r) for r in rows]
    groups: dict[Any, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(group(r), []).append(i)
    for idx in groups.values():
        fastest = float("inf")
        for i in sorted(idx, key=lambda i: work(rows[i]), reverse=True):
            fastest = min(fastest, times[i])
            times[i] = fastest
    return times


def _less_dispatch(t: float, dispatch_s: float, capped: list) -> float:
    """The op's time ``t`` without its fixed call cost (charged per layer by the estimator)."""
    if dispatch_s > MAX_DISPATCH_SHARE * t:
        capped.append(dispatch_s)
        return (1 - MAX_DISPATCH_SHARE) * t
    return t - dispatch_s


# ----------------------------------------------------------------------------- derivations (pure)


def derive_gemm(rows: list[dict], peak_flops_per_s: float, bandwidth_bytes_per_s: float,
                dispatch_s: float = 0.0) -> tuple[Table, Table, list[str]]:
    """(Eff_comp(tokens), Eff_mem(tokens), notes) from GEMM/GEMV rows {tokens, k, n,
    dtype_bytes, time_s}; rows with the same tokens (several weight shapes) add up, as the
    GEMMs of one layer do."""
    by_t: dict[int, list[float]] = {}
    capped: list[float] = []
    times = no_faster_with_more_work(rows, lambda r: (int(r["k"]), int(r["n"])), lambda r: int(r["tokens"]))
    for r, time_s in zip(rows, times):
        t, k, n, b = int(r["tokens"]), int(r["k"]), int(r["n"]), float(r["dtype_bytes"])
        s = by_t.setdefault(t, [0.0, 0.0, 0.0])
        s[0] += c_gemm(t, k, n)
        s[1] += d_gemm(t, k, n, b)
        s[2] += _less_dispatch(time_s, dispatch_s, capped)
    if not by_t:
        raise ValueError("no GEMM measurements")
    notes = []
    if capped:
        notes.append(f"op dispatch measured {dispatch_s * 1e6:.0f} us, over {MAX_DISPATCH_SHARE:.0%} of "
                     f"{len(capped)} GEMM times: capped (a busy machine?)")
    tokens = sorted(by_t)
    c0, d0, t0 = by_t[tokens[0]]
    left = t0 - t_compute_s(c0, peak_flops_per_s, 1.0)
    eff_m0 = min(EFF_MAX, t_memory_s(d0, bandwidth_bytes_per_s, 1.0) / left) if left > 0 else 1.0
    if eff_m0 > 1.0:
        notes.append(f"weight streaming measured {d0 / left / 1e9:.1f} GB/s, above the hardware's "
                     f"{bandwidth_bytes_per_s / 1e9:.1f} GB/s: memory factor {eff_m0:.3g} (is the bandwidth right?)")
    # Weights stream at one rate whatever the token count (Eff_mem(tokens) constant, so the memory
    # term grows with the activations); what more tokens cost beyond it is compute. Eff_comp may
    # grow with tokens only as fast as the tokens do (compute time never falls as tokens grow);
    # where the measured time leaves no room for compute, it is hidden at that largest factor.
    eff_c: list[float] = []
    hidden: list[bool] = []  # no compute seen beyond the memory term: the factor is a placeholder
    for i, t in enumerate(tokens):
        c, d, tt = by_t[t]
        cap = EFF_MAX if i == 0 else min(EFF_MAX, eff_c[-1] * t / tokens[i - 1])
        rest = tt - t_memory_s(d, bandwidth_bytes_per_s, eff_m0)
        seen = t_compute_s(c, peak_flops_per_s, 1.0) / rest if rest > 0 else cap
        eff_c.append(min(cap, seen))
        # the first row gave the memory factor with its compute at the peak: what it computes is in there
        hidden.append(seen >= cap * (1 - 1e-9) or (i == 0 and left > 0))
    x_c, eff_c = _hidden_compute_ramps(tokens, eff_c, hidden)
    eff_m = [eff_m0] * len(tokens)
    above = [t for t in tokens if by_t[t][0] / by_t[t][2] > peak_flops_per_s * 1.02]
    if above:
        best = max(by_t[t][0] / by_t[t][2] for t in above)
        notes.append(f"GEMM at {', '.join(map(str, above))} tokens measured up to {best / 1e9:.4g} GFLOP/s, above "
                     f"the hardware's peak {peak_flops_per_s / 1e9:.4g}: factors above 1 (is the peak right?)")
    return Table(x_c, eff_c, log_y=True), Table(tokens, eff_m), notes


HIDDEN_RAMP_STEPS = 4  # points between a hidden row and the next measured one (geometric in tokens)


def _hidden_compute_ramps(tokens: list[int], eff_c: list[float], hidden: list[bool]) -> tuple[list, list]:
    """The compute factor's points, with a ramp after each row whose compute was hidden in its
    memory term (its factor a placeholder: the largest allowed) up to the next row that shows it:
    the compute time grows linearly in tokens from what the table gives at the hidden row (nothing
    much at the first row, whose compute the memory factor holds; the row before's at a later one,
    carried by the growth cap) to the measured row's. A power law between the placeholder and the
    measured factor instead priced a batch-4 LM head at a quarter of its compute between head rows
    at 1 and 8 tokens (on a slow-compute machine, TPOT 2.4x under its GEMV rows at 4 tokens)."""
    xs: list[float] = []
    ys: list[float] = []
    for i, t in enumerate(tokens):
        if i > 0 and hidden[i - 1] and not hidden[i]:
            lo = float(tokens[i - 1])
            at_lo, at_t = lo / eff_c[i - 1], t / eff_c[i]  # compute time / (work per token / peak)
            for k in range(1, HIDDEN_RAMP_STEPS):
                x = lo * (t / lo) ** (k / HIDDEN_RAMP_STEPS)
                ys.append(x / (at_lo + (at_t - at_lo) * (x - lo) / (t - lo)))
                xs.append(x)
        xs.append(float(t))
        ys.append(eff_c[i])
    return xs, ys


def derive_attention(rows: list[dict], peak_flops_per_s: float, bandwidth_bytes_per_s: float,
                     eff_compute: Table, dispatch_s: float = 0.0) -> tuple[Table, dict[int, Table]]:
    """Eff_attn(ctx) (mean over batch sizes) and the per-batch tables, from SDPA rows {batch,
    kv_len, heads, kv_heads, head_dim, dtype_bytes, time_s}: D_KVCache and the attention part of
    C_Decode from workload/costs.py, for a layer of those heads."""
    per_batch: dict[int, dict[int, float]] = {}
    heads = lambda r: (int(r["heads"]), int(r["kv_heads"]), int(r["head_dim"]))  # noqa: E731
    by_len = no_faster_with_more_work(rows, lambda r: (heads(r), int(r["batch"])), lambda r: int(r["kv_len"]))
    by_batch = no_faster_with_more_work(rows, lambda r: (heads(r), int(r["kv_len"])), lambda r: int(r["batch"]))
    for r, t_len, t_batch in zip(rows, by_len, by_batch):
        b, L = int(r["batch"]), int(r["kv_len"])
        m = _attention_spec(*heads(r))
        kv = float(costs.d_kv_cache(m, b, L, float(r["dtype_bytes"])))
        c = float(costs.c_decode(m, b, L) - costs.c_decode(m, b, 0))  # attention over L keys, without the GEMMs
        t = _less_dispatch(min(t_len, t_batch), dispatch_s, [])
        mem_s = t - t_compute_s(c, peak_flops_per_s, eff_compute(b))
        per_batch.setdefault(b, {})[L] = (min(EFF_MAX, t_memory_s(kv, bandwidth_bytes_per_s, 1.0) / mem_s)
                                          if mem_s > 0 else EFF_MAX)
    if not per_batch:
        raise ValueError("no attention measurements")
    # each batch's own curve kept physical like the mean below (its KV time never falls with more keys:
    # the cpu-attention policies read these per batch)
    tables = {b: Table(sorted(d), capped_growth(sorted(d), [d[L] for L in sorted(d)], power_law=False))
              for b, d in sorted(per_batch.items())}
    lens = sorted({L for d in per_batch.values() for L in d})
    mean = capped_growth(lens, [float(np.mean([tables[b](L) for b in tables])) for L in lens], power_law=False)
    return Table(lens, mean), tables


def derive_attention_by_layout(rows: list[dict], peak_flops_per_s: float, bandwidth_bytes_per_s: float,
                               eff_compute: Table, dispatch_s: float = 0.0) -> dict[tuple[int, int, int], tuple]:
    """(Eff_attn(ctx) over batches, {batch: Eff_attn(ctx)}) of each (query heads, KV heads, head
    dim) layout measured: :func:`derive_attention` over that layout's rows (GQA groups and head
    widths read the KV cache at different rates, and so do batch sizes)."""
    layouts: dict[tuple[int, int, int], list[dict]] = {}
    for r in rows:
        layouts.setdefault((int(r["heads"]), int(r["kv_heads"]), int(r["head_dim"])), []).append(r)
    return {k: derive_attention(v, peak_flops_per_s, bandwidth_bytes_per_s, eff_compute, dispatch_s)
            for k, v in layouts.items()}


def _by_batch(tables: dict, batch: float, context_len):
    """Eff_attn(ctx) at ``batch`` from tables per measured batch: a power law between the two
    nearest (linear in log-log), the nearest one's beyond them. Each batch's factor is capped at
    the one before it times the batch ratio, so that b / Eff, the KV time, never falls as the
    batch grows, whatever the rows measured (a small batch's reads carry a fixed per-call cost:
    the factor may grow nearly as fast as the batch, as it did for an MQA cache here)."""
    bs = sorted(tables)
    vals = [np.asarray(tables[bs[0]](context_len), dtype=float)]
    for prev, b in zip(bs, bs[1:]):
        vals.append(np.minimum(np.asarray(tables[b](context_len), dtype=float), vals[-1] * (b / prev)))
    if batch <= bs[0] or len(bs) == 1:
        return vals[0]
    if batch >= bs[-1]:
        return vals[-1]
    j = next(i for i, b in enumerate(bs) if b >= batch)
    w = (np.log(batch) - np.log(bs[j - 1])) / (np.log(bs[j]) - np.log(bs[j - 1]))
    return np.exp((1 - w) * np.log(vals[j - 1]) + w * np.log(vals[j]))


UNDER_COPY_MAX = 4.0  # a slowdown beyond this timed something else (the GEMM and the copies are one process's)


def under_copy_by_tokens(contention: dict) -> Table | None:
    """The CPU's slowdown while host-to-device copies stream (Park & Egger 4.1) by GEMM rows: the
    decode GEMV's (1 row, memory-bound: it shares the DRAM with the copy's reads) and the prefill
    GEMM's (compute-bound), log-linear between, held beyond; None where the file has the GEMM's
    alone (older files: that one factor everywhere)."""
    gemv, gemm = contention.get("gemv_factor"), contention.get("gemm") or {}
    if gemv is None or not gemm.get("tokens"):
        return None
    return Table([1.0, float(gemm["tokens"])], [max(1.0, float(gemv)), max(1.0, float(contention["factor"]))],
                 lo=1.0, hi=UNDER_COPY_MAX)


def derive_link(rows: list[dict], bandwidth_bytes_per_s: float) -> Table:
    """Eff_ICN(bytes) = measured rate / link rate, from rows {bytes, time_s}; a larger copy never
    takes less time than a smaller one."""
    times = no_faster_with_more_work(rows, lambda r: 0, lambda r: float(r["bytes"]))
    order = sorted(range(len(rows)), key=lambda i: float(rows[i]["bytes"]))
    x = [float(rows[i]["bytes"]) for i in order]
    eff = [x_i / times[i] / bandwidth_bytes_per_s for x_i, i in zip(x, order)]
    return Table(x, capped_growth(x, eff, power_law=True), log_y=True)


def best_threads(sweep: list[dict]) -> int:
    """The thread count with the lowest sum of prefill and decode times, each relative to its
    own best (Park & Egger 4.1: all cores is not always fastest)."""
    pre = min(float(r["prefill_time_s"]) for r in sweep)
    dec = min(float(r["decode_time_s"]) for r in sweep)
    return int(min(sweep, key=lambda r: (float(r["prefill_time_s"]) / pre + float(r["decode_time_s"]) / dec,
                                         -int(r["threads"])))["threads"])


# ----------------------------------------------------------------------------- the Efficiency


@dataclass(frozen=True)
class CPUFactors:
    """The CPU factor tables of one compute dtype."""

    compute: Table
    memory: Table
    attention: Table | None
    overhead: "LayerOverhead | None" = None  # seconds per real layer beyond the factors (tokens, layer size)
    head_compute: Table | None = None  # the LM head's tall GEMV (hidden x vocab)
    head_memory: Table | None = None
    tied_head_compute: Table | None = None  # a tied head's, where it runs another kernel (16-bit CPUs)
    tied_head_memory: Table | None = None
    attention_by_layout: dict | None = None  # (heads, kv_heads, head_dim) -> Eff_attn(ctx), where measured
    attention_by_layout_batch: dict | None = None  # ... -> {batch: Eff_attn(ctx)}
    expert_compute: Table | None = None  # the CPU routed-expert path, by rows per expert (cpu_experts rows)
    expert_memory: Table | None = None
    prefill_attention: float | None = None  # Eff of a prefill layer's attention core (layer_fit.py); None: compute
    split_linear: Table | None = None  # time of split layers' CPU linear / the packed kernel's, by rows
    executor_extra_s: float = 0.0  # per layer: what the executor's decode step adds to the bare layer
    executor_extra_by_bytes: Table | None = None  # ... by the layer's weight bytes, where two widths were timed
    # a decode step the executor's native stack runs (cpu_stack_overhead rows): seconds per layer beyond its
    # arithmetic and reads, and per step outside the layers, by decode batch; None: not measured
    stack_layer_s: Table | None = None
    stack_step_s: Table | None = None


@dataclass(frozen=True)
class BlockFactors:
    """The block kernels' factor tables of one GGUF format (its float32 activations quantised per
    block, integer dots): Eff_comp against the CPU's float32 peak, Eff_mem on the blocks' bytes."""

    compute: Table
    memory: Table


@dataclass(frozen=True)
class CalibratedEfficiency:
    """The :class:`~flexplan.estimator.efficiency.Efficiency` protocol from measurements. CPU
    factors are per compute dtype; a dtype the calibration did not measure gets the defaults."""

    cpu: dict[str, CPUFactors]
    cpu_dtype: str  # the one asked for when the caller gives none
    cpu_overhead_s: float
    threads: int | None
    under_copy: float
    gpu_compute_table: Table | None
    gpu_memory_table: Table | None
    h2d_table: Table | None
    d2h_table: Table | None
    gpu_overhead_s: float
    defaults: DefaultEfficiency
    step_overhead: "StepOverhead"
    source: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    origin: FactorSource = FactorSource()
    under_copy_table: Table | None = None  # the slowdown by GEMM rows (1: the decode GEMV's); None: under_copy
    blocks: dict[str, BlockFactors] = field(default_factory=dict)  # GGUF format -> its block kernels' factors

    def _cpu(self, dtype: str | None) -> CPUFactors | None:
        return self.cpu.get(dtype or self.cpu_dtype)

    def cpu_compute(self, tokens, dtype=None):
        f = self._cpu(dtype)
        return f.compute(tokens) if f else self.defaults.cpu_compute(tokens, dtype)

    def cpu_memory(self, tokens, dtype=None):
        f = self._cpu(dtype)
        return f.memory(tokens) if f else self.defaults.cpu_memory(tokens, dtype)

    def cpu_block_formats(self) -> frozenset[str]:
        return frozenset(self.blocks)

    def cpu_block_compute(self, tokens, block_format):
        """Eff_comp of the block kernels on ``block_format`` (against the float32 peak); a format
        not measured: the float32 GEMMs' factor."""
        f = self.blocks.get(block_format)
        return f.compute(tokens) if f else self.cpu_compute(tokens, "float32")

    def cpu_block_memory(self, tokens, block_format):
        """Eff_mem of the block kernels streaming ``block_format``'s blocks; a format not measured:
        the float32 GEMV's factor."""
        f = self.blocks.get(block_format)
        return f.memory(tokens) if f else self.cpu_memory(tokens, "float32")

    def _head(self, dtype, tied: bool) -> tuple[Table | None, Table | None]:
        """(compute, memory) tables of the LM head: a tied head's where measured apart, else the
        untied head's (older files, float32, or a kernel that does not differ)."""
        f = self._cpu(dtype)
        if f is None:
            return None, None
        return ((f.tied_head_compute, f.tied_head_memory) if tied and f.tied_head_compute
                else (f.head_compute, f.head_memory))

    def cpu_head_compute(self, tokens, dtype=None, tied=False):
        table = self._head(dtype, tied)[0]
        return table(tokens) if table else self.cpu_compute(tokens, dtype)

    def cpu_prefill_attention(self, tokens, dtype=None):
        """Eff of a prefill layer's attention core, fitted from real layers of the same GEMM rows
        and other prompt lengths (layer_fit.py); where not measured, the GEMMs' factor."""
        f = self._cpu(dtype)
        return f.prefill_attention if f and f.prefill_attention else self.cpu_compute(tokens, dtype)

    def cpu_split_linear(self, tokens, dtype=None):
        """How much longer a split-points layer's CPU linear (dense weights) takes than the packed
        kernel the GEMV/GEMM factors describe, at ``tokens`` rows; 1 where not measured."""
        f = self._cpu(dtype)
        return f.split_linear(tokens) if f and f.split_linear else 1.0

    def cpu_head_memory(self, tokens, dtype=None, tied=False):
        table = self._head(dtype, tied)[1]
        return table(tokens) if table else self.cpu_memory(tokens, dtype)

    def cpu_expert_factors(self, tokens, dtype=None):
        """(Eff_comp, Eff_mem) of the CPU routed-expert path at ``tokens`` rows per expert, measured
        with its fixed per-expert costs in them; None where calibration did not measure it."""
        f = self._cpu(dtype)
        if f is None or f.expert_compute is None:
            return None
        return f.expert_compute(tokens), f.expert_memory(tokens)

    def cpu_attention(self, context_len, dtype=None):
        f = self._cpu(dtype)
        if f is None:
            return self.defaults.cpu_attention(context_len, dtype)
        if f.attention is None:  # not measured: KV reads stream like weights at one token
            eff = f.memory(1)
            return eff if np.ndim(context_len) == 0 else np.full(np.shape(context_len), eff)
        return f.attention(context_len)

    def cpu_attention_for_layout(self, context_len, dtype=None, layout=None, batch=None):
        """Eff_attn(ctx) measured at this (query heads, KV heads, head dim) layout, at ``batch``
        where the layout was measured per batch (interpolated in log(batch) between the two
        nearest, held beyond them: a grouped-query cache reads at a rate that falls by nearly half
        from batch 1 to 8, so one mean would be far off at either end), else the mean over the
        batches; else :meth:`cpu_attention` (the mean over the layouts measured)."""
        f = self._cpu(dtype)
        key = tuple(int(x) for x in layout) if f and layout else None
        per_batch = (f.attention_by_layout_batch or {}).get(key) if key and batch else None
        if per_batch:
            return _by_batch(per_batch, float(batch), context_len)
        table = (f.attention_by_layout or {}).get(key) if key else None
        return table(context_len) if table is not None else self.cpu_attention(context_len, dtype)

    def gpu_compute(self, tokens):
        return self.gpu_compute_table(tokens) if self.gpu_compute_table else self.defaults.gpu_compute(tokens)

    def gpu_memory(self, tokens):
        return self.gpu_memory_table(tokens) if self.gpu_memory_table else self.defaults.gpu_memory(tokens)

    def h2d(self, transfer_bytes):
        return self.h2d_table(transfer_bytes) if self.h2d_table else self.defaults.h2d(transfer_bytes)

    def d2h(self, transfer_bytes):
        return self.d2h_table(transfer_bytes) if self.d2h_table else self.defaults.d2h(transfer_bytes)

    def cpu_under_copy(self, tokens=None):
        if tokens is None or self.under_copy_table is None:
            return self.under_copy
        return float(self.under_copy_table(tokens))

    def cpu_threads(self):
        return self.threads

    def cpu_layer_overhead_s(self, tokens=1, dtype=None, layer_bytes=None):
        f = self._cpu(dtype)
        extra = 0.0 if f is None else f.executor_extra_s
        if f is not None and f.executor_extra_by_bytes is not None and layer_bytes:
            extra = float(f.executor_extra_by_bytes(layer_bytes))
        if f is not None and f.overhead is not None:
            return f.overhead(tokens, layer_bytes) + extra
        return self.cpu_overhead_s + extra

    def cpu_step_overhead_s(self, batch=1, vocab=0):
        return self.step_overhead(batch, vocab)

    def cpu_stack_overhead_s(self, batch=1, vocab=0, dtype=None):
        f = self._cpu(dtype)
        if f is None or f.stack_layer_s is None or f.stack_step_s is None:
            return None
        # the loop's cost per logit as generate_step measured it (the stack's toy had 128 logits)
        return f.stack_layer_s(batch), f.stack_step_s(batch) + self.step_overhead.per_logit_s * float(batch) * float(vocab)

    def gpu_layer_overhead_s(self):
        return self.gpu_overhead_s

    def describe_factors(self) -> dict[str, Any]:
        """The factor tables as plain data (for the YAML's derived section and for humans)."""
        out: dict[str, Any] = {"cpu": {dt: {"compute": f.compute.rows("tokens"), "memory": f.memory.rows("tokens"),
                                            "attention": f.attention.rows("kv_len") if f.attention else None,
                                            "prefill_attention": _num(f.prefill_attention) if f.prefill_attention
                                            else None,
                                            "layer_overhead_s": f.overhead.rows() if f.overhead else None,
                                            "split_linear": f.split_linear.rows("tokens") if f.split_linear else None,
                                            "executor_extra_s": _num(f.executor_extra_s),
                                            "stack_layer_s": f.stack_layer_s.rows("batch") if f.stack_layer_s else None,
                                            "stack_step_s": f.stack_step_s.rows("batch") if f.stack_step_s else None,
                                            "executor_extra_by_layer_bytes": [
                                                {"layer_bytes": _num(x), "extra_s": _num(y)} for x, y in
                                                zip(f.executor_extra_by_bytes.x, f.executor_extra_by_bytes.y)]
                                            if f.executor_extra_by_bytes is not None else None}
                                       for dt, f in self.cpu.items()},
                               "cpu_step_overhead_s": {"base_s": _num(self.step_overhead.base_s),
                                                       "per_logit_s": _num(self.step_overhead.per_logit_s)},
                               "cpu_layer_overhead_s": _num(self.cpu_overhead_s), "cpu_threads": self.threads,
                               "cpu_under_copy": _num(self.under_copy),
                               "cpu_under_copy_gemv": _num(self.cpu_under_copy(1))}
        for name, t, key in (("gpu_compute", self.gpu_compute_table, "tokens"),
                             ("gpu_memory", self.gpu_memory_table, "tokens"),
                             ("h2d", self.h2d_table, "bytes"), ("d2h", self.d2h_table, "bytes")):
            out[name] = t.rows(key) if t else None
        out["gpu_layer_overhead_s"] = _num(self.gpu_overhead_s)
        out["cpu_blocks"] = {fmt: {"compute": f.compute.rows("tokens"), "memory": f.memory.rows("tokens")}
                             for fmt, f in self.blocks.items()} or None
        out["notes"] = list(self.notes)
        return out


LAYER_KEYS = ("dtype", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "batch", "query_len", "kv_len",
              "time_s")


@dataclass(frozen=True)
class StepOverhead:
    """generate()'s own cost per step: a base plus a part per logit (batch x vocab)."""

    base_s: float
    per_logit_s: float

    def __call__(self, batch: float = 1, vocab: float = 0) -> float:
        return self.base_s + self.per_logit_s * float(batch) * float(vocab)


def fit_step_overhead(logits, seconds) -> StepOverhead:
    """base + per_logit x logits by least squares, both non-negative (a step never costs less for
    more logits, nor less than nothing): where the free fit has a negative slope the base is the
    mean; where it has a negative base the line goes through the origin."""
    x, y = np.asarray(logits, dtype=float), np.asarray(seconds, dtype=float)
    if len(set(x.tolist())) < 2:
        return StepOverhead(max(float(np.mean(y)), 0.0), 0.0)
    slope, base = np.polyfit(x, y, 1)
    if slope < 0:
        return StepOverhead(max(float(np.mean(y)), 0.0), 0.0)
    if base < 0:
        return StepOverhead(0.0, max(float(x @ y / (x @ x)), 0.0))
    return StepOverhead(float(base), float(slope))


def _part(meas: dict, name: str, kind: type):
    v = meas.get(name)
    return v if isinstance(v, kind) and v else None


GEMM_KEYS = ("dtype", "tokens", "k", "n", "dtype_bytes", "time_s")
# the GGUF block kernels' GEMV/GEMM rows (measure.microbench_blocks): GEMM_KEYS and the blocks' `format`,
# `dtype_bytes` the format's bytes per weight; optional (files from before them price blocks as float32)
BLOCK_PART = "cpu_block_gemm"
ATTENTION_KEYS = ("dtype", "batch", "kv_len", "heads", "kv_heads", "head_dim", "dtype_bytes", "time_s")


EXECUTOR_LAYER_KEYS = ("dtype", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "batch", "kv_len", "time_s")


def executor_extra_s(executor_rows: list[dict], layer_rows: list[dict]) -> float:
    """Seconds per layer the executor's decode step adds to the bare real layer of the same width:
    the one timed beside it (``extra_s``, the median over slope and bare layer pairs timed back to
    back; in older files ``time_s - layer_time_s``), else the ``cpu_layers`` row at batch 1 and the
    nearest KV length (its hooks, its KV cache, casts: a tenth of a millisecond or so per small
    layer, more in bfloat16 than in float32): the mean over the executor rows that have such a
    layer, never below 0."""
    def beside(r):  # the bare layer timed with it: a positive number, else none
        t = r.get("layer_time_s")
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError("`measurements.cpu_executor_layers` has a bad layer_time_s (a positive number of seconds)")
        return t

    def paired(r):  # the median of differences of pairs timed back to back (None in older files)
        x = r.get("extra_s")
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)):
            raise ValueError("`measurements.cpu_executor_layers` has a bad extra_s (a finite number of seconds)")
        return x

    extras = []
    for r in (r for r in executor_rows if beside(r)):  # timed together
        x = paired(r)
        extras.append(x if x is not None else r["time_s"] - beside(r))
    for r in (r for r in executor_rows if not beside(r)):
        same = [x for x in layer_rows if x["query_len"] == 1 and x["batch"] == r["batch"]
                and all(x[k] == r[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim"))]
        if same:
            bare = min(same, key=lambda x: abs(math.log(x["kv_len"] / r["kv_len"])))
            extras.append(r["time_s"] - bare["time_s"])
    return max(0.0, float(np.mean(extras))) if extras else 0.0


def executor_extra_by_bytes(executor_rows: list[dict], layer_rows: list[dict], dtype: str) -> Table | None:
    """What the executor adds per layer (:func:`executor_extra_s`) at each width it was timed at,
    by the layer's weight bytes in ``dtype`` (interpolated in log bytes, held beyond the ends);
    None where fewer than two widths were timed (one figure for every width, as before)."""

    keys = ("hidden", "intermediate", "heads", "kv_heads", "head_dim")
    by_width: dict[tuple, list[dict]] = {}
    for r in executor_rows:
        by_width.setdefault(tuple(int(r[k]) for k in keys), []).append(r)
    if len(by_width) < 2:
        return None
    xs, ys = [], []
    for (hidden, inter, heads, kv_heads, head_dim), rows in by_width.items():
        spec = _attention_spec(heads, kv_heads, head_dim, hidden, inter)
        xs.append(float(costs.d_weights(spec, DTYPE_BYTES[dtype])))
        ys.append(executor_extra_s(rows, layer_rows))
    return Table(xs, ys, lo=0.0, hi=1.0)


STACK_KEYS = ("dtype", "batch", "layer_s", "step_s")


def stack_tables(rows: list[dict]) -> tuple[Table | None, Table | None]:
    """The native stack's per-layer and per-step seconds by decode batch, from the rows whose steps
    the stack ran (``native_stack``); (None, None) where none did."""
    ran = [r for r in rows if r.get("native_stack") is True]
    if not ran:
        return None, None
    batches = [float(r["batch"]) for r in ran]
    return (Table(batches, [float(r["layer_s"]) for r in ran], lo=0.0, hi=1.0),
            Table(batches, [float(r["step_s"]) for r in ran], lo=0.0, hi=1.0))


SPLIT_LINEAR_KEYS = ("dtype", "tokens", "time_s", "reference_time_s")
SPLIT_LINEAR_RANGE = (0.25, 4.0)  # bounds of the time ratio: a row outside is a disturbed timing


EXPERT_KEYS = ("dtype", "tokens_per_expert", "experts", "hidden", "intermediate", "dtype_bytes", "time_s")


def expert_gemm_row(r: dict) -> dict:
    """A ``cpu_experts`` row (k gated experts of hidden h and width I, t rows each) as the one GEMM
    of equal FLOPs and weight bytes that :func:`derive_gemm` reads: t rows, k = h, n = 3 k_e I."""
    n = 3 * int(r["experts"]) * int(r["intermediate"])
    return {"tokens": int(r["tokens_per_expert"]), "k": int(r["hidden"]), "n": n, "dtype_bytes": r["dtype_bytes"],
            "time_s": r["time_s"], **({"time_median_s": r["time_median_s"]} if "time_median_s" in r else {})}


def check_rows(rows, keys: tuple[str, ...], what: str) -> list[dict]:
    """``rows`` as a list of dicts holding ``keys`` with positive numbers (``dtype`` a string);
    ValueError naming the first bad row otherwise."""
    if rows is None:
        return []
    if not isinstance(rows, list):
        raise ValueError(f"`{what}` should be a list of rows")
    for i, r in enumerate(rows):
        bad = [k for k in keys if not isinstance(r, dict) or k not in r
               or (k == "dtype" and not isinstance(r[k], str))
               or (k != "dtype" and (isinstance(r[k], bool) or not isinstance(r[k], (int, float)) or not r[k] > 0))]
        if bad:
            raise ValueError(f"`{what}` row {i} lacks or has a bad {', '.join(bad)}")
    return rows


def _of_dtype(rows: list[dict], dtype: str) -> list[dict]:
    return [r for r in rows if r["dtype"] == dtype]


def cpu_factors(meas: dict, dtype: str, hw: Hardware, notes: list[str]) -> CPUFactors | None:
    """Compute, memory and attention tables of the CPU in ``dtype``; None when not measured."""
    gemm_rows = (_of_dtype(check_rows(meas.get("cpu_gemv"), GEMM_KEYS, "measurements.cpu_gemv"), dtype)
                 + _of_dtype(check_rows(meas.get("cpu_gemm"), GEMM_KEYS, "measurements.cpu_gemm"), dtype))
    if not gemm_rows:
        return None
    th = float(hw.cpu.peak_flops_per_s[dtype])
    bw = float(hw.cpu.memory_bandwidth_bytes_per_s)
    disp = (meas.get("cpu_op_dispatch") or {}).get(dtype) or {}
    eff_c, eff_m, n = derive_gemm(gemm_rows, th, bw, float(disp.get("linear_call_s", 0.0)))
    notes += [f"CPU {dtype}: {x}" for x in n]
    attn_rows = _of_dtype(check_rows(meas.get("cpu_attention"), ATTENTION_KEYS, "measurements.cpu_attention"), dtype)
    first = [r for r in attn_rows if (r["heads"], r["kv_heads"], r["head_dim"])
             == (attn_rows[0]["heads"], attn_rows[0]["kv_heads"], attn_rows[0]["head_dim"])] if attn_rows else []
    # SDPA's dispatch cost is taken out of SDPA rows; the native kernel's rows carry their own call
    attn_call_s = 0.0 if any(r.get("kernel") == "native" for r in attn_rows) else float(disp.get("sdpa_call_s", 0.0))
    eff_a = derive_attention(first, th, bw, eff_c, attn_call_s)[0] if first else None
    derived = derive_attention_by_layout(attn_rows, th, bw, eff_c, attn_call_s)
    by_layout = {k: mean for k, (mean, _) in derived.items()}
    by_layout_batch = {k: tables for k, (_, tables) in derived.items()}
    if eff_a is None:
        notes.append(f"CPU {dtype} attention not measured: KV reads use the weight-streaming factor")
    all_head_rows = _of_dtype(check_rows(meas.get("cpu_head_gemv"), GEMM_KEYS, "measurements.cpu_head_gemv"), dtype)
    heads = {}  # False: an untied head's kernel; True: a tied one's, where it differs (rows marked `tied`)
    for tied in (False, True):
        head_rows = [r for r in all_head_rows if bool(r.get("tied")) == tied]
        if head_rows:
            head_c, head_m, n = derive_gemm(head_rows, th, bw, float(disp.get("linear_call_s", 0.0)))
            heads[tied] = (head_c, head_m)
            notes += [f"CPU {dtype} {'tied ' if tied else ''}LM head: {x}" for x in n]
    head_c, head_m = heads.get(False, (None, None))
    expert_c = expert_m = None
    expert_rows = _of_dtype(check_rows(meas.get("cpu_experts"), EXPERT_KEYS, "measurements.cpu_experts"), dtype)
    if expert_rows:
        expert_c, expert_m, n = derive_gemm([expert_gemm_row(r) for r in expert_rows], th, bw)
        notes += [f"CPU {dtype} routed experts: {x}" for x in n]
    exec_rows = _of_dtype(check_rows(meas.get("cpu_executor_layers"), EXECUTOR_LAYER_KEYS,
                                     "measurements.cpu_executor_layers"), dtype)
    stack_layer, stack_step = stack_tables(_of_dtype(check_rows(meas.get("cpu_stack_overhead"), STACK_KEYS,
                                                                "measurements.cpu_stack_overhead"), dtype))
    split_rows = _of_dtype(check_rows(meas.get("cpu_split_linear"), SPLIT_LINEAR_KEYS,
                                      "measurements.cpu_split_linear"), dtype)
    split_linear = Table([r["tokens"] for r in split_rows], [r["time_s"] / r["reference_time_s"] for r in split_rows],
                         *SPLIT_LINEAR_RANGE, log_y=True) if split_rows else None
    layer_rows = _of_dtype(check_rows(meas.get("cpu_layers"), LAYER_KEYS, "measurements.cpu_layers"), dtype)
    overhead = prefill_attention = None
    if layer_rows:  # real layers: the decode overhead, the compute factor of prefill layers and of their
        # attention core (layer_fit.py)
        overhead, eff_layers, attn_layers, prefill_attention = derive_layers(layer_rows, th, bw, eff_c, eff_m, eff_a,
                                                                             float(DTYPE_BYTES[dtype]))
        eff_c, eff_a = eff_layers or eff_c, attn_layers or eff_a
    return CPUFactors(eff_c, eff_m, eff_a, overhead, head_c, head_m, *heads.get(True, (None, None)),
                      attention_by_layout=by_layout or None,
                      attention_by_layout_batch=by_layout_batch or None, expert_compute=expert_c,
                      expert_memory=expert_m, prefill_attention=prefill_attention, split_linear=split_linear,
                      executor_extra_s=executor_extra_s(exec_rows, layer_rows),
                      executor_extra_by_bytes=executor_extra_by_bytes(exec_rows, layer_rows, dtype),
                      stack_layer_s=stack_layer, stack_step_s=stack_step)


def normalised_blocks(meas: dict) -> list[dict]:
    """The block kernels' rows brought to the calibration's reference memory state as the float
    GEMV rows are (``memory_state.normalised``, each by the probe taken around its own runs), the
    memory-bound share of each judged against the best rate the float32 GEMV or any block row
    streamed at: a block kernel that streams at half that rate is half held by its arithmetic,
    which the memory state does not move. The float rows are normalised on their own (unchanged
    by these)."""
    rows = meas.get(BLOCK_PART)
    if not isinstance(rows, list) or not rows:
        return rows
    gemv = [r for r in meas.get("cpu_gemv") or () if isinstance(r, dict) and r.get("dtype") == "float32"]
    return normalised({"memory_state": meas.get("memory_state"), "cpu_gemv": gemv + rows})["cpu_gemv"][len(gemv):]


def block_factors(meas: dict, hw: Hardware, notes: list[str]) -> dict[str, BlockFactors]:
    """Compute and memory tables of the block kernels on each GGUF format measured (``BLOCK_PART``
    rows), by :func:`derive_gemm` as the float GEMV/GEMM rows: memory from the GEMV at the fewest
    rows, compute from what is left. The reference peak is the CPU's float32 one (the int8 dots have
    no peak of their own in the hardware database): a kernel beating it gets a compute factor above 1.
    The float32 linear's call cost is taken out, as from the float rows (the estimator charges the
    call once per layer, in the overhead). {} where the file has none (older files)."""
    rows = check_rows(meas.get(BLOCK_PART), GEMM_KEYS, f"measurements.{BLOCK_PART}")
    bad = [i for i, r in enumerate(rows) if not isinstance(r.get("format"), str)]
    if bad:
        raise ValueError(f"`measurements.{BLOCK_PART}` row {bad[0]} lacks or has a bad format (a GGUF format name)")
    by_format: dict[str, list[dict]] = {}
    for r in rows:
        by_format.setdefault(r["format"], []).append(r)
    th, bw = float(hw.cpu.peak_flops_per_s["float32"]), float(hw.cpu.memory_bandwidth_bytes_per_s)
    call_s = float(((meas.get("cpu_op_dispatch") or {}).get("float32") or {}).get("linear_call_s", 0.0))
    out = {}
    for fmt, fmt_rows in by_format.items():
        compute, memory, n = derive_gemm(fmt_rows, th, bw, call_s)
        notes += [f"CPU {fmt} blocks: {x}" for x in n]
        out[fmt] = BlockFactors(compute, memory)
    return out


def from_measurements(meas: dict, settings: dict, hw: Hardware, source: str) -> CalibratedEfficiency:
    """Factors of ``hw`` that reproduce the measurements ``meas`` (a calibration file's
    ``measurements`` section). Raises ValueError/KeyError/TypeError on malformed content."""
    block_rows = normalised_blocks(meas)
    meas = normalised(meas)  # memory-bound times at one memory state (memory_state.py; older files: as is)
    defaults = DefaultEfficiency.for_hardware(hw)
    notes: list[str] = []
    cpu = {}
    for dtype in settings["cpu_dtypes"]:
        f = cpu_factors(meas, dtype, hw, notes)
        if f is not None:
            cpu[dtype] = f
    if not cpu:
        raise ValueError("no CPU GEMV/GEMM measurements")
    for dtype in dict.fromkeys([hw.cpu.compute_dtype, "float32"]):
        if dtype not in cpu:
            notes.append(f"CPU {dtype} not measured: its factors are defaults")
    layer = _part(meas, "cpu_layer_overhead", dict)
    cpu_overhead = float(layer["time_s"]) if layer else defaults.cpu_layer_overhead_s()
    if not layer:
        notes.append("CPU per-layer overhead not measured: default")
    gen = meas.get("cpu_generate_step")
    step_overhead = StepOverhead(defaults.cpu_step_overhead_s(), 0.0)
    if isinstance(gen, list) and gen:  # the toy model's one layer is in the step time: take it out
        xs = np.array([float(r["batch"]) * float(r["vocab"]) for r in gen])
        ys = np.array([max(_stat_s(r) - int(r.get("layers", 1)) * cpu_overhead, 0.0) for r in gen])
        fit = fit_step_overhead(xs, ys)
        # a step never costs nothing: a fit of 0 means the layer overhead's own timing (noisier on a
        # busy machine) took all of the step's, so the default stands rather than a free loop
        if fit.base_s > 0 or fit.per_logit_s > 0:
            step_overhead = fit
        else:
            notes.append("generate() step overhead measured at 0 beyond the layer overhead (noisy timings): default")
    else:
        notes.append("generate() step overhead not measured: default")
    sweep = _part(meas, "cpu_threads", dict)
    threads = best_threads(sweep["sweep"]) if sweep else None

    gpu_c = gpu_m = h2d = d2h = None
    gpu_overhead = defaults.gpu_layer_overhead_s()
    under_copy = 1.0
    gpu_rows = (check_rows(meas.get("gpu_gemv"), GEMM_KEYS, "measurements.gpu_gemv")
                + check_rows(meas.get("gpu_gemm"), GEMM_KEYS, "measurements.gpu_gemm"))
    if hw.gpu is not None and gpu_rows:
        gpu_dtype = settings.get("gpu_dtype") or "bfloat16"
        gpu_c, gpu_m, n = derive_gemm(gpu_rows, float(hw.gpu.peak_flops_per_s[gpu_dtype]),
                                      float(hw.gpu.memory_bandwidth_bytes_per_s))
        notes += [f"GPU: {x}" for x in n]
        g_layer = _part(meas, "gpu_layer_overhead", dict)
        if g_layer and float(g_layer["time_s"]) > GPU_LAYER_OVERHEAD_MAX_S:
            notes.append(f"GPU per-layer overhead measured {float(g_layer['time_s']) * 1e3:.1f} ms, more than "
                         f"{GPU_LAYER_OVERHEAD_MAX_S * 1e3:.0f} ms of kernel launches can take: default "
                         f"{gpu_overhead * 1e6:.0f} us used (re-calibrate)")
        elif g_layer:
            gpu_overhead = float(g_layer["time_s"])
    elif hw.gpu is not None:
        notes.append("no GPU measurements in this calibration: GPU factors are defaults")
    if hw.link is not None:
        if check_rows(meas.get("h2d"), ("bytes", "time_s"), "measurements.h2d"):
            h2d = derive_link(meas["h2d"], hw.link.h2d_bandwidth_bytes_per_s)
        if check_rows(meas.get("d2h"), ("bytes", "time_s"), "measurements.d2h"):
            d2h = derive_link(meas["d2h"], hw.link.d2h_bandwidth_bytes_per_s)
        if h2d is None or d2h is None:
            notes.append("link not measured: Eff_ICN is the default")
    contention = _part(meas, "cpu_under_copy", dict)
    under_copy_table = None
    if contention:
        under_copy = max(1.0, float(contention["factor"]))
        under_copy_table = under_copy_by_tokens(contention)
    else:
        notes.append("CPU slowdown under a host-to-device copy not measured"
                     + (" (no GPU)" if hw.gpu is None else "") + ": 1.0")
    blocks = block_factors({**meas, BLOCK_PART: block_rows}, hw, notes)
    primary = hw.cpu.compute_dtype if hw.cpu.compute_dtype in cpu else next(iter(cpu))
    return CalibratedEfficiency(
        cpu=cpu, cpu_dtype=primary, cpu_overhead_s=cpu_overhead, threads=threads, under_copy=under_copy,
        gpu_compute_table=gpu_c, gpu_memory_table=gpu_m, h2d_table=h2d, d2h_table=d2h, gpu_overhead_s=gpu_overhead,
        defaults=defaults, step_overhead=step_overhead, source=source, notes=tuple(notes),
        under_copy_table=under_copy_table, blocks=blocks)
