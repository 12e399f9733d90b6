"""Per-decoder-layer computation and data volumes: FlexInfer Table 2.

Every function returns the amount for ONE decoder layer and ONE forward step, in FLOPs or
bytes. Decode functions accept ``context_len`` as a number or a numpy array (one entry per
decode step), so the estimator can follow the KV cache as it grows.

Conventions (stated once, used everywhere):
- Layers may differ (sliding-window and full-attention layers, dense and MoE layers).
  Every per-layer figure is the MEAN over the model's layers, so that the estimator's
  "per-layer value x number of layers" is exact for the whole stack; for a placement of
  some layers only it is the average layer.
- A GEMM of an (n x k) input by a (k x m) weight is 2*n*k*m FLOPs. Biases, norms,
  activations and softmax are ignored in C (a fraction of a percent at these sizes).
- Attention FLOPs are QK^T plus AV: 2 * heads * (head_dim + v_head_dim) per (query, key)
  pair (4 * heads * head_dim when K and V heads are equal). Prefill is causal: query i sees
  i + 1 keys, s(s+1)/2 pairs per sequence; in a sliding-window layer it sees min(i + 1, W);
  in a chunked layer (Llama 4) the (i mod C) + 1 keys of its own chunk.
- MoE layers: FLOPs count what one token runs (router, shared expert, k routed experts).
  Weight bytes READ in decode at batch b count the expected number of distinct experts the
  b tokens pick, E * (1 - (1 - k/E)^b) under uniform routing; prefill reads all experts;
  ``d_weights`` (memory, streaming) counts all of them.
- Data (D) is what one layer moves through the memory of the device that computes it:
  weights + activations read and written by its GEMMs. The KV cache is separate
  (D_KVCache, as in Table 2): the bytes attention READS, which stop growing at the window
  in a sliding-window layer. The KV cache MEMORY (``kv_cache_bytes_per_layer``) stays
  full-length in every layer: the executor keeps the whole context for every layer.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import numpy as np

from flexplan.workload.model import ModelSpec

ArrayLike = float | np.ndarray


def attention_pairs_prefill(input_len: int, window: int | None = None) -> float:
    """Causal (query, key) pairs of one sequence: s(s+1)/2, or with a window W,
    sum over i of min(i + 1, W) = W(W+1)/2 + (s - W) W once s > W."""
    s = input_len
    if window is None or s <= window:
        return s * (s + 1) / 2
    return window * (window + 1) / 2 + (s - window) * window


def attention_pairs_prefill_chunked(input_len: int, chunk: int) -> float:
    """(query, key) pairs of one sequence when queries see only their own chunk of C tokens:
    C(C+1)/2 per full chunk plus r(r+1)/2 for the last r tokens."""
    full, rest = divmod(input_len, chunk)
    return full * chunk * (chunk + 1) / 2 + rest * (rest + 1) / 2


@lru_cache(maxsize=256)
def _span_shares(m: ModelSpec) -> tuple[tuple[int | None, int | None, float], ...]:
    """(window, chunk, share of the layers) for each distinct attention span (kept per model)."""
    counts = Counter((m.layer_window(i), m.layer_chunk(i)) for i in range(m.num_layers))
    return tuple((w, c, n / m.num_layers) for (w, c), n in counts.items())


def mean_prefill_pairs(m: ModelSpec, input_len: int) -> float:
    """Causal (query, key) pairs of one sequence, averaged over the layers."""
    return sum(share * (attention_pairs_prefill_chunked(input_len, c) if c else attention_pairs_prefill(input_len, w))
               for w, c, share in _span_shares(m))


def mean_keys_read(m: ModelSpec, context_len: ArrayLike) -> ArrayLike:
    """Keys one query attends over at ``context_len``, averaged over the layers (windowed
    layers stop at their window; a chunked layer reads its chunk so far, (ctx - 1) mod C + 1)."""
    ctx = np.asarray(context_len, dtype=float)

    def keys(w, c):
        if c:
            return np.mod(ctx - 1, c) + 1
        return ctx if w is None else np.minimum(ctx, w)
    return sum(share * keys(w, c) for w, c, share in _span_shares(m))


def attention_flops_per_pair(m: ModelSpec) -> int:
    """QK^T (2 * heads * head_dim) plus AV (2 * heads * v_head_dim) per (query, key) pair."""
    return 2 * m.num_heads * (m.head_dim + m.v_head_dim)


def expected_experts_read(m: ModelSpec, batch: int) -> float:
    """Distinct routed experts ``batch`` tokens pick in one MoE layer under uniform routing:
    E * (1 - (1 - k/E)^b)."""
    if not m.num_experts:
        return 0.0
    e, k = m.num_experts, m.experts_per_token
    return e * (1.0 - (1.0 - k / e) ** batch)


def _mlp_activation_elems(m: ModelSpec, width: int) -> int:
    h = m.hidden_size
    return 2 * (h + width) + (width + h) + 2 * width if m.gated_mlp else (h + width) + (width + h)


def activation_elems_per_token(m: ModelSpec) -> float:
    """Elements read + written by the GEMMs of one layer, per token (inputs and outputs of
    q, k, v, o and the MLP projections, plus the attention read of Q and write of its output);
    an MoE layer counts its router, its shared expert and the k experts the token runs.
    Mean over layers."""
    h, q, k, v = m.hidden_size, m.q_dim, m.kv_dim, m.num_kv_heads * m.v_head_dim
    o_in = m.num_heads * m.v_head_dim
    attn = (h + q) + (h + k) + (h + v) + (o_in + h) + q + o_in
    dense = _mlp_activation_elems(m, m.intermediate_size)
    moe = (h + m.num_experts) + m.experts_per_token * _mlp_activation_elems(m, m.expert_intermediate_size)
    if m.shared_expert_intermediate_size:
        moe += _mlp_activation_elems(m, m.shared_expert_intermediate_size)
    n_moe = sum(m.moe_layers)
    mlp = (n_moe * moe + (m.num_layers - n_moe) * dense) / m.num_layers
    return attn + (int(mlp) if mlp == int(mlp) else mlp)


# ---- C: computation --------------------------------------------------------------------
def c_prefill(m: ModelSpec, batch: int, input_len: int) -> float:
    """C_Prefill: FLOPs of one layer over the prompt (GEMMs on b*s tokens + causal attention):
    ``c_prefill_linear + c_prefill_attention``."""
    return c_prefill_linear(m, batch, input_len) + c_prefill_attention(m, batch, input_len)


def c_prefill_linear(m: ModelSpec, batch: int, input_len: int) -> float:
    """The GEMM part of C_Prefill: 2 b s x (linear weights of one layer)."""
    return 2.0 * batch * input_len * m.linear_weight_params_per_layer


def c_prefill_attention(m: ModelSpec, batch: int, input_len: int) -> float:
    """The attention core of C_Prefill: QK^T and AV over the causal (query, key) pairs of each
    prompt (windows and chunks via :func:`mean_prefill_pairs`); quadratic in ``input_len``."""
    return batch * attention_flops_per_pair(m) * mean_prefill_pairs(m, input_len)


def c_decode(m: ModelSpec, batch: int, context_len: ArrayLike) -> ArrayLike:
    """C_Decode: FLOPs of one layer for one new token per sequence attending over ``context_len`` keys."""
    gemm = 2.0 * batch * m.linear_weight_params_per_layer
    attn = float(batch * attention_flops_per_pair(m)) * mean_keys_read(m, context_len)
    return gemm + attn


# ---- D: data ---------------------------------------------------------------------------
def d_weights(m: ModelSpec, weight_bytes: int) -> float:
    """Bytes of one layer's parameters (all experts) stored at ``weight_bytes`` per element."""
    return float(m.params_per_layer * weight_bytes)


