"""The split-point search of Park & Egger (section 4.2, Equations 5-7, 13 and 14), vectorised.

A streamed decoder layer is a sequence of n operators O[0..n-1] (e.g. QKV projection, attention
over the KV cache, output projection, MLP up/gate, MLP down). Two split points 0 <= i <= j <= n
divide it: the CPU computes O[0..i-1] and O[j..n-1] from weights that stay in host memory, the
accelerator computes O[i..j-1] after their weights crossed the link. With C, G and H the
per-operator CPU time, accelerator time and host-to-device copy time (H includes the KV cache an
operator reads on the accelerator):

    Eq. 6   CPU(i, j) = sum C[0..i-1] + sum C[j..n-1]
    Eq. 7   H2D(i, j) = sum H[i..j-1]
    Eq. 5   L(i, j)   = max(CPU(i, j), H2D(i, j))

The paper's Eq. 5 leaves out the accelerator's own time and the hidden-state copies at the
split points, both small on its OPT-30B/66B testbed. Here they are kept on the side they delay,
in the steady state of a stream of identical layers (the next layer's weights copy while this
one computes, as FlexInfer Eq. 2 overlaps them):

    L(i, j) = max(CPU(i, j) + G(i, j) + X(i, j),  H2D(i, j))

with G(i, j) = sum G[i..j-1] and X(i, j) one hidden-state copy each way when the layer is split
(0 < j - i < n: in a chain of such layers the device changes exactly twice per layer, whatever i
and j are), none otherwise. j = i is the whole layer on the CPU, (i, j) = (0, n) the whole layer
streamed (FlexGen); Eq. 13 counts the n(n - 1)/2 candidates strictly between them that the paper
searches, :func:`candidate_count`. The search evaluates all (n + 1)(n + 2)/2 pairs at once with
prefix sums, over any leading dimensions (decode steps, candidates).

Multi-batch (Eq. 14): with ``micro_batches`` = m > 1 the weights cross once but every micro-batch
brings its own KV cache and runs its own accelerator part, one after the other (one KV slot on the
accelerator), so the copy side becomes

    Eq. 14  H2D(i, j) = sum H_w[i..j-1] + m sum H_kv[i..j-1] + (m - 1) G(i, j)

and the CPU computes its operators for every micro-batch (C, G are per micro-batch times):
the chain becomes m (CPU(i, j) + X(i, j)) + G(i, j).
"""

from __future__ import annotations

import numpy as np


def candidate_count(n_ops: int) -> int:
    """Eq. 13: single (n - 1) plus double (n - 1)(n - 2)/2 split points, n(n - 1)/2 in all."""
    return n_ops * (n_ops - 1) // 2


def _pair_sums(x: np.ndarray) -> np.ndarray:
    """sum x[..., i:j] for every 0 <= i, j <= n, as an array [..., i, j] (0 where j <= i)."""
    p = np.concatenate([np.zeros(x.shape[:-1] + (1,)), np.cumsum(x, axis=-1)], axis=-1)
    s = p[..., None, :] - p[..., :, None]
    return np.maximum(s, 0.0) * (np.arange(p.shape[-1])[None, :] >= np.arange(p.shape[-1])[:, None])


def layer_times_s(cpu_s, acc_s, h2d_weights_s, h2d_kv_s=None, boundary_s: float = 0.0,
                  micro_batches: int = 1) -> np.ndarray:
    """L(i, j) of every split pair, an array [..., i, j] (inf where i > j), from per-operator times
    with the operators on the last axis: ``cpu_s`` C (already slowed by a concurrent copy where it
    overlaps one), ``acc_s`` G, ``h2d_weights_s`` and ``h2d_kv_s`` H (weights, KV), ``boundary_s``
    X (one hidden-state copy each way)."""
    c = np.asarray(cpu_s, dtype=float)
    g = np.asarray(acc_s, dtype=float)
    hw = np.asarray(h2d_weights_s, dtype=float)
    hkv = np.zeros_like(hw) if h2d_kv_s is None else np.asarray(h2d_kv_s, dtype=float)
    c, g, hw, hkv = np.broadcast_arrays(c, g, hw, hkv)
    n = c.shape[-1]
    m = int(micro_batches)
    if m < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    on_acc_c = _pair_sums(c)  # the CPU's share is the whole layer less the accelerator's run
    cpu = c.sum(axis=-1)[..., None, None] - on_acc_c  # Eq. 6
    acc = _pair_sums(g)
    h2d = _pair_sums(hw) + m * _pair_sums(hkv) + (m - 1) * acc  # Eq. 7; Eq. 14 when m > 1
    i, j = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    split = (j - i > 0) & (j - i < n)
    # the CPU runs its operators for every micro-batch, each split micro-batch crosses twice, and
    # the last one's accelerator part ends the layer (the earlier ones' are on the copy side)
    chain = m * (cpu + np.where(split, float(boundary_s), 0.0)) + acc
    out = np.maximum(chain, h2d)  # Eq. 5 with the accelerator's time and the split points' copies
    return np.where(j >= i, out, np.inf)


def copy_times_s(h2d_weights_s, h2d_kv_s) -> np.ndarray:
    """H2D(i, j) of every split pair (Eq. 7), an array [..., i, j]."""
    return _pair_sums(np.asarray(h2d_weights_s, dtype=float)) + _pair_sums(np.asarray(h2d_kv_s, dtype=float))


def best_split(times_s: np.ndarray, max_split_points: int = 2) -> tuple[int, int, float]:
    """(i, j, L) minimising the mean of ``times_s`` [..., i, j] over its leading dimensions (one
    split for every decode step); ``max_split_points`` 1 keeps the CPU's run at one end (i = 0 or
    j = n), as the paper's single split point does."""
    t = np.asarray(times_s, dtype=float)
    mean = t.reshape(-1, *t.shape[-2:]).mean(axis=0) if t.ndim > 2 else t
    if max_split_points == 1:
        n = mean.shape[-1] - 1
        i, j = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
        mean = np.where((i == 0) | (j == n), mean, np.inf)
    flat = int(np.argmin(mean))
    i, j = divmod(flat, mean.shape[-1])
    return i, j, float(mean[i, j])
