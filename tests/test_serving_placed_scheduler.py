"""FlexInfer under load (issue 39 item 4): each iteration of a placed model runs under the plan's
placement the estimator prices lower, on numbers worked by hand; any placement keeps the tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_model
from test_serving_placed import GIB, GREEDY, PLANS, PROMPTS, alone, drain

import flexplan.api as api
from flexplan.errors import InvalidInputError
from flexplan.estimator.iteration import iteration_time_s, ragged_shape
from flexplan.executor.plans import fixed_plan
from flexplan.serving.engine import Engine
from flexplan.serving.fcfs import FcfsScheduler
from flexplan.serving.kv_blocks import DEVICE, HOST
from flexplan.serving.placed_scheduler import PlacementScheduler
from flexplan.serving.state import EngineState, RequestState
from flexplan.serving.types import MODE_ASYNC_OVERLAP, IterationPlan


def toy_price_s(placement, phase, batch, tokens):
    """The prefill placement streams every layer: 100 ms a pass + 0.1 ms a row; the decode placement
    computes on the CPU: 20 ms + 5 ms a row. Rows: batch x tokens for a prefill, batch for a decode."""
    rows = batch * tokens if phase == "prefill" else batch
    return (0.100 + 1e-4 * rows) if placement == "prefill" else (0.020 + 5e-3 * rows)


def _state(decodes=0, prompt=0):
    """``decodes`` requests decoding at 40 tokens of context, and one waiting prompt of ``prompt`` tokens."""
    running = tuple(RequestState(f"d{i}", 8, 0, 40, 1, 1000, DEVICE, i) for i in range(decodes))
    waiting = (RequestState("p", prompt, prompt, 0, 0, 1000, None, decodes),) if prompt else ()
    return EngineState(waiting=waiting, running=running, free_blocks={DEVICE: 1000, HOST: 1000},
                       total_blocks={DEVICE: 1000, HOST: 1000}, block_size_tokens=16, token_budget=512,
                       max_running=64, accelerator=True)


@pytest.mark.parametrize("decodes, prompt, placement, ms", [
    (4, 0, "decode", 40.0),  # decode 20 + 4 x 5 = 40 < prefill 100 + 0.4
    (30, 0, "prefill", 103.0),  # prefill 100 + 3 < decode 20 + 150: a big decode batch streams
    (2, 8, "decode", 80.0),  # 10 rows over 3 segments, priced 3 x 4: decode 20 + 60 = 80 < prefill 101.2
    (0, 100, "prefill", 110.0),  # a long prompt streams: 110 < 520
])
def test_the_cheaper_placement_runs(decodes, prompt, placement, ms):
    plan = PlacementScheduler(toy_price_s).schedule(_state(decodes, prompt))
    assert plan.placement == placement and plan.predicted_s == pytest.approx(ms / 1e3)
    assert len(plan.request_ids) == decodes + (1 if prompt else 0)  # FCFS's batch, unchanged


def test_measured_times_correct_the_choice():
    """4 decodes: decode 40 ms predicted, 400 ms measured: its scale 0.8 + 0.2 x 10 = 2.8, so 112 ms
    > the prefill placement's 100.4 ms next time."""
    s = PlacementScheduler(toy_price_s)
    first = s.schedule(_state(4))
    assert first.placement == "decode"
    s.observe(first, 0.400)
    assert s.scale["decode"] == pytest.approx(2.8)
    again = s.schedule(_state(4))
    assert again.placement == "prefill" and again.predicted_s == pytest.approx(0.1004)
    s.observe(first, 0.400)  # not the last plan: nothing learned from it
    assert s.scale["decode"] == pytest.approx(2.8)


def test_a_tie_keeps_the_rule_and_an_unpriced_placement_loses():
    assert PlacementScheduler(lambda *a: 0.05).schedule(_state(4)).placement == "decode"
    assert PlacementScheduler(lambda *a: 0.05).schedule(_state(0, 9)).placement == "prefill"

    def cannot_price_decode(placement, phase, batch, tokens):
        if placement == "decode":
            raise InvalidInputError("no such figure")
        return 1.0

    assert PlacementScheduler(cannot_price_decode).schedule(_state(4)).placement == "prefill"
    assert PlacementScheduler(toy_price_s).schedule(_state()).request_ids == ()  # nothing to run