def d_weights_read_decode(m: ModelSpec, batch: int, weight_bytes: int) -> float:
    """Weight bytes one decode step at ``batch`` reads in one layer: all of a dense layer; in
    an MoE layer all but the routed experts no token picks (:func:`expected_experts_read`)."""
    unread = (m.num_experts - expected_experts_read(m, batch)) * m.expert_params * sum(m.moe_layers) / m.num_layers
    return float((m.params_per_layer - unread) * weight_bytes)


def d_prefill(m: ModelSpec, batch: int, input_len: int, weight_bytes: int, act_bytes: int) -> float:
    """D_Prefill: weights (all experts) + activations of one layer over the prompt."""
    return d_weights(m, weight_bytes) + batch * input_len * activation_elems_per_token(m) * act_bytes


def d_decode(m: ModelSpec, batch: int, weight_bytes: int, act_bytes: int) -> float:
    """D_Decode: weights read (the experts the batch picks) + activations of one layer for
    one token per sequence."""
    return d_weights_read_decode(m, batch, weight_bytes) + batch * activation_elems_per_token(m) * act_bytes


def d_kv_cache(m: ModelSpec, batch: int, context_len: ArrayLike, kv_bytes: int) -> ArrayLike:
    """D_KVCache: K and V one layer's attention reads over ``context_len`` tokens per sequence
    (a sliding-window layer reads at most its window)."""
    return float(batch * m.kv_elems_per_token * kv_bytes) * mean_keys_read(m, context_len)


