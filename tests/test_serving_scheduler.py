"""NeoApexScheduler on numbers worked by hand: APEX's Inequality 6 choosing asymmetric
pipelining or asynchronous overlap, NEO's split of host decodes between the CPU sub-batch and the
next iteration, swap hysteresis, admission under full pools, the online correction; and the real
engine under the scheduler keeping generate()'s greedy tokens."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import make_model

from flexplan.errors import InvalidInputError
from flexplan.hardware import get_hardware
from flexplan.serving.engine import Engine
from flexplan.serving.kv_blocks import DEVICE, HOST
from flexplan.serving.scheduler import (
    NeoApexScheduler,
    algorithm_1,
    inequality_5_holds,
    inequality_6_holds,
)
from flexplan.serving.state import EngineState, RequestState
from flexplan.serving.types import (
    MODE_ASYMMETRIC,
    MODE_ASYNC_OVERLAP,
    MODE_CPU_ONLY,
    MODE_DEVICE_ONLY,
    SamplingParams,
)


class HandCost:
    """One layer. T_l(n) = 1 ms + 10 us per token (0 for none); T_ga = 1 us per attended key;
    T_ca = ``ca_s`` per attended key; no prefill attention, no head."""

    num_layers = 1

    def __init__(self, ca_s: float):
        self.ca_s = ca_s

    def t_l_s(self, n):
        return 0.0 if n <= 0 else 1e-3 + 1e-5 * n

    def t_ga_s(self, ctx):
        return 1e-6 * sum(ctx)

    def t_ca_s(self, ctx):
        return self.ca_s * sum(ctx)

    def t_pa_s(self, chunks):
        return 0.0

    def t_iteration_overhead_s(self, rows):
        return 0.0


def _rs(rid, *, ctx=99, pool=DEVICE, arrival=0, left=0, prompt=8):
    return RequestState(rid, prompt, left, ctx, 1, 1000, pool, arrival)


def _state(running, waiting=(), free=None, total=None, bs=1000):
    """Blocks of ``bs`` tokens (1000: every decode here fits the block it holds); by default the
    device pool full (no swap-in) and the host pool roomy."""
    return EngineState(waiting=tuple(waiting), running=tuple(running),
                       free_blocks=dict(free or {DEVICE: 0, HOST: 100}),
                       total_blocks=dict(total or {DEVICE: 100, HOST: 100}), block_size_tokens=bs,
                       token_budget=512, max_running=64, accelerator=True)


def test_inequality_6_is_inequality_5_rearranged():
    """T_glinear 1 ms, T_gatt 0.4 ms: 2 x 2.5 + 3 + 0.4 = 8.4."""
    assert inequality_6_holds(8.3, 1e-3, 0.4e-3) and not inequality_6_holds(8.5, 1e-3, 0.4e-3)
    for ratio in (1.0, 5.0, 8.3, 8.5, 20.0):  # N_G = 1000 tokens/s
        assert inequality_5_holds(1000.0, 1000.0 / ratio, 1e-3, 0.4e-3) == inequality_6_holds(ratio, 1e-3, 0.4e-3)
    assert algorithm_1(1, 1, 1e-3, 1e-3, has_cpu_decodes=False, has_prefill=False)[0] == MODE_DEVICE_ONLY


@pytest.mark.parametrize("ca_s, mode, host", [(4e-6, MODE_ASYMMETRIC, ("h1", "h2")),
                                              (10e-6, MODE_ASYNC_OVERLAP, ("h1",))])
def test_inequality_6_chooses_asymmetric_or_async_overlap(ca_s, mode, host):
    """Decode-only: d1, d2 on the device, h1, h2 on the host, each attending 100 keys (context 99
    plus its new token). Over the 4 decodes T_glinear = T_l(4) = 1.04 ms, T_gatt = 0.4 ms: the
    bound is 2 x 1.04/0.4 + 3 + 0.4/1.04 = 8.585; N_G/N_C = T_ca/T_ga = ca_s / 1 us.

    ca 4 us: 4 < 8.585, asymmetric. NEO's balance, T_ca1 <= T_l0 = T_l(2) = 1.02 ms: h1 0.4 ms,
    h1+h2 0.8 ms, both. T = max(1.02, 0.8) + T_l(2) 1.02 + T_ga0 0.2 = 2.24 ms for 4 requests:
    1786/s > GPU-only's 2 in T_l(2) + 0.2 = 1.22 ms, 1639/s.

    ca 10 us: 10 > 8.585, async overlap. The CPU's window is the GPU iteration T_l(2+k) + 0.2 ms:
    h1 1 ms <= 1.23 ms; h1+h2 2 ms > 1.24 ms, h2 waits. T = max(1.23, 1.0) = 1.23 ms for 3: 2439/s."""
    s = NeoApexScheduler(cost=HandCost(ca_s))
    state = _state([_rs("d1"), _rs("d2", arrival=1), _rs("h1", pool=HOST, arrival=2), _rs("h2", pool=HOST, arrival=3)])
    plan = s.schedule(state)
    assert plan.mode == mode, plan.why
    assert plan.device_decodes == ("d1", "d2") and plan.host_decodes == host
    want_s = 2.24e-3 if mode == MODE_ASYMMETRIC else 1.23e-3
    assert plan.predicted_s == pytest.approx(want_s)
    assert "Inequality 6" in plan.why


def test_neo_split_between_cpu_and_gpu_and_the_skipped_one_goes_next():
    """d1, d2 on the device (100 keys each); h1, h2, h3 on the host attending 600, 300, 200 keys;
    CPU 1 us per key. Over all 5: N_G/N_C = 1 < the bound, asymmetric. NEO's balance against
    T_l0 = 1.02 ms: h1 0.6, +h2 0.9, +h3 1.1 > 1.02: h3 skipped. T = max(1.02, 0.9) + 1.02 + 0.2 =
    2.24 ms for 4 (1786/s) beats GPU-only's 1639/s. Next iteration h3 has waited longest and
    goes first: h3 0.2, +h1 0.8, +h2 1.1 > 1.02: h2 waits its turn."""
    s = NeoApexScheduler(cost=HandCost(1e-6))
    state = _state([_rs("d1"), _rs("d2", arrival=1), _rs("h1", ctx=599, pool=HOST, arrival=2),
                    _rs("h2", ctx=299, pool=HOST, arrival=3), _rs("h3", ctx=199, pool=HOST, arrival=4)])
    plan = s.schedule(state)
    assert plan.mode == MODE_ASYMMETRIC and plan.host_decodes == ("h1", "h2"), plan.why
    assert plan.predicted_s == pytest.approx(2.24e-3)
    plan = s.schedule(state)
    assert plan.host_decodes == ("h1", "h3")


def test_greed_keeps_gpu_only_when_offloading_loses():
    """CPU 100 us per key: h1 alone costs 10 ms of CPU attention; ratio 100 fails Inequality 6 and
    async overlap's T = max(1.23, 10) = 10 ms for 3 requests (300/s) loses to GPU-only's 1639/s:
    GPU-only, h1 waits (counted from the iteration before it was first seen); the iteration after
    max_wait_iterations (3) it runs anyway, then waits again."""
    s = NeoApexScheduler(cost=HandCost(100e-6), max_wait_iterations=3)
    state = _state([_rs("d1"), _rs("d2", arrival=1), _rs("h1", pool=HOST, arrival=2)])
    modes = [s.schedule(state).mode for _ in range(5)]
    assert modes == [MODE_DEVICE_ONLY] * 3 + [MODE_ASYNC_OVERLAP, MODE_DEVICE_ONLY]


def test_swap_in_hysteresis_never_flip_flops():
    """Device pool 20 blocks of 4 tokens: headroom ceil(0.1 x 20) = 2 blocks. d1 (context 8: its
    next token takes a block) on the device, h1 (context 8: 2 blocks + 1) on the host. Swap in
    h1 needs free - 1 (d1) - 3 (h1) >= 2: 5 free stays, 6 free swaps it in. Swapped out under
    pressure, it stays on the host for min_dwell_iterations (4) however free the device is."""
    s = NeoApexScheduler(cost=HandCost(1e-6), min_dwell_iterations=4)
    total = {DEVICE: 20, HOST: 20}

    def at(free_dev, h1_pool=HOST):
        return _state([_rs("d1", ctx=8), _rs("h1", ctx=8, pool=h1_pool, arrival=1)],
                      free={DEVICE: free_dev, HOST: 10}, total=total, bs=4)

    assert s.schedule(at(5)).swap_in == ()
    plan = s.schedule(at(6))
    assert plan.swap_in == ("h1",) and plan.device_decodes == ("d1", "h1") and plan.mode == MODE_DEVICE_ONLY
    # the device fills: FCFS's rule moves the latest device request (h1) out
    plan = s.schedule(at(1, DEVICE))
    assert plan.swap_out == ("h1",) and plan.host_decodes == ("h1",)
    swaps = [s.schedule(at(15)).swap_in for _ in range(4)]
    assert swaps == [(), (), (), ("h1",)]  # iterations 4, 5, 6 inside the dwell; 7 = 3 + 4


def test_admission_under_full_pools():
    """Blocks of 4. Both pools full, the decodes within their blocks (context 5 -> 6): the waiting
    request is not admitted and the decodes run. With 2 host blocks free its 6 tokens + 1 go to the
    host pool, prefilled in the (empty-CPU) asymmetric iteration as FCFS runs a host prefill."""
    s = NeoApexScheduler(cost=HandCost(1e-6))
    running = [_rs("a", ctx=5), _rs("b", ctx=5, arrival=1)]
    w = _rs("w", ctx=0, pool=None, arrival=2, left=6, prompt=6)
    plan = s.schedule(_state(running, [w], free={DEVICE: 0, HOST: 0}, total={DEVICE: 4, HOST: 2}, bs=4))
    assert plan.prefill == () and plan.device_decodes == ("a", "b") and plan.preempted == ()
    plan = s.schedule(_state(running, [w], free={DEVICE: 0, HOST: 2}, total={DEVICE: 4, HOST: 2}, bs=4))
    assert plan.prefill == (("w", 6),) and plan.prefill_host == ("w",) and plan.mode == MODE_ASYMMETRIC


def test_observe_scales_the_mode_within_bounds():
    s = NeoApexScheduler(cost=HandCost(4e-6))
    plan = s.schedule(_state([_rs("d1")]))
    assert plan.predicted_s == pytest.approx(1.01e-3 + 100e-6)
    s.observe(plan, 2 * plan.predicted_s)  # 0.8 x 1 + 0.2 x 2
    assert s.scale[MODE_DEVICE_ONLY] == pytest.approx(1.2)
    for _ in range(100):
        s.observe(plan, 1e3)
    assert s.scale[MODE_DEVICE_ONLY] == 4.0


def test_no_accelerator_is_fcfs_on_the_cpu():
    s = NeoApexScheduler()  # no hardware: no accelerator to cost
    plan = s.schedule(_state([_rs("a", pool=HOST)], free={DEVICE: 0, HOST: 10}, total={DEVICE: 0, HOST: 10}))
    assert plan.mode == MODE_CPU_ONLY and plan.host_decodes == ("a",)


def test_the_real_cost_model_prices_a_t4_iteration():
    """The estimator's terms on the T4 testbed with Llama-2-7B: a decode batch's linear time grows
    slower than its token count (weights read once), CPU attention is slower than the GPU's."""
    from flexplan.estimator.efficiency import DefaultEfficiency
    from flexplan.workload import resolve_model

    hw = get_hardware("neo-testbed-g4dn-4xlarge")
    s = NeoApexScheduler(resolve_model("meta-llama/Llama-2-7b-hf"), hw, DefaultEfficiency.for_hardware(hw))
    c = s.cost
    assert c.t_l_s(64) < 2 * c.t_l_s(1)
    assert c.t_ca_s([1000] * 8) > c.t_ga_s([1000] * 8) > 0
    running = [_rs(f"d{i}", ctx=600, arrival=i) for i in range(8)]
    running += [_rs(f"h{i}", ctx=600, pool=HOST, arrival=8 + i) for i in range(16)]
    plan = s.schedule(_state(running))
    assert plan.mode in (MODE_ASYMMETRIC, MODE_ASYNC_OVERLAP) and plan.host_decodes and plan.predicted_s > 0


