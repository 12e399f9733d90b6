"""memory.LinearTotals: a layout's totals as functions of the request's size, found once per
layout; they must equal footprint's totals for every request."""

from __future__ import annotations

import numpy as np
import pytest

from flexplan import memory
from flexplan.estimator.policies import POLICIES, REGISTRY
from flexplan.placement import Placement
from flexplan.planner import _inventory, _placed
from flexplan.workload import resolve_model

MODELS = ["meta-llama/Llama-3.1-8B", "Qwen/Qwen3-30B-A3B", "deepseek-ai/DeepSeek-V3", "google/gemma-3-27b-it"]
REQUESTS = [(1, 16, 20), (16, 512, 544), (7, 3000, 3333)]


def _footprint_totals(inv, placement, b, i, cap, reserve):
    need = memory.footprint(inv, placement, b, i, cap, memory.KERNEL_BLOCKED, reserve)
    return need.accelerator_bytes, need.host_total_bytes


@pytest.mark.parametrize("model", MODELS)
def test_one_phase_totals_equal_the_footprint_for_every_request(model):
    spec = resolve_model(model)
    inv, n = _inventory(spec), spec.num_layers
    for phase in ("prefill", "decode"):
        for name in POLICIES:
            pol = REGISTRY[name]
            ms = pol.gpu_layer_options(n)
            if not pol.vectorised:
                ms = ms[:3]
                lays = [memory.layout(inv, Placement.of({phase: _placed(pol, n, int(m), phase)}, "bfloat16", "float32"))
                        for m in ms]
                placements = [Placement.of({phase: _placed(pol, n, int(m), phase)}, "bfloat16", "float32") for m in ms]
            else:
                placements = [Placement.of({phase: pol.placement(n, ms, phase)}, "bfloat16", "float32")]
                lays = memory.layout(inv, placements[0])
            totals = memory.LinearTotals.of(lays)
            for b, i, cap in REQUESTS:
                acc, host = totals.totals(inv, "bfloat16", "float32", b, i, cap, 2e9)
                want = [_footprint_totals(inv, p, b, i, cap, 2e9) for p in placements]
                want_acc = np.concatenate([np.broadcast_to(w[0], np.shape(w[0]) or (1,)) for w in want])
                want_host = np.concatenate([np.broadcast_to(w[1], np.shape(w[1]) or (1,)) for w in want])
                np.testing.assert_array_equal(acc, want_acc, err_msg=f"{name} {phase}")
                np.testing.assert_array_equal(host, want_host, err_msg=f"{name} {phase}")


@pytest.mark.parametrize("model", MODELS)
def test_a_pairs_totals_equal_the_footprint_for_every_request(model):
    spec = resolve_model(model)
    inv, n = _inventory(spec), spec.num_layers
    rng = np.random.default_rng(1)
    for _ in range(30):
        p, d = rng.choice(POLICIES, 2)
        mp, md = (int(rng.choice(REGISTRY[x].gpu_layer_options(n))) for x in (p, d))
        placement = Placement.of({"prefill": _placed(REGISTRY[p], n, mp, "prefill"),
                                  "decode": _placed(REGISTRY[d], n, md, "decode")}, "bfloat16", "bfloat16")
        totals = memory.LinearTotals.of(memory.layout(inv, placement))
        for b, i, cap in REQUESTS:
            assert totals.one(inv, "bfloat16", "bfloat16", b, i, cap, 1e9) == \
                _footprint_totals(inv, placement, b, i, cap, 1e9), (p, mp, d, md)
