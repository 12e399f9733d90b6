"""Split points inside a streamed layer: Park & Egger, sections 3.1-4.2 (Equations 5-8, 13, 14).

A streamed layer's weights and KV cache live in pinned host memory. Its operators (array O,
``workload.operators``: q/k/v projections, the attention core, the output projection, the MLP's
projections; an MoE block as one operator) are cut by two split points 1 <= i < j <= n: the CPU
computes O[0, i) and O[j, n) from host memory, the accelerator computes O[i, j) from weights copied
over the link, and j = n is the single split point. The hidden state of the layer and the glue
between operators (norms, residuals, rotary, activation) stay on the host; each accelerator
operator's input crosses to it (once for operators that read the same tensor, as k_proj and v_proj
read q_proj's) and its output comes back. With the attention core on the CPU the KV cache is read in
host memory; on the accelerator the KV it reads crosses with the weights (Park & Egger's H of
Scores and WV).

Per operator (``operator_terms``): C (CPU), G (accelerator), H (link), D (the accelerator dequantising
the operator's blocks; 0 for float weights), IN and OUT (activations). Per layer and step, with P the
CPU slowdown while a copy runs (``cpu_under_copy``, Park & Egger 4.1):

    Eq. 6   CPU(i, j) = sum C[0, i) + sum C[j, n)                                   :func:`eq6_cpu_s`
    Eq. 7   H2D(i, j) = sum H[i, j)                                                 :func:`eq7_h2d_s`
    Eq. 14  H2D(i, j) = sum H[i, j) + (b - 1) (sum G[i, j) + KV)   with b batches   :func:`eq14_h2d_s`
    Eq. 8'  DC(i, j)  = sum D[i, j)                                                 :func:`eq8_dc_s`
    Eq. 5   L(i, j)   = max(P (CPU(i, j) + glue),  H2D(i, j)) + IN + sum G[i, j) + DC(i, j) + OUT + overhead
                                                                                    :func:`eq5_layer_s`

What overlaps: the copy of the next layer's accelerator weights runs beside the CPU's part (this
layer's operators after the accelerator's, O[j, n), the glue, and the next layer's first operators,
O[0, i)), so the max takes the larger of the two; the accelerator's segment (its operators' inputs,
their compute, their outputs back) runs in the open. The executor issues the next layer's copy only
once this layer's accelerator operators are done (``split_layer.SplitLayers.segment_done``): a CUDA
copy engine runs host-to-device copies in the order they were issued, so an input sent while the next
layer's weights are in flight waits for all of them. Issued at the start of the layer, as Park &
Egger's Eq. 5 assumes, the next layer's copy would hold this layer's inputs back behind it: the
in-order copy engine then gives max(P CPU[0, i), H2D) + segment + P (CPU[j, n) + glue), not the
max(P CPU + G + IN + OUT, H2D + IN) that Eq. 5 prices, so the executor waits for the segment and the
estimate follows the order it runs. Park & Egger's Eq. 5 drops G, IN and OUT, their
accelerator being far faster than their link; this keeps them. The CPU runs under the copy for all of
its part, hence P on all of it. Eq. 14 is the multi-batch variant; the executor runs the batch whole,
so the policy plans with b = 1, where Eq. 14 is Eq. 7. The first layer's copy is not hidden (the
pipeline fill, as in Eq. 2). Both orders timed on a GPU: docs/results.md, "On a GPU".

Eq. 13: the n(n - 1)/2 candidates (i, j) are searched exhaustively, for every step and every
candidate M at once with prefix sums and broadcasting (:func:`search`). The pair is chosen per phase
(one for the whole decode: the mean over steps is taken after the max, as the other policies do).
Compression (Park & Egger Eq. 8-9): weights held as blocks (a GGUF file's, or quantised at load) cross
the link as blocks, so H follows their bytes, and the accelerator dequantises each operator's blocks
(D) with torch ops right before its GEMM, in the compute stream. Park & Egger's Eq. 8, DC = sum D[i, j)
+ H[i], starts the dequantisation as the first weight lands and Eq. 9 runs it beside the copy, L =
max(CPU, H2D, DC). Here this layer's weights arrived whole during the previous layer (the copy of the
next layer's is issued after the segment, above), so nothing waits for H[i] and the dequantisation
does not overlap its own layer's copy: sum D[i, j) is part of the segment, after the max, not a third
argument of it (Eq. 8 without H[i], Eq. 9 not used). NVMe transfers (Eq. 10-12) are not applicable:
flexplan streams weights from host memory only.

The last M layers may stay resident (M searched, as ``gpu-offload-partial``'s; M = 0 streams every
layer, as ``gpu-offload``). The memory
model counts a split layer as a streamed layer whose KV stays in host memory (both weight double
buffers sized for the whole layer, an upper bound for any split), plus one layer's KV in transit on
the accelerator (the attention core may compute there).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from flexplan.estimator.policies.base import PhaseTime, Policy, gpu_ends, mean_over_steps
from flexplan.estimator.terms import PhaseCosts
from flexplan.placement import SPLIT_POINTS
from flexplan.plan_types import SplitPoints
from flexplan.workload.operators import layer_operators, why_not_split


@lru_cache(maxsize=64)
def eq13_candidates(n: int) -> tuple[np.ndarray, np.ndarray]:
    """All split-point pairs (i, j), 1 <= i < j <= n: n(n - 1)/2 of them (Eq. 13); read-only arrays,
    kept per n (the planner asks for every phase and CPU dtype)."""
    i, j = np.triu_indices(n + 1, k=1)
    keep = i >= 1
    i, j = i[keep], j[keep]
    i.flags.writeable = j.flags.writeable = False
    return i, j


def _prefix(x: np.ndarray) -> np.ndarray:
    """[..., n] -> [..., n + 1] with P[..., k] = sum x[..., :k]."""
    x = np.asarray(x, dtype=float)
    return np.concatenate([np.zeros(x.shape[:-1] + (1,)), np.cumsum(x, axis=-1)], axis=-1)


def eq6_cpu_s(C: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Eq. 6: sum C[0, i) + sum C[j, n), for each pair ([steps, pairs])."""
    P = _prefix(C)
    return P[..., i] + (P[..., -1:] - P[..., j])


