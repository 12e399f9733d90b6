"""One serving iteration's sub-batch costs, from flexplan's estimator terms and calibrated
efficiency only (no separate profiling tables; NEO section 3.2 profiles, we price).

Per transformer layer, in NEO's (section 3.2) and APEX's (section 3.2) names:

- ``t_l_s(tokens)``: T_l = T_pr + T_po, the accelerator's linear time (pre-projection, post-projection
  and MLP) for ``tokens`` new tokens; APEX's T_glinear. Roofline of the layer's GEMMs
  (``terms.t_on_device_s``) plus the per-layer launch overhead.
- ``t_ga_s(context_lens)``: T_ga, the accelerator's decode attention over the device-KV decodes'
  contexts; APEX's T_gatt.
- ``t_ca_s(context_lens)``: T_ca, the CPU's decode attention over the host-KV decodes' contexts
  (``terms.t_cpu_attention_s``: the calibrated ``Efficiency.cpu_attention``), plus the q/k/v and
  output crossing the link (NEO's "Comm").
- ``t_pa_s(chunks)``: prefill attention of the chunks on the accelerator (their causal pairs
  over the context already cached plus the chunk).
- ``t_iteration_overhead_s(rows)``: T_prl + T_pol, the LM head of the rows that sample.

Per-layer terms are memoised by token count (batches repeat sizes); the attention terms per context
length are tabled once per model and hardware (contexts up to TABLE_CONTEXT_TOKENS; the estimator
itself beyond) and an iteration sums a numpy lookup. ``NeoApexScheduler.schedule`` as a whole:
``benchmarks/bench_scheduler_cost.py`` (not a timed test).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from flexplan.errors import InvalidInputError
from flexplan.estimator.efficiency import Efficiency
from flexplan.estimator.terms import (
    Shape,
    t_compute_s,
    t_link_s,
    t_memory_s,
    t_on_device_s,
)
from flexplan.estimator.terms import t_cpu_attention_s as _t_cpu_attention_per_request_s
from flexplan.hardware.spec import DTYPE_BYTES, Hardware
from flexplan.workload import costs
from flexplan.workload.model import ModelSpec

TABLE_CONTEXT_TOKENS = 131072  # contexts priced once per model and hardware (1 MiB per table)


class IterationCost:
    """The per-layer terms of one iteration of ``spec`` on ``hw`` with factors ``eff``; the
    accelerator and the host KV in ``dtype`` (float16 by default)."""

    def __init__(self, spec: ModelSpec, hw: Hardware, eff: Efficiency, dtype: str | None = None):
        if hw.gpu is None or hw.link is None:
            raise InvalidInputError(f"{hw.name if hasattr(hw, 'name') else hw}: no accelerator, no sub-batch "
                                    "costs (a CPU-only engine schedules first come, first served)")
        self.spec, self.hw, self.eff = spec, hw, eff
        # float16 as NEO and APEX serve (a host KV in bfloat16 converts each element on a CPU without
        # bfloat16 arithmetic, the cost terms.host_kv_attention_dtype prices)
        self.dtype = dtype or ("float16" if "float16" in hw.gpu.peak_flops_per_s else "bfloat16")
        self.dtype_bytes = DTYPE_BYTES[self.dtype]
        self.num_layers = spec.num_layers
        self._shape1 = Shape(model=spec, batch=1, input_len=1, output_len=2, dtype=self.dtype, cpu_dtype="float32")
        # the accelerator's rates, looked up once
        self._peak_flops = hw.gpu.peak_flops_per_s[self.dtype]
        self._bw_bytes_per_s = hw.gpu.memory_bandwidth_bytes_per_s
        self._layer_overhead_s = eff.gpu_layer_overhead_s()
        self._pair_flops = float(costs.attention_flops_per_pair(spec))
        self._kv_bytes_per_token = float(spec.kv_elems_per_token * self.dtype_bytes)
        qkv, out = costs.d_attention_io(spec, 1, self.dtype_bytes)
        self._link_per_request_s = (t_link_s(qkv, hw.link.d2h_bandwidth_bytes_per_s, eff.d2h(qkv))
                                    + t_link_s(out, hw.link.h2d_bandwidth_bytes_per_s, eff.h2d(out)))
        self.t_l_s = lru_cache(maxsize=4096)(self._t_l_s)
        self._head_s = lru_cache(maxsize=4096)(self._t_head_s)
        # per-context tables, one vectorised estimator call each: the terms depend on a request's
        # context alone, so an iteration indexes and sums instead of re-deriving the layer spans
        ctx_grid = np.arange(TABLE_CONTEXT_TOKENS + 1, dtype=float)
        self._keys_table = np.asarray(costs.mean_keys_read(spec, np.maximum(ctx_grid, 1.0)), dtype=float)
        self._t_ca_table_s = self._t_ca_direct_s(np.maximum(ctx_grid, 1.0))

    # ---- T_l: linear (GEMMs) ----
    def _t_l_s(self, tokens: int) -> float:
        """T_l for ``tokens`` rows: C / (TH x Eff_comp) + D / (BW x Eff_mem) + the layer's launches;
        0 for no tokens (an empty sub-batch launches nothing)."""
        if tokens <= 0:
            return 0.0
        m, b = self.spec, int(tokens)
        return t_on_device_s(costs.c_decode_linear(m, b), costs.d_decode(m, b, self.dtype_bytes, self.dtype_bytes),
                             self._peak_flops, self._bw_bytes_per_s, self.eff.gpu_compute(b),
                             self.eff.gpu_memory(b), overhead_s=self._layer_overhead_s)

    # ---- T_ga: the accelerator's decode attention ----
    def t_ga_s(self, context_lens) -> float:
        """T_ga over the device-KV decodes: their KV read at the accelerator's memory rate plus
        their attention FLOPs (decode attention is bandwidth-bound: NEO section 2.2)."""
        ctx = np.asarray(context_lens, dtype=float)
        if ctx.size == 0:
            return 0.0
        keys = float(np.sum(self._lookup(self._keys_table, ctx, lambda c: costs.mean_keys_read(self.spec, c))))
        b = int(ctx.size)
        return (t_memory_s(keys * self._kv_bytes_per_token, self._bw_bytes_per_s, self.eff.gpu_memory(b))
                + t_compute_s(keys * self._pair_flops, self._peak_flops, self.eff.gpu_compute(b)))

    # ---- T_ca: the CPU's decode attention beside the host KV ----
    def t_ca_s(self, context_lens) -> float:
        """T_ca over the host-KV decodes: ``terms.t_cpu_attention_s`` per request (calibrated
        Eff_attn by context), summed, plus each request's q/k/v down and output up the link."""
        ctx = np.asarray(context_lens, dtype=float)
        if ctx.size == 0:
            return 0.0
        return float(np.sum(self._lookup(self._t_ca_table_s, ctx, self._t_ca_direct_s)))

    def t_ca_each_s(self, context_lens) -> np.ndarray:
        """T_ca of each host-KV decode alone (T_ca is their sum): what NEO's balance adds one by one."""
        ctx = np.asarray(context_lens, dtype=float)
        if ctx.size == 0:
            return np.zeros(0)
        return self._lookup(self._t_ca_table_s, ctx, self._t_ca_direct_s)

    def _t_ca_direct_s(self, ctx: np.ndarray) -> np.ndarray:
        """T_ca of each context from the estimator's term (the tables' source)."""
        return _t_cpu_attention_per_request_s(self._shape1, self.hw, self.eff, ctx) + self._link_per_request_s

    @staticmethod
    def _lookup(table: np.ndarray, ctx: np.ndarray, direct) -> np.ndarray:
        """``table`` at integer contexts within it; the estimator itself (``direct``) beyond."""
        idx = ctx.astype(np.int64)
        if idx.size and idx.max() < table.size and np.array_equal(idx, ctx):
            return table[idx]
        return np.asarray(direct(ctx), dtype=float)

    # ---- prefill attention ----
    def t_pa_s(self, chunks) -> float:
        """Prefill attention of ``chunks`` ((cached tokens, chunk tokens) pairs) on the accelerator:
        each chunk's queries over the cached keys plus the causal pairs within it, compute-bound."""
        if not chunks:
            return 0.0
        arr = np.asarray(chunks, dtype=float).reshape(-1, 2)
        cached, n = arr[:, 0], arr[:, 1]
        pairs = float(np.sum(n * cached + n * (n + 1) / 2))
        rows = int(np.sum(n))
        return t_compute_s(pairs * self._pair_flops, self._peak_flops, self.eff.gpu_compute(rows))

    # ---- T_prl + T_pol ----
    def _t_head_s(self, rows: int) -> float:
        if rows <= 0:
            return 0.0
        m = self.spec
        return t_on_device_s(costs.c_lm_head(m, rows), costs.d_lm_head(m, self.dtype_bytes), self._peak_flops,
                             self._bw_bytes_per_s, self.eff.gpu_compute(rows), self.eff.gpu_memory(rows))

    def t_iteration_overhead_s(self, rows: int) -> float:
        """T_prl + T_pol: the LM head over the ``rows`` that sample (NEO: under 5% of T)."""
        return self._head_s(int(rows))
