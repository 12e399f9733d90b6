"""Memory each placement needs on the GPU and in host memory.

Placement (see plan_types): the last M layers are GPU-resident with their KV cache for the
whole sequence (input + output). Host-resident layers are stored in the CPU compute dtype
when the CPU computes them, in the GPU dtype (pinned) when they are streamed. Streaming
needs two GPU buffers (double buffering) of one layer's weights and KV. The embedding table
stays in host memory (lookup on the host); the LM head lives with the last layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flexplan.estimator.terms import Shape
from flexplan.hardware.spec import Hardware
from flexplan.workload import costs

CPU_MEMORY_USABLE_FRACTION = 0.90  # leave 10% of host memory to the OS and the Python process


def activation_bytes(shape: Shape, tokens_per_seq: int, elem_bytes: int) -> float:
    """Peak transient activations of one layer step: hidden, residual, q/k/v/attention output and
    the MLP intermediates (gate, up, product), plus fp32 logits for the last position."""
    m = shape.model
    rows = shape.batch * tokens_per_seq
    per_row = 4 * m.hidden_size + m.q_dim + 2 * m.kv_dim + 3 * m.intermediate_size
    return float(rows * per_row * elem_bytes + costs.d_logits(m, shape.batch))


@dataclass(frozen=True)
class LayerBytes:
    w_gpu: float  # one layer's weights in the GPU dtype
    w_cpu: float  # ... as the CPU holds them (Shape.cpu_weight_bytes)
    kv_gpu: float  # one layer's KV for the whole sequence, GPU dtype
    kv_cpu: float
    head_gpu: float  # LM head + final norm on the GPU
    head_cpu: float
    embed_cpu: float  # embedding table(s) in host memory

    @classmethod
    def of(cls, shape: Shape) -> "LayerBytes":
        m, total = shape.model, shape.input_len + shape.output_len
        return cls(
            w_gpu=costs.d_weights(m, shape.w_bytes), w_cpu=costs.d_weights(m, shape.cpu_weight_bytes),
            kv_gpu=costs.kv_cache_bytes_per_layer(m, shape.batch, total, shape.w_bytes),
            kv_cpu=costs.kv_cache_bytes_per_layer(m, shape.batch, total, shape.cpu_bytes),
            head_gpu=costs.d_lm_head(m, shape.w_bytes), head_cpu=costs.d_lm_head(m, shape.cpu_weight_bytes),
            embed_cpu=float(m.embedding_params * shape.cpu_bytes),
        )


def gpu_bytes(shape: Shape, hw: Hardware, host_mode: str, m_layers, phase: str):
    """GPU memory of a phase with ``m_layers`` (int or array) resident layers. ``host_mode`` is
    'cpu' (host layers computed on the CPU), 'stream' (streamed) or 'none' (M = N)."""
    lb = LayerBytes.of(shape)
    n = shape.model.num_layers
    m_layers = np.asarray(m_layers)
    if host_mode == "cpu" and np.all(m_layers == 0):
        return np.zeros_like(m_layers, dtype=float)
    reserve = hw.gpu.runtime_reserved_bytes if hw.gpu is not None else 0
    tokens = shape.input_len if phase == "prefill" else 1
    resident = m_layers * (lb.w_gpu + lb.kv_gpu)
    buffers = np.where((host_mode == "stream") & (m_layers < n), 2 * (lb.w_gpu + lb.kv_gpu), 0.0)
    used = resident + buffers + lb.head_gpu + activation_bytes(shape, tokens, shape.w_bytes) + reserve
    return np.where((host_mode == "cpu") & (m_layers == 0), 0.0, used)


def host_layer_bytes(shape: Shape, host_modes: tuple[str, ...], n_host: int) -> float:
    """Host memory of ``n_host`` host-resident layers (weights + KV) that the given phases use
    as 'cpu' and/or 'stream': one copy per distinct dtype needed (one copy when equal)."""
    lb = LayerBytes.of(shape)
    copies = {shape.cpu_dtype if mode == "cpu" else shape.dtype for mode in host_modes}
    w = sum(lb.w_cpu if d == shape.cpu_dtype else lb.w_gpu for d in copies)
    kv = max(lb.kv_cpu if mode == "cpu" else lb.kv_gpu for mode in host_modes)
    return n_host * (w + kv)


def cpu_bytes(shape: Shape, host_mode: str, m_layers, phase: str):
    """Host memory of one phase with ``m_layers`` (int or array) GPU-resident layers."""
    lb = LayerBytes.of(shape)
    n = shape.model.num_layers
    m_layers = np.asarray(m_layers)
    per_layer = (lb.w_cpu + lb.kv_cpu) if host_mode == "cpu" else (lb.w_gpu + lb.kv_gpu)
    tokens = shape.input_len if phase == "prefill" else 1
    acts = activation_bytes(shape, tokens, shape.cpu_bytes) if host_mode == "cpu" else 0.0
    head = lb.head_cpu if (host_mode == "cpu" and np.all(m_layers == 0)) else 0.0
    return (n - m_layers) * per_layer + lb.embed_cpu + head + acts


def pair_cpu_bytes(shape: Shape, prefill_mode: str, m_prefill: int, decode_mode: str, m_decode: int) -> float:
    """Host memory when prefill and decode placements both exist over the run (the executor keeps
    a layer's copies for every phase that needs them on the host)."""
    n = shape.model.num_layers
    lb = LayerBytes.of(shape)
    host_p, host_d = n - m_prefill, n - m_decode
    both = min(host_p, host_d)
    total = lb.embed_cpu
    if both:
        total += host_layer_bytes(shape, (prefill_mode, decode_mode), both)
    if host_p > both:
        total += host_layer_bytes(shape, (prefill_mode,), host_p - both)
    if host_d > both:
        total += host_layer_bytes(shape, (decode_mode,), host_d - both)
    if "cpu" in (prefill_mode, decode_mode):
        total += activation_bytes(shape, shape.input_len, shape.cpu_bytes)
    if (prefill_mode == "cpu" and m_prefill == 0) or (decode_mode == "cpu" and m_decode == 0):
        total += lb.head_cpu
    return float(total)