@pytest.mark.parametrize("ca_s", [4e-6, 10e-6])
def test_the_engine_under_the_scheduler_keeps_generates_tokens(ca_s):
    """The tiny random Llama (float32, the CPU standing in for the accelerator), a device pool too
    small for all: the scheduler's plans pass the engine's check and every request's greedy tokens
    equal generate() on it alone, whatever the mode (asymmetric at 4 us per key, async overlap at 10)."""
    torch.set_num_threads(1)
    model = make_model("llama")
    prompts = ([5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 52)), [99], [40, 41, 42, 43])
    params = SamplingParams(max_tokens=10, temperature=0.0)
    refs = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p):].tolist()
        eos = model.generation_config.eos_token_id
        refs.append(out[:out.index(eos) + 1] if eos in out else out)
    got, modes = {}, set()
    sched = NeoApexScheduler(cost=HandCost(ca_s), min_dwell_iterations=2)
    with Engine(model, device_blocks=6, host_blocks=64, block_size_tokens=4, token_budget=16, scheduler=sched) as e:
        for i, p in enumerate(prompts):
            e.add_request(str(i), p, params)
        for _ in range(300):
            if not e.has_unfinished():
                break
            for o in e.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
            modes.add(e.stats().last_mode)
    assert [got[str(i)] for i in range(len(prompts))] == refs
    assert modes & {MODE_ASYMMETRIC, MODE_ASYNC_OVERLAP}, modes


