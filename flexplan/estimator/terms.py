"""The time terms of FlexInfer's Equations 1-3, one small function each.

:func:`phase_work` gathers, for one phase, the per-layer Table 2 quantities (from
``flexplan/workload/costs.py``) at the dtypes of each device; ``phase_costs.phase_costs`` turns
them into the time each device takes for one layer. Decode quantities are numpy arrays with one entry per
decode step (the KV cache grows by one token per step); prefill quantities are scalars.
Calibration (``calibration/efficiency.py``), the executor's FLOP count (``executor/stats.py``)
and ``flexplan run``'s achieved bandwidth (``run_cmd.py``) call these functions rather than
retyping the formulas.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from flexplan.estimator.dequant_terms import t_gpu_dequant_layer_s
from flexplan.estimator.efficiency import (
    Efficiency,
    block_formats,
    cpu_attention_for_layout,
    cpu_block_factors,
    cpu_prefill_attention,
)
from flexplan.hardware.spec import DTYPE_BYTES, Hardware, cpu_weight_dtype
from flexplan.quant.formats import BY_NAME
from flexplan.workload import costs, weight_formats
from flexplan.workload.model import ModelSpec


def t_compute_s(flops, peak_flops_per_s: float, eff: float):
    """C / (TH x Eff)."""
    return flops / (peak_flops_per_s * eff)


def t_memory_s(n_bytes, bandwidth_bytes_per_s: float, eff):
    """D / (BW x Eff)."""
    return n_bytes / (bandwidth_bytes_per_s * eff)


def t_link_s(n_bytes, bandwidth_bytes_per_s: float, eff: float):
    """D_CPU->GPU / (BW_ICN x Eff_ICN) (or the reverse direction)."""
    return n_bytes / (bandwidth_bytes_per_s * eff)


def t_on_device_s(flops, n_bytes, peak_flops_per_s: float, bandwidth_bytes_per_s: float, eff_compute, eff_memory,
                  kv_bytes=0.0, eff_kv=1.0, overhead_s=0.0):
    """One layer (or the LM head) on one device: the bracket of Eq. 1 and the first argument of
    Eq. 2's max, C / (TH x Eff_Comp) + D / (BW x Eff_Mem), plus the KV cache read at its own
    factor (D_KVCache / (BW x Eff_attn); 0 where D already holds it) and a fixed overhead."""
    return (t_compute_s(flops, peak_flops_per_s, eff_compute) + t_memory_s(n_bytes, bandwidth_bytes_per_s, eff_memory)
            + t_memory_s(kv_bytes, bandwidth_bytes_per_s, eff_kv) + overhead_s)


def t_cpu_prefill_attention_s(w: "PhaseWork", peak_flops_per_s: float, eff: Efficiency, dtype: str) -> float:
    """The attention core of a CPU prefill layer (scores, mask, softmax, weighted values over the
    causal pairs), apart from its GEMMs: C_attn / (TH x Eff_attn,prefill). Its FLOPs grow with
    s^2 and run far below the GEMMs' rate (per-head products a head dim deep, a mask and a softmax
    between them), so one compute factor by tokens could not price a 1 x 512 prompt and a 4 x 128
    batch (same GEMM rows) at once."""
    if not w.prefill_attention_flops:
        return 0.0
    return t_compute_s(w.prefill_attention_flops, peak_flops_per_s, cpu_prefill_attention(eff, w.rows, dtype))


def c_gemm(tokens, k: int, n: int) -> float:
    """FLOPs of one (tokens x k) by (k x n) GEMM: 2 t k n (workload/costs.py's convention)."""
    return 2.0 * tokens * k * n


def d_gemm(tokens, k: int, n: int, dtype_bytes: float) -> float:
    """Bytes one GEMM moves: its weight plus its activations in and out, (k n + t (k + n)) x bytes
    (costs.d_prefill / d_decode are sums of these over a layer's GEMMs)."""
    return (k * n + tokens * (k + n)) * float(dtype_bytes)


@dataclass(frozen=True)
class Shape:
    model: ModelSpec
    batch: int
    input_len: int
    output_len: int
    dtype: str  # GPU and pinned host dtype
    cpu_dtype: str
    # the weights held as blocks (a GGUF file's, ModelSpec.stored_weights, or quantised at load), on the
    # CPU and, where the plan puts layers there, on the accelerator; (): in the dtypes
    weights: tuple[tuple[str, str, int], ...] = ()
    # whether an all-CPU decode of this shape may run the executor's native stack (phase_costs): False for
    # the serving engine's iterations, which run each layer's native calls over its paged KV instead
    native_stack: bool = True

    @property
    def w_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def cpu_bytes(self) -> int:
        """Bytes per element of what the CPU computes on (activations, KV cache, norms)."""
        return DTYPE_BYTES[self.cpu_dtype]

    @property
    def cpu_weight_bytes(self) -> float:
        """Bytes per element of the CPU's layer weights (spec.cpu_weight_dtype: a 16-bit model
        stays 16-bit under float32 compute; kept blocks: their bytes per weight)."""
        if self.weights:
            return weight_formats.layer_bytes_per_weight(self.weights)
        return DTYPE_BYTES[cpu_weight_dtype(self.dtype, self.cpu_dtype)]

    @property
    def cpu_head_weight_bytes(self) -> float:
        """Bytes per element of the CPU's LM head (the embedding's where it is tied)."""
        if self.weights:
            return weight_formats.head_bytes_per_weight(self.weights)
        return self.cpu_weight_bytes

    @property
    def gpu_weight_bytes(self) -> float:
        """Bytes per element of a layer's weights on the accelerator and over the link: the blocks
        where a kernel format holds them, the rest (embedding, routed experts, norms, F32 tensors)
        in the plan's dtype; all at ``w_bytes`` without blocks. Its GEMMs read them dequantised, at
        ``w_bytes`` (PhaseWork.d_gpu), after dequant_terms' D."""
        if self.weights:
            return weight_formats.layer_bytes_per_weight(self.weights, float(self.w_bytes))
        return float(self.w_bytes)

    @property
    def gpu_head_weight_bytes(self) -> float:
        """Bytes per element of the LM head on the accelerator: its blocks (a tied head: the
        embedding's) where a kernel format holds them, else ``w_bytes``."""
        if self.weights:
            return weight_formats.head_bytes_per_weight(self.weights, float(self.w_bytes))
        return float(self.w_bytes)

    @property
    def cpu_layer_formats(self) -> tuple[tuple[str | None, float, float], ...]:
        """The layers' weights by the kernel that reads them: (GGUF block format, or None for those
        held in float32; its share of the layers' weight bytes; its share of their parameters);
        () where the weights are in the plan's dtypes."""
        return layer_format_shares(self.weights) if self.weights else ()

    @property
    def cpu_head_format(self) -> str | None:
        """The GGUF block format the LM head's kernel reads (the embedding's blocks where the file
        has no head of its own); None where the head is in float32 or the plan's dtype."""
        return head_block_format(self.weights) if self.weights else None

    @property
    def decode_context_lens(self) -> np.ndarray:
        """Keys attended at each decode step: the first output token comes from prefill, so
        decode step k (1..o-1) feeds token k and attends over s + k keys."""
        return self.input_len + np.arange(1, max(self.output_len, 2), dtype=float)

    @property
    def decode_steps(self) -> int:
        return max(self.output_len - 1, 0)


def _kernel_format(format_name: str, group: str) -> str | None:
    """``format_name`` where a block kernel reads the weights of ``group`` stored in it (as
    weight_formats holds them), else None (held in float32)."""
    f = BY_NAME.get(format_name)
    return format_name if f is not None and f.native_kernel and group not in weight_formats.DEQUANTISED_GROUPS else None


@lru_cache(maxsize=256)
def layer_format_shares(weights: weight_formats.Weights) -> tuple[tuple[str | None, float, float], ...]:
    """:attr:`Shape.cpu_layer_formats` of ``weights`` ((group, format, parameters) triples)."""
    params: dict[str | None, float] = {}
    nbytes: dict[str | None, float] = {}
    for group, fmt, p in weights:
        if group in weight_formats.LAYER_GROUPS:
            key = _kernel_format(fmt, group)
            params[key] = params.get(key, 0.0) + p
            nbytes[key] = nbytes.get(key, 0.0) + p * weight_formats.held_bytes_per_weight(fmt, group)
    total_p, total_b = sum(params.values()), sum(nbytes.values())
    if not total_p or not total_b:
        return ()
    return tuple((k, nbytes[k] / total_b, params[k] / total_p) for k in sorted(params, key=lambda k: -params[k]))


def head_block_format(weights: weight_formats.Weights) -> str | None:
    """:attr:`Shape.cpu_head_format` of ``weights`` (the group's format with the most parameters)."""
    group = "lm_head" if any(g == "lm_head" for g, _, _ in weights) else "embedding"
    held = [(p, f) for g, f, p in weights if g == group]
    if not held:
        return None
    fmt = max(held)[1]
    return fmt if _kernel_format(fmt, "lm_head") else None


def cpu_layer_factors(shape: Shape, eff: Efficiency, rows):
    """(Eff_comp, Eff_mem) of a CPU layer at ``rows`` tokens per GEMM: the float factors of the
    CPU's dtype, or, for weights held as blocks, each format's time at its own block kernels'
    factors (``efficiency.cpu_block_factors``: the float32 ones where the format was not
    calibrated) added up, 1 / Eff = sum of share_f / Eff_f with the formats' shares of the weight
    bytes (memory) and of the parameters (compute: each weight's FLOPs). A Q4_K_M file's Q4_K and
    Q6_K tensors are each priced at their own rate, not all at the most common format's; the
    layer's attention FLOPs and activation bytes (a small part in decode) go with the weights'."""
    cd = shape.cpu_dtype
    mix = shape.cpu_layer_formats
    if not mix:
        return eff.cpu_compute(rows, cd), eff.cpu_memory(rows, cd)
    inv_c = inv_m = 0.0
    for fmt, byte_share, param_share in mix:
        eff_c, eff_m = (cpu_block_factors(eff, rows, fmt, cd) if fmt is not None
                        else (eff.cpu_compute(rows, cd), eff.cpu_memory(rows, cd)))
        inv_c, inv_m = inv_c + param_share / eff_c, inv_m + byte_share / eff_m
    return 1.0 / inv_c, 1.0 / inv_m


def cpu_head_factors(shape: Shape, eff: Efficiency, rows):
    """(Eff_comp, Eff_mem) of the CPU's LM head: its block format's kernels' factors where they
    were calibrated (the block GEMV rows' shapes: a tall head GEMV is not timed per format), else
    the head GEMV's own (``cpu_head_compute`` / ``cpu_head_memory``; a tied head's in a 16-bit CPU)."""
    fmt, cd = shape.cpu_head_format, shape.cpu_dtype
    if fmt is not None and fmt in block_formats(eff):
        return cpu_block_factors(eff, rows, fmt, cd)
    tied = shape.model.tie_word_embeddings
    return eff.cpu_head_compute(rows, cd, tied), eff.cpu_head_memory(rows, cd, tied)


@dataclass(frozen=True)
class PhaseWork:
    """Table 2 for one layer and one step of a phase, at the dtypes of the device that computes it."""

    phase: str
    tokens_per_seq: int  # s for prefill, 1 for decode
    rows: int  # tokens per GEMM: b s in prefill, b in decode
    context_len: object  # keys attended at each decode step (None in prefill)
    flops: object  # C_Prefill / C_Decode
    prefill_attention_flops: float  # the attention core's part of C_Prefill (quadratic in s); 0 in decode
    d_cpu: float  # D_Prefill / D_Decode at the CPU's weight and activation dtypes
    d_gpu: float  # ... at the GPU dtype
    kv_read_cpu: object  # D_KVCache the CPU's attention reads (decode: all ctx keys; prefill: 0)
    kv_write_cpu: float  # the new K, V the CPU writes
    kv_read: object  # the cached part at the GPU dtype, before this step's token (what a streamed layer loads)
    kv_write: float  # the new K, V at the GPU dtype
    weight_bytes_cpu: float
    weight_bytes_gpu: float  # as the accelerator holds them and the link carries them (Shape.gpu_weight_bytes)
    head_flops: float
    head_bytes_cpu: float
    head_bytes_gpu: float  # ... the LM head (Shape.gpu_head_weight_bytes)
    hidden_bytes: float  # D_Output
    logits_bytes: float

    @property
    def cpu_memory_bytes(self):
        """What one CPU layer moves through host memory per step: D + D_KVCache read and written."""
        return self.d_cpu + self.kv_write_cpu + self.kv_read_cpu

    @property
    def gpu_memory_bytes(self):
        """What one GPU layer moves through device memory per step."""
        return self.d_gpu + self.kv_read + self.kv_write


def phase_work(shape: Shape, phase: str) -> PhaseWork:
    """The Table 2 quantities of ``phase`` (workload/costs.py) at each device's dtypes."""
    m, b = shape.model, shape.batch
    wb, cwb, cb = shape.w_bytes, shape.cpu_weight_bytes, shape.cpu_bytes
    if phase == "prefill":
        s = shape.input_len
        tokens_per_seq, rows, ctx = s, b * s, None
        flops, attn_flops = costs.c_prefill(m, b, s), costs.c_prefill_attention(m, b, s)
        d_cpu, d_gpu = costs.d_prefill(m, b, s, cwb, cb), costs.d_prefill(m, b, s, wb, wb)
        kv_read_cpu = kv_read = 0.0  # nothing cached yet; the prompt's K, V are produced by the layer
        kv_write, kv_write_cpu = costs.d_kv_write(m, b, s, wb), costs.d_kv_write(m, b, s, cb)
    else:
        ctx = shape.decode_context_lens
        tokens_per_seq, rows = 1, b
        flops, attn_flops = costs.c_decode(m, b, ctx), 0.0
        d_cpu, d_gpu = costs.d_decode(m, b, cwb, cb), costs.d_decode(m, b, wb, wb)
        kv_read_cpu = costs.d_kv_cache(m, b, ctx, cb)
        kv_read = costs.d_kv_cache(m, b, ctx - 1, wb)  # cached part, before this token
        kv_write, kv_write_cpu = costs.d_kv_write(m, b, 1, wb), costs.d_kv_write(m, b, 1, cb)
    return PhaseWork(
        phase=phase, tokens_per_seq=tokens_per_seq, rows=rows, context_len=ctx, flops=flops,
        prefill_attention_flops=attn_flops, d_cpu=d_cpu,
        d_gpu=d_gpu, kv_read_cpu=kv_read_cpu, kv_write_cpu=kv_write_cpu, kv_read=kv_read, kv_write=kv_write,
        weight_bytes_cpu=costs.d_weights(m, cwb), weight_bytes_gpu=costs.d_weights(m, shape.gpu_weight_bytes),
        head_flops=costs.c_lm_head(m, b), head_bytes_cpu=costs.d_lm_head(m, shape.cpu_head_weight_bytes),
        head_bytes_gpu=costs.d_lm_head(m, shape.gpu_head_weight_bytes),
        hidden_bytes=costs.d_output(m, b, tokens_per_seq, wb), logits_bytes=costs.d_logits(m, b))


@dataclass(frozen=True)
class PhaseCosts:
    """One layer's time on each device and over the link, for one phase."""

    phase: str
    tokens_per_seq: int  # s for prefill, 1 for decode
    t_cpu_layer_s: object  # Eq. 1 bracket
    t_gpu_layer_s: object  # Eq. 2 first argument of max (with t_gpu_dequant_s: blocks dequantised every call)
    t_load_weights_s: float  # one layer's weights over the link
    t_load_kv_s: object  # one layer's cached KV over the link (streamed KV)
    t_store_kv_s: float  # one layer's new KV back to host (streamed KV)
    t_hidden_h2d_s: float  # D_Output over the link (host embedding -> first GPU layer, or the split)
    t_logits_d2h_s: float
    t_cpu_head_s: object
    t_gpu_head_s: object  # with its blocks' dequantisation
    t_load_head_s: float
    weight_bytes_gpu: float  # one layer, GPU dtype
    kv_read_bytes: object  # one layer's cached KV read per step
    kv_write_bytes: float
    hidden_bytes: float
    logits_bytes: float
    head_bytes_gpu: float
    cpu_under_copy: float  # slowdown of CPU compute while H2D copies run (Park & Egger 4.1)
    cpu_attention: "CPUAttentionCosts | None" = None  # decode attention beside a host KV cache (decode only)
    experts: object = None  # expert_terms.ExpertSplit: an MoE layer's routed experts on the CPU (None: dense / no GPU)
    operators: object = None  # operator_terms.OperatorCosts: C, G, H per operator of a split layer (None: no GPU)
    t_gpu_dequant_s: float = 0.0  # Park & Egger's D of one layer's blocks on the accelerator (0: float weights)
    t_gpu_head_dequant_s: float = 0.0  # ... of the LM head's
    # an all-CPU decode step the executor's native stack runs (phase_costs): (one layer, the LM head with
    # the step's loop) at that path's overheads; None: the layer calls' terms above price it
    t_cpu_stack_s: tuple | None = None


@dataclass(frozen=True)
class CPUAttentionCosts:
    """One streamed decode layer whose attention computes on the CPU beside its host KV cache
    (FlexGen's ``cpu_cache_compute``, NEO section 3): per decode step (arrays over the steps)."""

    t_gpu_linear_s: object  # the layer on the accelerator without its attention (projections, MLP; their D)
    t_cpu_attention_s: object  # scores, softmax and weighted values over the host KV + appending the new K, V
    t_qkv_d2h_s: float  # q, k, v of the new token, accelerator -> host
    t_out_h2d_s: float  # the attention output, host -> accelerator
    qkv_bytes: float
    out_bytes: float
    kv_read_bytes: object  # what the CPU attention reads from host memory (instead of the link)


def host_kv_attention_dtype(shape: Shape, hw: Hardware) -> str:
    """The dtype the CPU attends in beside a host KV cache kept in the accelerator's dtype: the
    KV's own (the native kernel reads a float32 or bfloat16 cache as it is, transformers' SDPA
    where it does not cover the layer; calibration times each dtype as the executor runs it),
    where the CPU has a peak for it; else the plan's CPU dtype. Not priced at the float32 factors:
    a bfloat16 cache reads half the bytes but converts each on the way, so it is bound by its
    arithmetic and reads at a lower rate (``benchmarks/bench_cpu_attention_bf16.py`` compares)."""
    return shape.dtype if shape.dtype in hw.cpu.peak_flops_per_s else shape.cpu_dtype


def t_cpu_attention_s(shape: Shape, hw: Hardware, eff: Efficiency, context_len) -> np.ndarray:
    """Decode attention of one layer on the CPU over a host KV cache in the accelerator's dtype:
    D_KVCache / (BW_CPU x Eff_attn(ctx)) + C_attn / (TH_CPU x Eff_CPU,Comp) + the new K, V written,
    with Eff_attn the calibrated CPU attention factor (``eff.cpu_attention``) and windows, GQA and
    latent KV as ``costs.d_kv_cache`` / ``costs.c_decode_attention`` count them. The factors are
    those of the KV's dtype (:func:`host_kv_attention_dtype`), not the plan's CPU dtype."""
    m, b, cd = shape.model, shape.batch, host_kv_attention_dtype(shape, hw)
    bw, th = hw.cpu.memory_bandwidth_bytes_per_s, hw.cpu.peak_flops_per_s[cd]
    kv_read = costs.d_kv_cache(m, b, context_len, shape.w_bytes)
    kv_write = costs.d_kv_write(m, b, 1, shape.w_bytes)
    layout = (m.num_heads, m.num_kv_heads, m.head_dim)
    eff_attn = cpu_attention_for_layout(eff, context_len, cd, layout, b)
    return (t_memory_s(kv_read, bw, eff_attn) + t_memory_s(kv_write, bw, eff.cpu_memory(b, cd))
            + t_compute_s(costs.c_decode_attention(m, b, context_len), th, eff.cpu_compute(b, cd)))


def cpu_attention_costs(shape: Shape, hw: Hardware, eff: Efficiency) -> CPUAttentionCosts | None:
    """The decode terms of attention beside a host KV cache (None without an accelerator)."""
    if hw.gpu is None or hw.link is None:
        return None
    m, b = shape.model, shape.batch
    ctx = shape.decode_context_lens
    gpu, link = hw.gpu, hw.link
    d_linear = costs.d_decode(m, b, shape.w_bytes, shape.w_bytes)
    bw = gpu.memory_bandwidth_bytes_per_s
    t_lin = t_on_device_s(costs.c_decode_linear(m, b), d_linear, gpu.peak_flops_per_s[shape.dtype],
                          bw, eff.gpu_compute(b), eff.gpu_memory(b), overhead_s=eff.gpu_layer_overhead_s())
    t_lin += t_gpu_dequant_layer_s(shape.weights, m, shape.w_bytes, bw, eff.gpu_memory(b))  # blocks: D each call
    qkv, out = costs.d_attention_io(m, b, shape.w_bytes)
    return CPUAttentionCosts(
        t_gpu_linear_s=np.full(ctx.shape, t_lin), t_cpu_attention_s=t_cpu_attention_s(shape, hw, eff, ctx),
        t_qkv_d2h_s=t_link_s(qkv, link.d2h_bandwidth_bytes_per_s, eff.d2h(qkv)),
        t_out_h2d_s=t_link_s(out, link.h2d_bandwidth_bytes_per_s, eff.h2d(out)),
        qkv_bytes=qkv, out_bytes=out, kv_read_bytes=costs.d_kv_cache(m, b, ctx, shape.w_bytes))