def eq7_h2d_s(H: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Eq. 7: sum H[i, j): the accelerator operators' weights (and KV) over the link."""
    P = _prefix(H)
    return P[..., j] - P[..., i]


def eq14_h2d_s(H: np.ndarray, G: np.ndarray, kv_s, i: np.ndarray, j: np.ndarray, batches: int = 1) -> np.ndarray:
    """Eq. 14: Eq. 7 plus, with ``batches`` batches, (batches - 1) x (sum G[i, j) + KV): the other
    batches' accelerator work and KV transfers occupy the pipeline stage too."""
    extra = (batches - 1) * (eq7_h2d_s(G, i, j) + np.asarray(kv_s, dtype=float)[..., None]) if batches > 1 else 0.0
    return eq7_h2d_s(H, i, j) + extra


def eq8_dc_s(D: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Eq. 8 as the executor orders it: sum D[i, j), the accelerator operators' blocks dequantised in
    the compute stream (no H[i]: the layer's weights arrived whole during the previous layer)."""
    return eq7_h2d_s(D, i, j)


def boundary_s(oc, i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(IN, OUT) of the accelerator operators O[i, j): each one's input to the accelerator (an input
    shared with the operator before it crosses once, unless that one is on the CPU), its output back."""
    own = oc.in_h2d_s * ~oc.shares_input
    in_s = eq7_h2d_s(own, i, j) + (oc.in_h2d_s * oc.shares_input)[..., i]
    return in_s, eq7_h2d_s(oc.out_d2h_s, i, j)


def eq5_layer_s(oc, cpu_under_copy: float, i: np.ndarray, j: np.ndarray):
    """Eq. 5 with the accelerator and the boundaries kept: (L, the CPU's part, the next layer's copy)
    per step and pair."""
    in_s, out_s = boundary_s(oc, i, j)
    cpu = cpu_under_copy * (eq6_cpu_s(oc.cpu_s, i, j) + oc.cpu_glue_s)
    segment = in_s + eq7_h2d_s(oc.gpu_s, i, j) + eq8_dc_s(oc.dequant_s, i, j) + out_s + oc.gpu_overhead_s
    link = eq14_h2d_s(oc.h2d_s, oc.gpu_s, oc.kv_bytes, i, j)
    return np.maximum(cpu, link) + segment, cpu, link


def _eq5_all_pairs(oc, cpu_under_copy: float, i: np.ndarray, j: np.ndarray):
    """:func:`eq5_layer_s` for many pairs at once: one prefix sum over the stacked C, G + D, H, IN, OUT
    and one gather (the planner calls this for every phase and CPU dtype)."""
    shared = oc.in_h2d_s * oc.shares_input
    stack = np.stack([oc.cpu_s, oc.gpu_s + oc.dequant_s, oc.h2d_s, oc.in_h2d_s - shared, oc.out_d2h_s])
    P = _prefix(stack)
    inside = P[..., j] - P[..., i]  # [5, steps, pairs]: sums over O[i, j) (G and Eq. 8's D together)
    in_s = inside[3] + shared[:, i]
    cpu = cpu_under_copy * (P[0, :, -1:] - inside[0] + oc.cpu_glue_s)  # Eq. 6, and the glue
    link = inside[2]  # Eq. 7 (Eq. 14 with one batch): the next layer's accelerator weights
    return np.maximum(cpu, link) + in_s + inside[1] + inside[4] + oc.gpu_overhead_s, cpu, link


def search(oc, cpu_under_copy: float, streamed) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The exhaustive search of section 4.2 for each number of streamed layers in ``streamed``:
    (index of the best pair, time of the streamed layers, the pairs (i, j)). Vectorised: pairs x steps
    in one broadcast, then streamed layers x pairs."""
    i, j = eq13_candidates(oc.n)
    layer, cpu, link = _eq5_all_pairs(oc, cpu_under_copy, i, j)
    per_layer, fill = layer.mean(axis=0), np.minimum(cpu, link).mean(axis=0)
    s = np.asarray(streamed, dtype=float)[..., None]
    total = s * per_layer + np.where(s > 0, fill, 0.0)
    best = np.argmin(total, axis=-1)
    return best, np.take_along_axis(total, best[..., None], axis=-1)[..., 0], (i, j)


def timeline(oc, cpu_under_copy: float, i: int, j: int) -> tuple[tuple[str, str, float, float], ...]:
    """One streamed layer at split (i, j), mean step: (operator, lane, start_s, end_s), lanes ``cpu``,
    ``accelerator``, ``h2d`` (activations in; ``next layer weights`` on the same lane once the
    accelerator's operators are done, beside the CPU's rest and the next layer's first operators)
    and ``d2h``."""
    C, G, D = oc.cpu_s.mean(axis=0) * cpu_under_copy, oc.gpu_s.mean(axis=0), oc.dequant_s.mean(axis=0)
    IN, OUT = oc.in_h2d_s.mean(axis=0), oc.out_d2h_s.mean(axis=0)
    rows, t = [], 0.0
    for k, name in enumerate(oc.names):
        if i <= k < j:
            if not (oc.shares_input[k] and k > i):  # an input shared with the operator before crossed with it
                rows.append((name + " input", "h2d", t, t + IN[k]))
                t += IN[k]
            if D[k]:  # its blocks dequantised right before its GEMM
                rows.append((name + " dequantise", "accelerator", t, t + D[k]))
                t += D[k]
            rows.append((name, "accelerator", t, t + G[k]))
            t += G[k]
            rows.append((name + " output", "d2h", t, t + OUT[k]))
            t += OUT[k]
            if k == j - 1:  # the segment is done: the next layer's copy is issued (Eq. 5)
                weights_s = float(eq7_h2d_s(oc.h2d_s, np.array([i]), np.array([j])).mean())
                rows.append(("next layer weights", "h2d", t, t + weights_s))
        else:
            rows.append((name, "cpu", t, t + C[k]))
            t += C[k]
    rows.append(("glue (norms, residuals, rotary, activation)", "cpu", t, t + oc.cpu_glue_s * cpu_under_copy))
    return tuple((a, b, float(s), float(e)) for a, b, s, e in rows)


class SplitPointsPolicy(Policy):
    """Layers streamed and cut by split points, the last M resident (M = 0: all streamed, as
    ``gpu-offload``; M > 0: as ``gpu-offload-partial``); M is searched like the other policies' M."""

    host_mode = SPLIT_POINTS
    needs_gpu_layers = True  # M is the caller's choice in a forced plan (the planner searches it)
    paper = "Park & Egger Eq. 5-7, 13 (section 4.2): operators of a streamed layer split between CPU and accelerator"

    def gpu_layer_options(self, num_layers):
        return np.arange(0, num_layers)

    def not_applicable(self, model) -> str:
        why = why_not_split(model)
        return f"cannot cut its layers into operators: {why}" if why else ""

    def estimate(self, pc: PhaseCosts, num_layers, gpu_layers):
        oc = pc.operators
        if oc is None:  # no accelerator, or a layout the operator list cannot cut
            inf = np.full(np.shape(gpu_layers), np.inf)
            return PhaseTime(gpu_layers, inf, inf)
        streamed = num_layers - gpu_layers
        best, t_streamed, (i, j) = search(oc, pc.cpu_under_copy, streamed)
        ends_s, ends_bytes = gpu_ends(pc)
        t_resident = gpu_layers * mean_over_steps(pc.t_gpu_layer_s)
        bi, bj = i[best], j[best]
        moved = (eq7_h2d_s(oc.h2d_bytes().mean(axis=0), bi, bj) + eq7_h2d_s(oc.in_bytes, bi, bj)
                 + eq7_h2d_s(oc.out_bytes, bi, bj))
        return PhaseTime(gpu_layers, t_streamed + t_resident + ends_s, streamed * moved + ends_bytes,
                         {"streamed_layers_s": t_streamed, "resident_layers_s": t_resident,
                          "transfers_and_head_s": np.full(np.shape(gpu_layers), ends_s)})

    def split_choice(self, pc: PhaseCosts, num_layers: int, gpu_layers: int) -> SplitPoints | None:
        """The split points the search picks for M = ``gpu_layers``, with one layer's timeline."""
        oc = pc.operators
        if oc is None:
            return None
        best, _, (i, j) = search(oc, pc.cpu_under_copy, np.array([num_layers - gpu_layers]))
        bi, bj = int(i[best[0]]), int(j[best[0]])
        layer, _, link = eq5_layer_s(oc, pc.cpu_under_copy, np.array([bi]), np.array([bj]))
        cpu = pc.cpu_under_copy * (eq6_cpu_s(oc.cpu_s, np.array([bi]), np.array([bj])) + oc.cpu_glue_s)
        return SplitPoints(oc.names, (bi, bj), float(layer.mean()), float(cpu.mean()), float(link.mean()),
                           timeline(oc, pc.cpu_under_copy, bi, bj), len(i))

    def fixed_split(self, model) -> SplitPoints:
        """A plan fixed by hand (``executor.fixed_plan``) without an estimate: the CPU computes the first
        operator and the last one, the accelerator the rest (1, n - 1)."""

        names = tuple(o.name for o in layer_operators(model))
        return SplitPoints(names, (1, len(names) - 1), float("nan"), float("nan"), float("nan"), (),
                           len(names) * (len(names) - 1) // 2)