def d_kv_write(m: ModelSpec, batch: int, tokens_per_seq: int, kv_bytes: int) -> float:
    """K and V one layer writes for ``tokens_per_seq`` new tokens per sequence (every layer
    stores every token, windowed or not)."""
    return float(batch * tokens_per_seq * m.kv_elems_per_token * kv_bytes)


def d_output(m: ModelSpec, batch: int, tokens_per_seq: int, act_bytes: int) -> float:
    """D_Output: one layer's output hidden states (what crosses the link at a CPU/GPU split)."""
    return float(batch * tokens_per_seq * m.hidden_size * act_bytes)


def d_cpu_to_gpu(m: ModelSpec, batch: int, context_len: ArrayLike, weight_bytes: int, kv_bytes: int,
                 kv_on_host: bool) -> ArrayLike:
    """D_CPU->GPU: bytes one streamed layer sends to the GPU per step: its weights (all
    experts), plus the KV its attention reads when the KV lives in host memory (FlexGen's
    default placement)."""
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
    """Memory one layer's KV cache occupies for ``total_len`` tokens per sequence: full
    length in every layer, windowed or not (the executor keeps the whole context)."""
    return d_kv_write(m, batch, total_len, kv_bytes)


# ---- decode attention split from the layer (attention beside a host KV cache) ------------
def c_decode_linear(m: ModelSpec, batch: int) -> float:
    """The GEMM part of C_Decode: 2 b x (linear weights of one layer)."""
    return 2.0 * batch * m.linear_weight_params_per_layer


def c_decode_attention(m: ModelSpec, batch: int, context_len: ArrayLike) -> ArrayLike:
    """The attention part of C_Decode: QK^T and AV of one new token per sequence over the keys it
    reads (windows and chunks via :func:`mean_keys_read`); ``c_decode = c_decode_linear + this``."""
    return float(batch * attention_flops_per_pair(m)) * mean_keys_read(m, context_len)


def d_attention_io(m: ModelSpec, batch: int, act_bytes: int) -> tuple[float, float]:
    """What one layer's decode attention takes in and gives back per step when it computes apart
    from the layer's projections (NEO section 3, FlexGen's ``cpu_cache_compute``): (q of the new
    token plus its K and V as the cache stores them (GQA: KV heads only; MLA: the latent),
    the attention output before the output projection), in bytes."""
    qkv = batch * (m.q_dim + m.kv_elems_per_token) * act_bytes
    out = batch * m.num_heads * m.v_head_dim * act_bytes
    return float(qkv), float(out)