def test_preemption_order_latest_arrival_gives_way():
    """Blocks of 4, every request at context 4 (its next token needs a new block). Device pool:
    3 requests, 0 blocks free. Reservations 3 > 0: c (latest) gives way, freeing 1 -> 2 needed > 1
    free: b gives way too -> a's 1 <= 2 free. Host pool with room for one (2 blocks: held 1 +
    next 1): c swaps out, b (no room left) is preempted; a, the earliest, always progresses."""
    s = NeoApexScheduler(cost=HandCost(1e-6))
    running = [_rs("a", ctx=4), _rs("b", ctx=4, arrival=1), _rs("c", ctx=4, arrival=2)]
    plan = s.schedule(_state(running, free={DEVICE: 0, HOST: 2}, total={DEVICE: 3, HOST: 2}, bs=4))
    assert plan.swap_out == ("c",) and plan.preempted == ("b",)
    assert plan.device_decodes == ("a",) and "b" not in plan.host_decodes


@pytest.mark.parametrize("kwargs, says", [
    ({"swap_in_headroom": 1.5}, "[0, 1)"),
    ({"min_dwell_iterations": -1}, "dwell >= 0"),
    ({"hw": "t4"}, "spec="),
])
def test_bad_configuration_says_what_would_work(kwargs, says):
    if kwargs.get("hw") == "t4":
        kwargs = {"hw": get_hardware("neo-testbed-g4dn-4xlarge")}
    with pytest.raises(InvalidInputError, match=re.escape(says)):
        NeoApexScheduler(**kwargs)
