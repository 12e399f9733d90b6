"""Split points inside a streamed layer: Park & Egger (sections 3.1-4.2, Equations 5-7, 13, 14).

The layers are streamed as in ``gpu-offload``, but within each one the CPU computes a run of
operators from weights that never cross the link (before the first split point, after the
second) while the weights of the others cross and the accelerator computes them
(``estimator/split_terms.py`` prices the four operators, ``estimator/split_search.py`` searches
every pair of split points at once). One split for all layers of a phase and all its decode steps:
the pair with the lowest mean layer time. A streamed layer costs L(i, j) of the search (Eq. 5
with the accelerator's time and the hidden-state copies at the split points); the first copy is
not hidden, as in Eq. 2's pipeline. ``split-points-partial`` keeps the last M layers resident.

The chosen split points (``split_first_op``, ``split_last_op``: the accelerator computes
operators first..last-1) and the layer's time parts are estimate terms, so the planner records
them with the candidate and ``explain`` prints them with a per-operator timeline.

The executor does not run this policy yet: it is planned and explained (``executable`` is
False, so the planner of ``flexplan.load`` leaves it out and a forced plan is refused).
"""

from __future__ import annotations

import numpy as np

from flexplan.estimator.policies.base import PhaseTime, Policy, gpu_ends, mean_over_steps
from flexplan.estimator.split_search import copy_times_s, layer_times_s
from flexplan.estimator.split_terms import KV_OPERATOR, OPERATORS, layer_timeline
from flexplan.placement import STREAMED_SPLIT

TIMELINE = "timeline:"  # estimate terms "timeline:<row>:<device>:<operator>:start_s|end_s"


def split_lines(terms) -> list[str]:
    """What explain prints for a phase planned with split points: the split and one layer's timeline."""
    if "split_first_op" not in terms:
        return []
    i, j = int(terms["split_first_op"]), int(terms["split_last_op"])
    cpu_ops = [OPERATORS[k] for k in (*range(i), *range(j, len(OPERATORS)))]
    acc_ops = list(OPERATORS[i:j])
    lines = [f"split points {i}, {j}: CPU computes {', '.join(cpu_ops) or 'nothing'}; "
             f"accelerator {', '.join(acc_ops) or 'nothing'} (weights over the link)"]
    rows = {}
    for key, v in terms.items():
        if key.startswith(TIMELINE):
            k, device, op, edge = key[len(TIMELINE):].split(":")
            rows.setdefault((int(k), device, op), {"device": device, "operator": op})[edge] = v
    for k in sorted(rows):
        r = rows[k]
        if not all(r.get(e) is not None and np.isfinite(r[e]) for e in ("start_s", "end_s")):
            continue  # a row of another candidate's split
        lines.append(f"  {r['device']:<12} {r['operator']:<40} {r['start_s'] * 1e3:9.2f} - {r['end_s'] * 1e3:9.2f} ms")
    return lines


def split_time(pc, num_layers: int, gpu_layers: np.ndarray) -> PhaseTime:
    """The phase with each candidate M's streamed layers split at the pair that minimises their
    whole time, (N - M) mean L(i, j) + the first copy that no overlap hides, min(H2D(i, j), L(i, j)):
    exactly the quantity reported, so a faster link or CPU never makes the phase slower."""
    if pc.split is None or gpu_layers.size == 0:  # no accelerator, or no candidate M
        inf = np.full(gpu_layers.shape, np.inf)
        return PhaseTime(gpu_layers, inf, inf)
    ops = pc.split
    table = layer_times_s(ops.cpu_s, ops.acc_s, ops.h2d_weights_s, ops.h2d_kv_s, ops.boundary_s)
    h2d = copy_times_s(ops.h2d_weights_s, ops.h2d_kv_s)
    layer_mean = table.reshape(-1, *table.shape[-2:]).mean(axis=0)
    fill_mean = np.minimum(h2d, table).reshape(-1, *table.shape[-2:]).mean(axis=0)
    streamed = (num_layers - gpu_layers).astype(float)
    total = streamed[:, None, None] * layer_mean + np.where(streamed > 0, 1.0, 0.0)[:, None, None] * fill_mean
    n1 = layer_mean.shape[-1]
    i_j = np.where(np.isfinite(total), total, np.inf).reshape(len(gpu_layers), -1).argmin(axis=1)
    i, j = np.divmod(i_j, n1)
    t_streamed = total.reshape(len(gpu_layers), -1)[np.arange(len(gpu_layers)), i_j]
    t_resident = gpu_layers * mean_over_steps(pc.t_gpu_layer_s)
    ends_s, ends_bytes = gpu_ends(pc)
    h_w = np.asarray(ops.h2d_weights_s, dtype=float).reshape(-1, len(ops.names))[0]
    on_acc = (np.arange(len(ops.names))[None, :] >= i[:, None]) & (np.arange(len(ops.names))[None, :] < j[:, None])
    weight_share = (on_acc * h_w).sum(axis=1) / max(float(h_w.sum()), 1e-30)
    kv = np.where(on_acc[:, KV_OPERATOR], mean_over_steps(pc.kv_read_bytes), 0.0)
    per_layer_bytes = weight_share * pc.weight_bytes_gpu + kv
    terms = {"streamed_layers_s": t_streamed, "resident_layers_s": t_resident,
             "transfers_and_head_s": np.full(gpu_layers.shape, ends_s),
             "split_first_op": i.astype(float), "split_last_op": j.astype(float)}
    for first, last in set(zip(i.tolist(), j.tolist())):  # one streamed layer per split in use, for explain
        same = (i == first) & (j == last)
        for k, row in enumerate(layer_timeline(ops, first, last)):
            for edge in ("start_s", "end_s"):
                key = f"{TIMELINE}{k}:{row['device']}:{row['operator']}:{edge}"
                terms[key] = np.where(same, row[edge], terms.get(key, np.nan))
    return PhaseTime(gpu_layers, t_streamed + t_resident + ends_s, streamed * per_layer_bytes + ends_bytes, terms)


class SplitPointsPolicy(Policy):
    host_mode = STREAMED_SPLIT
    executable = False
    paper = "Park & Egger Eq. 5-7, 13 (split points inside a streamed layer)"

    def gpu_layer_options(self, num_layers):
        return np.array([0])

    def estimate(self, pc, num_layers, gpu_layers):
        return split_time(pc, num_layers, gpu_layers)


class SplitPointsPartialPolicy(SplitPointsPolicy):
    needs_gpu_layers = True
    paper = "Park & Egger Eq. 5-7, 13 for streamed layers, the last M resident"

    def gpu_layer_options(self, num_layers):
        return np.arange(1, num_layers)
