"""The planner prices one CPU dtype only where the other cannot win (planner._dominates). That
rests on a property of every policy's estimate: it is non-decreasing in each time it reads. These
tests check the property term by term, and that a plan is the same with the skip as without it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import flexplan
from flexplan import planner
from flexplan.estimator import REGISTRY, Shape, phase_costs
from flexplan.estimator.policies import POLICIES
from flexplan.planner import PHASES, _efficiency, _resolve_hardware
from flexplan.workload import resolve_model

MODELS = ["meta-llama/Llama-3.1-8B", "Qwen/Qwen3-30B-A3B", "google/gemma-3-27b-it", "openai/gpt-oss-20b"]
SERVERS = ["flexinfer-server2", "neo-testbed-g4dn-4xlarge"]


def _time_paths(x, path=()):
    """Paths of the CPU times (the fields a CPU dtype may change: planner._is_cpu_time) in nested dataclasses."""
    for f in dataclasses.fields(x):
        v = getattr(x, f.name)
        if dataclasses.is_dataclass(v):
            yield from _time_paths(v, path + (f.name,))
        elif planner._is_cpu_time(f.name) and v is not None:
            yield path + (f.name,)


def _scaled(x, path, factor):
    if len(path) == 1:
        return dataclasses.replace(x, **{path[0]: np.asarray(getattr(x, path[0])) * factor})
    return dataclasses.replace(x, **{path[0]: _scaled(getattr(x, path[0]), path[1:], factor)})


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("model", MODELS)
def test_every_estimate_is_non_decreasing_in_each_cpu_time(model, server):
    spec, hw = resolve_model(model), _resolve_hardware(server)
    eff, n = _efficiency(hw, None), spec.num_layers
    checked = 0
    for phase in PHASES:
        pc = phase_costs(Shape(spec, 4, 512, 32, "bfloat16", "float32"), hw, eff, phase)
        for name in POLICIES:
            pol = REGISTRY[name]
            if pol.not_applicable(spec):
                continue
            ms = pol.gpu_layer_options(n)
            base = pol.estimate(pc, n, ms).time_s
            for path in _time_paths(pc):
                longer = pol.estimate(_scaled(pc, path, 1.5), n, ms).time_s
                ok = np.isnan(base) | (longer >= base * (1 - 1e-12))
                assert ok.all(), f"{name} {phase}: {'.'.join(path)} x1.5 shortened the phase at M={ms[~ok][:5]}"
                checked += 1
    assert checked > 50


def test_the_native_dtype_dominates_float32_on_the_papers_server():
    """Not vacuous: on FlexInfer's Sapphire Rapids server (bf16 AMX, datasheet factors) float32 is skipped."""
    spec, hw = resolve_model("meta-llama/Llama-3.1-8B"), _resolve_hardware("flexinfer-server2")
    eff = _efficiency(hw, None)
    pcs = {cd: {ph: phase_costs(Shape(spec, 16, 512, 32, "bfloat16", cd), hw, eff, ph) for ph in PHASES}
           for cd in ("bfloat16", "float32")}
    assert planner._dominates("bfloat16", "float32", pcs)
    assert not planner._dominates("float32", "bfloat16", pcs)  # more bytes per value


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("shape", [(1, 128, 32), (16, 512, 32), (4, 4096, 256)])
def test_a_plan_is_the_same_with_the_skip_as_without(monkeypatch, server, shape):
    b, i, o = shape

    def plans():
        out = {}
        for model in MODELS + ["meta-llama/Llama-3.1-70B", "mistralai/Mixtral-8x7B-v0.1"]:
            try:
                out[model] = repr(flexplan.plan(model, server, batch_size=b, input_len=i, output_len=o))
            except flexplan.DoesNotFitError as e:
                out[model] = str(e)
        return out

    with_skip = plans()
    monkeypatch.setattr(planner, "_dominates", lambda *a: False)
    assert plans() == with_skip
