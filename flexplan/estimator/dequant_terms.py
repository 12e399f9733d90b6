"""Park & Egger's D (section 4.2, Eq. 8): the accelerator dequantising a layer's GGUF blocks.

Weights held as blocks (a GGUF file's, or a float checkpoint's linears quantised at load) sit on
the accelerator and cross the link as blocks; each linear there turns its blocks into weights in the
plan's dtype right before its GEMM, every call, in the compute stream, by one fused kernel a matrix
(``flexplan.quant.fused_dequant``: torch_dequant's ops compiled by torch.compile, the default on
CUDA), which reads the blocks once and writes the weights once. Per matrix of p weights in format f:

    D = p (B_f + W) / (BW_GPU x Eff_GPU,Mem(rows)) + t_launch

with B_f the blocks' bytes a weight (``BlockFormat.bytes_per_weight``: Q4_0 0.5625), W the plan's
dtype bytes a weight written (bfloat16 2) and t_launch ``efficiency.GPU_KERNEL_LAUNCH_S``. Float
weights (the embedding, routed experts, norms) take none. The GEMM itself then reads the
dequantised weights at the dtype (``PhaseWork.d_gpu``).

Priced is the fused kernel, since the estimator cannot know whether a target machine's torch
compiles (no Triton, FLEXPLAN_FUSED_DEQUANT=0). Where it does not, the eager fallback runs each of
torch_dequant's ops as its own kernel writing a full intermediate: 13-34 bytes moved a weight in
float32 (Q8_0 13.4, Q4_0 20.9, Q5_1 33.5, Q5_K 34.3) over 4-31 launches a matrix, plus the cast
(4 + W bytes, one launch): in bfloat16 6-15x this D's bytes.
"""

from __future__ import annotations

from functools import lru_cache
from types import MappingProxyType

from flexplan.estimator.efficiency import GPU_KERNEL_LAUNCH_S
from flexplan.quant.formats import BY_NAME
from flexplan.workload import weight_formats

FUSED_LAUNCHES_PER_MATRIX = 1  # the compiled dequantisation is one kernel (fused_dequant)


def _dequantised_on_accelerator(format_name: str) -> bool:
    """Whether the accelerator dequantises ``format_name``'s blocks per call: the formats held as
    blocks (the native kernels' eight, which torch_dequant handles); the rest are float by then."""
    f = BY_NAME.get(format_name)
    return f is not None and f.native_kernel


@lru_cache(maxsize=256)
def group_dequant(weights: weight_formats.Weights) -> MappingProxyType:
    """{operator group: (share of its parameters in blocks, bytes a weight of those blocks)}; every
    group as stored (the tied head reads "embedding"'s blocks)."""
    total: dict[str, float] = {}
    blocks: dict[str, float] = {}
    block_bytes: dict[str, float] = {}
    for group, fmt, p in weights:
        total[group] = total.get(group, 0.0) + p
        if _dequantised_on_accelerator(fmt):
            blocks[group] = blocks.get(group, 0.0) + p
            block_bytes[group] = block_bytes.get(group, 0.0) + p * BY_NAME[fmt].bytes_per_weight
    return MappingProxyType({g: (blocks[g] / total[g], block_bytes[g] / blocks[g])
                             for g in blocks if total[g] > 0 and blocks[g] > 0})


def t_gpu_dequant_s(weights: weight_formats.Weights, group: str, params: float, matrices: float, w_bytes: float,
                    bandwidth_bytes_per_s: float, eff_memory: float) -> float:
    """D of ``params`` weights in ``matrices`` matrices of ``group`` (module docstring: blocks read,
    weights written, one launch a matrix in blocks, counted by their share of parameters); 0 for a
    group held in float."""
    held = group_dequant(weights).get(group) if weights else None
    if held is None:
        return 0.0
    share, block_bytes = held
    return (params * share * (block_bytes + float(w_bytes)) / (bandwidth_bytes_per_s * eff_memory)
            + matrices * share * FUSED_LAUNCHES_PER_MATRIX * GPU_KERNEL_LAUNCH_S)


def _mlp_matrices(m, width: int) -> int:
    return (3 if m.gated_mlp else 2) if width else 0


@lru_cache(maxsize=256)
def layer_matrices(m) -> MappingProxyType:
    """{group: weight matrices of one decoder layer (mean over layers)} of the groups torch_dequant may
    run on: the attention projections (q, k, v, o as ``workload.operators`` lists them; MLA's low-rank
    ones), a dense layer's MLP, an MoE layer's router and shared expert. Routed experts stay float."""
    moe = sum(m.moe_layers) / m.num_layers
    attention = (2 if m.q_lora_rank else 1) + 3 if m.kv_lora_rank else 4  # MLA: q (q_a, q_b), kv_a, kv_b, o
    return MappingProxyType({
        "attention": attention,
        "mlp": (1 - moe) * _mlp_matrices(m, m.intermediate_size),
        "router": moe if m.num_experts else 0.0,
        "shared_experts": moe * _mlp_matrices(m, m.shared_expert_intermediate_size),
    })


def t_gpu_dequant_layer_s(weights: weight_formats.Weights, m, w_bytes: float, bandwidth_bytes_per_s: float,
                          eff_memory: float) -> float:
    """D of one decoder layer (mean over layers): every group it holds in blocks (0 without blocks)."""
    if not weights:
        return 0.0
    params: dict[str, float] = {}
    for group, _, p in weights:
        params[group] = params.get(group, 0.0) + p / m.num_layers
    return sum(t_gpu_dequant_s(weights, g, params.get(g, 0.0), n, w_bytes, bandwidth_bytes_per_s, eff_memory)
               for g, n in layer_matrices(m).items())


def t_gpu_dequant_head_s(weights: weight_formats.Weights, m, w_bytes: float, bandwidth_bytes_per_s: float,
                         eff_memory: float) -> float:
    """D of the LM head, one matrix: its own blocks, or the embedding's a tied head reads."""
    if not weights:
        return 0.0
    params = m.vocab_size * (m.word_embed_proj_dim or m.hidden_size)
    return t_gpu_dequant_s(weights, weight_formats.head_group(weights), params, 1, w_bytes,
                           bandwidth_bytes_per_s, eff_memory)
