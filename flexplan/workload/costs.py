"""Per-decoder-layer computation and data volumes: FlexInfer Table 2.

Every function returns the amount for ONE decoder layer and ONE forward step, in FLOPs or
bytes. Decode functions accept ``context_len`` as a number or a numpy array (one entry per
decode step), so the estimator can follow the KV cache as it grows.

Conventions (stated once, used everywhere):
- A GEMM of an (n x k) input by a (k x m) weight is 2*n*k*m FLOPs. Biases, norms,
  activations and softmax are ignored in C (a fraction of a percent at these sizes).
- Attention FLOPs are QK^T plus AV: 4 * heads * head_dim per (query, key) pair. Prefill is
  causal: query i sees i + 1 keys, so s(s+1)/2 pairs per sequence.
- Data (D) is what one layer moves through the memory of the device that computes it:
  weights + activations read and written by its GEMMs. The KV cache is separate
  (D_KVCache), as in Table 2.
"""

from __future__ import annotations

import numpy as np

from flexplan.workload.model import ModelSpec

ArrayLike = float | np.ndarray


def attention_pairs_prefill(input_len: int) -> float:
    """Causal (query, key) pairs of one sequence: s(s+1)/2."""
    return input_len * (input_len + 1) / 2


def activation_elems_per_token(m: ModelSpec) -> int:
    """Elements read + written by the GEMMs of one layer, per token (inputs and outputs of
    q, k, v, o and the MLP projections, plus the attention read of Q and write of its output)."""
    h, i, q, kv = m.hidden_size, m.intermediate_size, m.q_dim, m.kv_dim
    attn = (h + q) + 2 * (h + kv) + (q + h) + 2 * q
    mlp = 2 * (h + i) + (i + h) + 2 * i if m.gated_mlp else (h + i) + (i + h)
    return attn + mlp


# ---- C: computation --------------------------------------------------------------------
def c_prefill(m: ModelSpec, batch: int, input_len: int) -> float:
    """C_Prefill: FLOPs of one layer over the prompt (GEMMs on b*s tokens + causal attention)."""
    gemm = 2.0 * batch * input_len * m.linear_weight_params_per_layer
    attn = 4.0 * batch * m.num_heads * m.head_dim * attention_pairs_prefill(input_len)
    return gemm + attn


def c_decode(m: ModelSpec, batch: int, context_len: ArrayLike) -> ArrayLike:
    """C_Decode: FLOPs of one layer for one new token per sequence attending over ``context_len`` keys."""
    gemm = 2.0 * batch * m.linear_weight_params_per_layer
    attn = 4.0 * batch * m.num_heads * m.head_dim * np.asarray(context_len, dtype=float)
    return gemm + attn


# ---- D: data ---------------------------------------------------------------------------
def d_weights(m: ModelSpec, weight_bytes: int) -> float:
    """Bytes of one layer's parameters stored at ``weight_bytes`` per element."""
    return float(m.params_per_layer * weight_bytes)


def d_prefill(m: ModelSpec, batch: int, input_len: int, weight_bytes: int, act_bytes: int) -> float:
    """D_Prefill: weights + activations of one layer over the prompt."""
    return d_weights(m, weight_bytes) + batch * input_len * activation_elems_per_token(m) * act_bytes


def d_decode(m: ModelSpec, batch: int, weight_bytes: int, act_bytes: int) -> float:
    """D_Decode: weights + activations of one layer for one token per sequence."""
    return d_weights(m, weight_bytes) + batch * activation_elems_per_token(m) * act_bytes


def d_kv_cache(m: ModelSpec, batch: int, context_len: ArrayLike, kv_bytes: int) -> ArrayLike:
    """D_KVCache: K and V of one layer for ``context_len`` tokens per sequence."""
    return 2.0 * batch * np.asarray(context_len, dtype=float) * m.kv_dim * kv_bytes


def d_output(m: ModelSpec, batch: int, tokens_per_seq: int, act_bytes: int) -> float:
    """D_Output: one layer's output hidden states (what crosses the link at a CPU/GPU split)."""
    return float(batch * tokens_per_seq * m.hidden_size * act_bytes)


def d_cpu_to_gpu(m: ModelSpec, batch: int, context_len: ArrayLike, weight_bytes: int, kv_bytes: int,
                 kv_on_host: bool) -> ArrayLike:
    """D_CPU->GPU: bytes one streamed layer sends to the GPU per step: its weights, plus its
    KV cache when the KV lives in host memory (FlexGen's default placement)."""
    kv = d_kv_cache(m, batch, context_len, kv_bytes) if kv_on_host else 0.0
    return d_weights(m, weight_bytes) + kv


# ---- outside the layers: embedding lookup and LM head ---------------------------------
def c_lm_head(m: ModelSpec, batch: int) -> float:
    """FLOPs of the LM head for the last position of each sequence (generate() keeps 1 logit row)."""
    return 2.0 * batch * (m.word_embed_proj_dim or m.hidden_size) * m.vocab_size


def d_lm_head(m: ModelSpec, weight_bytes: int) -> float:
    """Bytes of the LM head weights (the embedding matrix when tied) plus the final norm."""
    return float((m.vocab_size * (m.word_embed_proj_dim or m.hidden_size) + m.final_norm_params) * weight_bytes)


def d_logits(m: ModelSpec, batch: int) -> float:
    """fp32 logits of the last position, sent back to the host for sampling."""
    return float(batch * m.vocab_size * 4)


def kv_cache_bytes_per_layer(m: ModelSpec, batch: int, total_len: int, kv_bytes: int) -> float:
    """Memory one layer's KV cache occupies for ``total_len`` tokens per sequence."""
    return float(d_kv_cache(m, batch, total_len, kv_bytes))