def test_ragged_shape():
    assert ragged_shape([], [10, 21]) == ("decode", 2, 16)  # mean context 15.5, rounded up
    assert ragged_shape([100, 7], [40, 41]) == ("prefill", 4, 28)  # (107 + 2) rows over 4 segments
    for chunks, contexts in (([], []), ([0], []), ([], [-1])):
        with pytest.raises(InvalidInputError, match="positive token counts"):
            ragged_shape(chunks, contexts)
    with pytest.raises(InvalidInputError, match="placement must be one of"):
        IterationPlan(mode="device-only", placement="streamed")


def _placed(family, prefill, decode):
    ref = make_model(family)
    plan = fixed_plan(ref.config, prefill, decode, 1, batch_size=1, input_len=8, output_len=6, gpu_memory_bytes=GIB)
    return ref, api.load(make_model(family), plan=plan, accelerator="cpu", gpu_memory_bytes=GIB)


def test_a_flexmodel_is_priced_by_its_plan():
    """The default scheduler of a placed engine prices each placement as iteration_time_s prices the
    plan's policy and M for it (the estimator plan() uses)."""
    torch.set_num_threads(1)
    _, lm = _placed("llama", "gpu-offload", "splitgen")
    with Engine(lm, device_blocks=16, host_blocks=16, block_size_tokens=4) as e:
        s = e.scheduler
        assert isinstance(s, PlacementScheduler)
        spec, hw, eff = lm.estimator_inputs()
        p = lm.plan
        for placement, phase, batch, tokens in (("decode", "decode", 3, 32), ("prefill", "prefill", 2, 50)):
            c = p.phases[placement]
            assert s.price_s(placement, phase, batch, tokens) == iteration_time_s(
                spec, hw, eff, c.policy, c.gpu_layers, phase, batch, tokens, p.dtype, p.cpu_dtype, p.weights)


class Flipped(FcfsScheduler):
    """FCFS, each iteration under the placement the engine's rule would not pick; host decodes in
    APEX's asynchronous overlap (their forward on a thread carries the placement too)."""

    def schedule(self, state):
        plan = super().schedule(state)
        placement = "prefill" if not plan.prefill else "decode"
        return dataclasses.replace(plan, placement=placement,
                                   mode=MODE_ASYNC_OVERLAP if plan.host_decodes else plan.mode)


@pytest.mark.parametrize("family,prefill,decode", PLANS, ids=lambda v: v)
def test_any_placement_keeps_the_tokens(family, prefill, decode):
    """Decodes under the prefill placement and prompts under the decode one: transformers' tokens,
    and the executor ran each placement the scheduler named."""
    torch.set_num_threads(1)
    ref, lm = _placed(family, prefill, decode)
    refs = [alone(ref, p) for p in PROMPTS]
    before = {ph: s.steps for ph, s in lm.executor.phase_stats.items()}
    with Engine(lm, device_blocks=6, host_blocks=32, block_size_tokens=4, token_budget=12, scheduler=Flipped()) as e:
        e.add_request("a", PROMPTS[0], GREEDY)
        e.add_request("b", PROMPTS[1], GREEDY)
        got = drain(e, {}, 2)
        e.add_request("c", PROMPTS[2], GREEDY)
        e.add_request("d", PROMPTS[3], GREEDY)
        got = drain(e, got, 200)
    assert [got[r] for r in "abcd"] == refs
    ran = {ph: s.steps - before.get(ph, 0) for ph, s in lm.executor.phase_stats.items()}
    assert ran.get("prefill", 0) > 0 and ran.get("decode", 0) > 0


def test_default_scheduler_serves_transformers_tokens():
    torch.set_num_threads(1)
    ref, lm = _placed("llama", "gpu-offload", "splitgen")
    refs = [alone(ref, p) for p in PROMPTS]
    placements = []
    with Engine(lm, device_blocks=16, host_blocks=16, block_size_tokens=4, token_budget=12) as e:
        schedule = e.scheduler.schedule
        e.scheduler.schedule = lambda st: placements.append(schedule(st).placement) or e.scheduler._last_plan
        for rid, p in zip("abcd", PROMPTS):
            e.add_request(rid, p, GREEDY)
        got = drain(e, {}, 200)
    assert [got[r] for r in "abcd"] == refs
    assert set(placements) <= {"prefill", "decode"} and placements
