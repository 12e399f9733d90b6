"""The serving engine: a request's greedy tokens equal transformers' generate() on its prompt
alone, whatever shares its batch (other lengths, later arrivals, aborts, the host pool, swaps,
preemption); blocks freed on finish and abort; seeded sampling repeatable; stop strings and
max_tokens; bad input refused with what would work."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, needs_gguf
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from flexplan.errors import FlexplanError, InvalidInputError, UnsupportedModelError
from flexplan.executor import native
from flexplan.serving import paged_attention
from flexplan.serving.engine import Engine
from flexplan.serving.fcfs import FcfsScheduler
from flexplan.serving.kv_blocks import DEVICE, HOST
from flexplan.serving.model_runner import RUNNER
from flexplan.serving.state import EngineState, RequestState
from flexplan.serving.types import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    MODE_ASYMMETRIC,
    MODE_ASYNC_OVERLAP,
    MODE_CPU_ONLY,
    MODE_DEVICE_ONLY,
    IterationPlan,
    SamplingParams,
)
from flexplan.smollm import default_model_dir

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
PROMPTS = ([5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 52)), [99])
# families whose attention differs: MHA Llama, GQA 4:1 Mistral, Qwen2's biases (GQA 4:2), Qwen3's QK-norm,
# Gemma 2's soft-capping and alternating sliding window, gpt-oss's attention sinks, DeepSeek V3's latent (MLA) cache
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt_oss", "deepseek_v3")
# the other decoder-only families of the executor's tests the engine serves (the slow set)
MORE = ("opt", "llama3", "mistral_sw", "phi3", "gemma3", "olmo2", "gpt_neox", "mixtral", "qwen2_moe", "qwen3_moe",
        "granite", "gpt2", "gptj", "phi", "starcoder2", "cohere2", "bert")


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return {f: make_model(f) for f in FAMILIES}


def alone(model, prompt, max_tokens=GREEDY.max_tokens) -> list[int]:
    """transformers' greedy generate() on the prompt alone (stops at EOS as the engine does)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)[0, len(prompt):]
    eos = model.generation_config.eos_token_id
    ids = out.tolist()
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def drain(engine: Engine, outputs: dict | None = None, steps: int = 500) -> dict[str, list]:
    """step() until done; request id -> [tokens, finish_reason]."""
    outputs = {} if outputs is None else outputs
    for _ in range(steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            got = outputs.setdefault(o.request_id, [[], None])
            got[0].extend(o.new_token_ids)
            if o.finished:
                got[1] = o.finish_reason
    return outputs


def assert_freed(engine: Engine):
    used, free = engine.blocks.usage()
    assert used == {DEVICE: 0, HOST: 0}
    assert free == {n: p.num_blocks for n, p in engine.blocks.pools.items()}
    assert not engine.blocks.tables


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_generate_whatever_shares_the_batch(models, family):
    """Four prompts of different lengths, two arriving later, one aborted mid-way; a device pool
    too small for all (the rest in the host pool), chunked prefill under a 16-token budget."""
    model = models[family]
    refs = [alone(model, p) for p in PROMPTS]
    with Engine(model, device_blocks=6, host_blocks=64, block_size_tokens=4, token_budget=16) as e:
        e.add_request("a", PROMPTS[0], GREEDY)
        e.add_request("b", PROMPTS[1], GREEDY)
        e.add_request("doomed", PROMPTS[2], GREEDY)
        got = drain(e, steps=2)
        e.add_request("c", PROMPTS[2], GREEDY)
        got = drain(e, got, steps=3)
        assert e.abort("doomed")
        e.add_request("d", PROMPTS[3], GREEDY)
        modes, both = set(), False
        while e.has_unfinished():
            drain(e, got, steps=1)
            stats = e.stats()
            modes.add(stats.last_mode)
            both |= min(stats.running_by_device.values()) > 0  # requests in both pools at once
            assert stats.blocks_used[DEVICE] + stats.blocks_free[DEVICE] == 6
        assert got["doomed"][1] == FINISH_ABORT
        for rid, ref in zip("abcd", [refs[0], refs[1], refs[2], refs[3]]):
            assert got[rid][0] == ref, rid
        assert MODE_ASYMMETRIC in modes and both  # some decodes ran beside the host pool
        assert_freed(e)
    # the caller's model is as it was: generate() after the engine closed gives the same tokens
    assert alone(model, PROMPTS[0]) == refs[0]


@pytest.mark.slow
@pytest.mark.parametrize("family", MORE)
def test_greedy_equals_generate_in_more_families(family):
    model = make_model(family)
    refs = [alone(model, p) for p in PROMPTS]
    with Engine(model, device_blocks=8, host_blocks=64, block_size_tokens=4, token_budget=16) as e:
        outs = e.generate(list(PROMPTS), GREEDY)
        assert [list(o.new_token_ids) for o in outs] == refs
        assert_freed(e)


@pytest.mark.parametrize("kernel", ["paged", "gathered-native", "gathered-sdpa"])
def test_every_decode_attention_path_keeps_the_tokens(models, kernel, monkeypatch):
    """The paged kernel reads the blocks where they lie; without it (no compiler, FLEXPLAN_NATIVE=0)
    the past is gathered and attended by the strided native kernel, or without that by SDPA."""
    if kernel != "paged":
        monkeypatch.setattr(paged_attention, "status", lambda: (None, "off in this test"))
    elif paged_attention.status()[0] is None:
        pytest.skip(paged_attention.status()[1])
    if kernel == "gathered-sdpa":
        monkeypatch.setattr(native, "decode_status", lambda: (None, "off in this test"))
    model = models["mistral"]  # GQA 4:1
    refs = [alone(model, p) for p in PROMPTS]
    with Engine(model, device_blocks=4, host_blocks=64, block_size_tokens=4) as e:
        assert [list(o.new_token_ids) for o in e.generate(list(PROMPTS), GREEDY)] == refs


def test_bfloat16_kv_blocks_under_a_float32_model(models, monkeypatch):
    """kv_dtype=bfloat16: pools of half the bytes (twice the blocks in one budget); the one native
    call per decode iteration and the per-layer calls round each new K/V alike (the C rounding is
    torch's) and give the same tokens; a bad dtype is refused naming what works."""
    import copy

    from flexplan.executor import cpu_linear
    from flexplan.serving import fused_step
    from flexplan.serving.kv_blocks import pool_blocks

    if not (native.decode_status()[0] and cpu_linear.blocking_available() and fused_step.stack_status()[0]):
        pytest.skip("no native kernels here (no C compiler)")
    model = copy.deepcopy(wide_kv_model("llama"))  # blocked weights, as Engine.from_pretrained packs them
    cpu_linear.pack_module(model, None, cpu_linear.KERNEL_BLOCKED)
    budget = dict(device=torch.device("cpu"), block_size_tokens=4, token_budget=64, max_running=8,
                  host_memory_bytes=1 << 20)
    assert pool_blocks(model, kv_dtype=torch.bfloat16, **budget)[1] == 2 * pool_blocks(model, **budget)[1]
    runs = {}
    for path in ("one call", "per layer"):
        if path == "per layer":
            monkeypatch.setattr(fused_step, "stack_status", lambda: (None, "off in this test"))
        with Engine(model, host_blocks=64, block_size_tokens=4, kv_dtype=torch.bfloat16) as e:
            out = [list(o.new_token_ids) for o in e.generate(list(PROMPTS), GREEDY)]
            pool = e.blocks.pools[HOST]
            assert pool.k_slots.dtype == pool.v_slots.dtype == torch.bfloat16
            runs[path] = (out, pool.k_slots.clone(), pool.v_slots.clone(), e.runner.fused.stack_iterations)
    assert runs["one call"][3] > 0 and runs["per layer"][3] == 0
    assert runs["one call"][0] == runs["per layer"][0]
    assert torch.equal(runs["one call"][1], runs["per layer"][1]) and torch.equal(runs["one call"][2],
                                                                                  runs["per layer"][2])
    with pytest.raises(InvalidInputError, match="kv_dtype=torch.int8: give one of"):
        Engine(model, host_blocks=4, kv_dtype=torch.int8)


@settings(max_examples=24, deadline=None)
@given(st.integers(1, 5), st.sampled_from([(4, 4), (6, 2), (3, 1)]), st.sampled_from([1, 4, 16]),
       st.integers(0, 2**16), st.sampled_from([None, 3]), st.sampled_from([8, 20, 64, 128]),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_paged_kernel_equals_sdpa_on_a_gathered_past(n, heads, bs, seed, window, d, dtype):
    """Head dims of every path the kernel has: 64 and 128 unrolled, other multiples of the vector
    width by count, the rest (20; 8 under AVX-512) element by element; both pool dtypes."""
    ops = paged_attention.status()[0]
    if ops is None:
        pytest.skip(paged_attention.status()[1])
    g = torch.Generator().manual_seed(seed)
    hq, hk = heads
    blocks = 40
    k, v = (torch.randn(blocks * bs, hk, d, generator=g).to(dtype) for _ in range(2))
    kv_len = torch.randint(1, 4 * bs + 1, (n,), generator=g)
    tables = torch.randperm(blocks, generator=g)[:n * 4].view(n, 4)
    kv_lo = (kv_len - window).clamp(min=0) if window else torch.zeros(n, dtype=torch.long)
    q = torch.randn(n, hq, d, generator=g)
    ref = paged_attention.reference(q, k, v, tables, kv_len, kv_lo, bs, 0.35)
    assert torch.allclose(ops(q, k, v, tables, kv_len, kv_lo, bs, 0.35), ref, atol=1e-6, rtol=1e-5)


_REFS: dict[tuple, list[int]] = {}


def cached_alone(model, prompt: tuple, max_tokens: int) -> list[int]:
    key = (id(model), prompt, max_tokens)
    if key not in _REFS:
        _REFS[key] = alone(model, list(prompt), max_tokens)
    return _REFS[key]


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(3, 159), min_size=1, max_size=14), st.integers(0, 4),
                          st.one_of(st.none(), st.integers(0, 6)), st.integers(1, 6)), min_size=1, max_size=4),
       st.integers(0, 6), st.integers(0, 40), st.sampled_from([2, 4, 16]), st.integers(1, 24),
       st.sampled_from(["serial", "pipelined", "async-overlap"]))
def test_greedy_tokens_whatever_the_arrivals_aborts_and_pools(models, requests, device_blocks, host_extra, bs,
                                                                budget, execution):
    """Any prompts arriving at any steps, some aborted, any pool sizes that hold each request
    alone, any block size and token budget, the host decodes run with the rest, beside them
    (NEO) or one iteration later (APEX): every request that is not aborted gets generate()'s
    tokens, and every block comes back."""
    model = models["qwen3"]
    need = max(-(-(len(p) + n) // bs) for p, _, _, n in requests)
    host_blocks = need + host_extra if device_blocks < need else host_extra
    with Engine(model, device_blocks=device_blocks, host_blocks=host_blocks, block_size_tokens=bs,
                token_budget=budget, asymmetric_pipelining=execution == "pipelined",
                scheduler=AsyncOverlap() if execution == "async-overlap" else None) as e:
        got: dict = {}
        aborted = set()
        for step in range(400):
            for i, (prompt, arrive, abort_at, n) in enumerate(requests):
                if arrive == step:
                    e.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0))
                if abort_at is not None and arrive + abort_at == step and e.abort(str(i)):
                    aborted.add(str(i))
            if step > max(a for _, a, _, _ in requests) and not e.has_unfinished():
                break
            drain(e, got, steps=1)
        for i, (prompt, _, _, n) in enumerate(requests):
            if str(i) not in aborted:
                assert got[str(i)][0] == cached_alone(model, tuple(prompt), n), i
            else:
                assert got[str(i)][1] == FINISH_ABORT
        assert_freed(e)


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 40), st.lists(st.integers(3, 159), max_size=6),
                          st.integers(0, 5), st.integers(1, 5)), min_size=2, max_size=5),
       st.integers(0, 8), st.sampled_from([2, 4]), st.integers(2, 24))
def test_prefix_cache_keeps_the_tokens_whatever_is_shared_evicted_or_preempted(models, requests, device_blocks, bs,
                                                                                 budget):
    """Prompts that share leading tokens (two system prompts, any length of them, any suffix),
    arriving at any steps, in pools small enough to evict cached blocks and to preempt: every
    request gets generate()'s tokens, a request after another with its prefix computes less, and
    every block comes back (a cached one is free to take)."""
    model = models["qwen3"]
    heads = ([11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
             [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109])
    prompts = [heads[h][:k] + tail or [7] for h, k, tail, _, _ in requests]
    need = max(-(-(len(p) + n) // bs) for p, (_, _, _, _, n) in zip(prompts, requests))
    with Engine(model, device_blocks=device_blocks, host_blocks=need + 2, block_size_tokens=bs,
                token_budget=budget) as e:
        got: dict = {}
        for step in range(400):
            for i, (p, (_, _, _, arrive, n)) in enumerate(zip(prompts, requests)):
                if arrive == step:
                    e.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0))
            if step > max(r[3] for r in requests) and not e.has_unfinished():
                break
            drain(e, got, steps=1)
        for i, (p, (_, _, _, _, n)) in enumerate(zip(prompts, requests)):
            assert got[str(i)][0] == cached_alone(model, tuple(p), n), i
        assert_freed(e)
        stats = e.stats()
        assert stats.prefix_hit_tokens <= stats.prefix_query_tokens


def test_requests_added_together_compute_their_shared_prefix_once(models):
    """Three requests with a 40-token system prompt added at once, a budget that would admit them
    all in one iteration: the first computes the prompt, the others wait an iteration and take its
    2 whole blocks of 16 from the cache; a request with another prompt is not held; the tokens equal
    generate()'s. With prefix_caching=False all four run at once and compute everything."""
    model = models["qwen3"]
    system = list(range(20, 60))
    prompts = {"a": system + [5, 6], "b": system + [7, 8, 9], "c": system + [10], "x": list(range(70, 110))}
    for caching in (True, False):
        with Engine(model, device_blocks=0, host_blocks=64, token_budget=512, prefix_caching=caching) as e:
            for rid, p in prompts.items():
                e.add_request(rid, p, SamplingParams(max_tokens=4, temperature=0))
            assert {r.request_id for r in e.state().waiting} == ({"a", "x"} if caching else set(prompts))
            got: dict = {}
            drain(e, got)
            assert e.stats().prefix_hit_tokens == (2 * 32 if caching else 0)
            for rid, p in prompts.items():
                assert got[rid][0] == cached_alone(model, tuple(p), 4), rid
            assert_freed(e)


def test_prefix_cache_serves_a_shared_prompt_once(models):
    """A second request with the first's 40-token prefix takes its 2 full blocks of 16 (32 tokens,
    never the prompt's last) and computes only the rest; the tokens equal generate()'s; with
    prefix_caching=False it computes everything."""
    model = models["qwen3"]
    system = list(range(20, 60))
    for caching, hits in ((True, 32), (False, 0)):
        with Engine(model, device_blocks=0, host_blocks=64, prefix_caching=caching) as e:
            a = drain_one(e, "a", system + [5, 6], 4)
            e.add_request("b", system + [7, 8, 9], SamplingParams(max_tokens=4, temperature=0))
            plan_tokens = []
            while e.has_unfinished():
                e.step()
                plan_tokens.append(e._scheduled_tokens)
            assert plan_tokens[0] == len(system) + 3 - hits  # the prefill: what the cache does not hold
            assert e.stats().prefix_hit_tokens == hits and (e.stats().blocks_cached["host"] > 0) == caching
            assert a == cached_alone(model, tuple(system + [5, 6]), 4)
            assert_freed(e)


def drain_one(e: Engine, rid: str, prompt: list[int], n: int) -> list[int]:
    e.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0))
    return drain(e)[rid][0]


def test_a_scheduler_that_observes_gets_each_iterations_time(models):
    class Observing(FcfsScheduler):
        def __init__(self):
            self.seen = []

        def observe(self, plan, seconds):
            self.seen.append((plan.mode, seconds))

    sched = Observing()
    with Engine(models["llama"], host_blocks=16, scheduler=sched) as e:
        e.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert len(sched.seen) == e.stats().iterations == 3
        assert all(mode == MODE_CPU_ONLY and s > 0 for mode, s in sched.seen)
        assert e.last_iteration_s == sched.seen[-1][1]


def test_cpu_only_and_max_tokens(models):
    model = models["llama"]
    with Engine(model, host_blocks=32) as e:
        outs = e.generate(list(PROMPTS), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert e.stats().last_mode == MODE_CPU_ONLY
        assert [len(o.new_token_ids) for o in outs] == [4] * 4
        assert all(o.finish_reason == FINISH_LENGTH and o.completion_tokens == 4 for o in outs)
        assert_freed(e)
        stats = e.stats()
        assert stats.generated_tokens_total == 16 and stats.prompt_tokens_total == sum(map(len, PROMPTS))


class ForcedScheduler(FcfsScheduler):
    """FCFS, but request "h" goes to the host pool, and "s" is swapped out after its 3rd output
    token and back in after its 6th."""

    def schedule(self, state: EngineState) -> IterationPlan:
        plan = FcfsScheduler().schedule(state)
        s = {r.request_id: r for r in state.running}.get("s")
        swap_out = ("s",) if s and s.pool == DEVICE and s.output_tokens == 3 else ()
        swap_in = ("s",) if s and s.pool == HOST and s.output_tokens == 6 else ()
        moved = swap_out + swap_in
        dev = tuple(r for r in plan.device_decodes if r not in moved) + (swap_in if s and s.decoding else ())
        host = tuple(r for r in plan.host_decodes if r not in moved) + (swap_out if s and s.decoding else ())
        host_prefill = plan.prefill_host + tuple(r for r, _ in plan.prefill if r == "h")
        return IterationPlan(mode=MODE_ASYMMETRIC, prefill=plan.prefill, device_decodes=dev, host_decodes=host,
                             swap_out=swap_out, swap_in=swap_in, preempted=plan.preempted, prefill_host=host_prefill)


@pytest.mark.parametrize("pipelined", [False, True])
def test_host_pool_and_swaps_keep_the_tokens(models, pipelined):
    """Also with NEO's two sub-batches run at once in threads (the host decodes' attention on the
    CPU beside the other sub-batch's forward)."""
    model = models["qwen2"]
    refs = [alone(model, p) for p in PROMPTS[:3]]
    with Engine(model, device_blocks=32, host_blocks=32, block_size_tokens=4, scheduler=ForcedScheduler(),
                asymmetric_pipelining=pipelined) as e:
        split = []
        inner = e.runner.forward_sub_batches
        e.runner.forward_sub_batches = lambda parts, *a: split.append([len(p) for p in parts]) or inner(parts, *a)
        for rid, p in zip("hsx", PROMPTS[:3]):
            e.add_request(rid, p, GREEDY)
        got = drain(e, steps=1)
        assert e.blocks.pool_of("h") == HOST and e.blocks.pool_of("s") == DEVICE
        pools_of_s = []
        while e.has_unfinished():
            got = drain(e, got, steps=1)
            pools_of_s.append(e.blocks.pool_of("s"))
        assert HOST in pools_of_s and pools_of_s[pools_of_s.index(HOST):].count(DEVICE) > 0  # out, then back in
        assert bool(split) == pipelined and (not pipelined or any(min(parts) > 0 for parts in split))
        assert [got[r][0] for r in "hsx"] == refs
        assert_freed(e)


class AsyncOverlap(FcfsScheduler):
    """FCFS, every iteration with host decodes in APEX's asynchronous overlap."""

    def schedule(self, state: EngineState) -> IterationPlan:
        plan = super().schedule(state)
        mode = MODE_ASYNC_OVERLAP if plan.host_decodes else plan.mode
        return IterationPlan(mode=mode, prefill=plan.prefill, device_decodes=plan.device_decodes,
                             host_decodes=plan.host_decodes, swap_out=plan.swap_out, preempted=plan.preempted,
                             prefill_host=plan.prefill_host)


def test_async_overlap_delivers_host_tokens_one_step_later_and_keeps_them(models):
    """Host decodes run on a thread beside the next iteration; their tokens come out of the next
    step(); an abort of one in flight waits for it, then frees its blocks."""
    model = models["llama"]
    refs = [alone(model, p) for p in PROMPTS]
    with Engine(model, device_blocks=6, host_blocks=64, block_size_tokens=4, scheduler=AsyncOverlap()) as e:
        for rid, p in zip("abcd", PROMPTS):
            e.add_request(rid, p, GREEDY)
        e.add_request("doomed", PROMPTS[2], GREEDY)
        got = drain(e, steps=3)
        assert e._in_flight is not None  # host decodes under way between steps
        in_flight = [s.request_id for s in e._in_flight.segments]
        assert e.abort(in_flight[-1])
        got = drain(e, got)
        assert got[in_flight[-1]][1] == FINISH_ABORT
        cut = got[in_flight[-1]][0]
        assert cut == refs["abcd".index(in_flight[-1])][:len(cut)] if in_flight[-1] in "abcd" else True
        for rid, ref in zip("abcd", refs):
            if rid != in_flight[-1]:
                assert got[rid][0] == ref, rid
        assert_freed(e)


def test_preemption_recomputes_and_keeps_the_tokens(models):
    """A device pool of 5 blocks of 4 tokens for three requests that need 4-8 each, no host
    pool: the latest arrivals are preempted and recomputed."""
    model = models["mistral"]
    refs = [alone(model, p) for p in PROMPTS[:2]] + [alone(model, [7] * 12)]
    with Engine(model, device_blocks=8, host_blocks=0, block_size_tokens=4) as e:
        plans = []
        inner = e.scheduler.schedule
        e.scheduler.schedule = lambda s: plans.append(inner(s)) or plans[-1]
        for rid, p in zip("abc", list(PROMPTS[:2]) + [[7] * 12]):
            e.add_request(rid, p, GREEDY)
        got = drain(e)
        assert any(p.preempted for p in plans)
        assert [got[r][0] for r in "abc"] == refs
        assert_freed(e)


def test_seeded_sampling_repeats_whatever_shares_the_batch(models):
    model = models["llama"]
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=20, seed=1234)
    with Engine(model, host_blocks=64) as e:
        alone_out = e.generate([PROMPTS[0]], seeded)[0].new_token_ids
        crowd = e.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]],
                           [SamplingParams(max_tokens=5, temperature=1.5, seed=7), seeded, GREEDY])
        assert crowd[1].new_token_ids == alone_out
        other = e.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=20, seed=99))
        assert other[0].new_token_ids != alone_out  # a different seed draws differently here


class Letters:
    """A tokenizer whose token i decodes to one letter (chr(97 + i % 26)); encode is the inverse."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)

    def encode(self, text):
        return [ord(c) - 97 for c in text]


def test_stop_strings_cut_the_text_and_finish_with_stop(models):
    model = models["llama"]
    ref = alone(model, PROMPTS[0], 12)
    text = Letters().decode(ref)
    stop = text[5:7]
    cut = text.find(stop)
    with Engine(model, Letters(), host_blocks=64) as e:
        out = e.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, stop=(stop, "zzzzz")))[0]
        assert out.finish_reason == FINISH_STOP
        assert out.new_text == text[:cut]
        assert list(out.new_token_ids) == ref[:cut + len(stop)]
        # streamed pieces join to the same text; the held-back prefix of a stop string is not streamed early
        e.add_request("s", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop=(stop,)))
        pieces = []
        while e.has_unfinished():
            pieces += [o.new_text for o in e.step()]
        assert "".join(pieces) == text[:cut]
        assert_freed(e)


def test_text_prompts_use_the_tokenizer(models):
    model = models["llama"]
    with Engine(model, Letters(), host_blocks=64) as e:
        out = e.generate("hijklmn", SamplingParams(max_tokens=6, temperature=0))[0]
        assert out.prompt_tokens == 7
        assert list(out.new_token_ids) == alone(model, Letters().encode("hijklmn"), 6)


def test_bad_inputs_say_what_would_work(models):
    model = models["llama"]  # context 256
    with Engine(model, host_blocks=8, block_size_tokens=4) as e:  # 32 tokens of KV at most
        for prompt, params, words in [
            ([], GREEDY, "empty"),
            ([1] * 300, GREEDY, "at most 255"),
            ([1] * 250, SamplingParams(max_tokens=10), "at most 6"),
            ([1] * 20, SamplingParams(max_tokens=20), "max_tokens=12"),
            ([1, 5000], GREEDY, "0..159"),
            ("text", GREEDY, "tokenizer"),
            ([[1]], GREEDY, "token ids"),
        ]:
            with pytest.raises(InvalidInputError, match=words):
                e.add_request("x", prompt, params)
        e.add_request("x", [1, 2], GREEDY)
        with pytest.raises(InvalidInputError, match="own id"):
            e.add_request("x", [1, 2], GREEDY)
        with pytest.raises(InvalidInputError, match="non-empty string"):
            e.add_request(7, [1, 2], GREEDY)
        with pytest.raises(InvalidInputError, match="generate\\(\\) runs the engine alone"):
            e.generate([[1, 2]])
        assert not e.abort("never-added")
        drain(e)
        assert_freed(e)
    with pytest.raises(InvalidInputError, match="use one of"):
        Engine.from_pretrained("/nonexistent", cpu_linear_kernel="bogus")  # refused before anything loads
    with pytest.raises(InvalidInputError, match="config.json"):
        Engine.from_pretrained("/nonexistent/folder")
    with pytest.raises(InvalidInputError, match="token_budget"):
        Engine(model, host_blocks=8, token_budget=0)
    with pytest.raises(InvalidInputError, match="no block"):
        Engine(model, host_blocks=0)
    for bad in (0, 257, 10**9, 1.5):  # past the trained positions: refused, not served as garbage
        with pytest.raises(InvalidInputError, match=r"max_model_len=.*give 1\.\.256"):
            Engine(model, host_blocks=8, max_model_len=bad)
    with Engine(model, host_blocks=8, max_model_len=100) as e:
        assert e.max_model_len == 100


@pytest.mark.parametrize("family, words", [("bloom", "AttentionInterface"), ("llama4", "cache's length")])
def test_a_model_the_engine_cannot_batch_is_refused(family, words):
    """Bloom's attention computes in its own forward; Llama 4's no-rope layers take positions from
    the cache's length, which no request of a flattened batch has."""
    model = make_model(family)
    with pytest.raises(UnsupportedModelError, match=words):
        Engine(model, host_blocks=8)
    assert not any(RUNNER in m.__dict__ for m in model.modules())  # left as it was


def test_a_plan_the_engine_cannot_carry_out_is_refused_unchanged(models):
    class Bad:
        def schedule(self, state):
            return IterationPlan(mode=MODE_DEVICE_ONLY, device_decodes=("ghost",))

    with Engine(models["llama"], host_blocks=8, scheduler=Bad()) as e:
        e.add_request("a", [1, 2], GREEDY)
        with pytest.raises(FlexplanError, match="ghost"):
            e.step()

    class Greedy:  # admits every waiting request whole, blocks or not
        def schedule(self, state):
            return IterationPlan(mode=MODE_CPU_ONLY, prefill=tuple((r.request_id, r.prefill_left)
                                                                   for r in state.waiting))

    with Engine(models["llama"], host_blocks=2, block_size_tokens=4, scheduler=Greedy()) as e:
        e.add_request("a", [1] * 4, SamplingParams(max_tokens=4))
        e.add_request("b", [1] * 4, SamplingParams(max_tokens=4))
        e.add_request("c", [1] * 4, SamplingParams(max_tokens=4))
        with pytest.raises(FlexplanError, match="short by"):
            e.step()
        assert len(e.state().waiting) == 3 and e.blocks.usage()[0] == {DEVICE: 0, HOST: 0}  # unchanged


def _rs(rid, *, prompt=8, left=0, ctx=8, out=1, pool=DEVICE, arrival=0):
    return RequestState(rid, prompt, left, ctx, out, 16, pool, arrival)


def test_fcfs_on_numbers_worked_by_hand():
    """Blocks of 4 tokens. Device: 3 free; host: 2 free. "a" decodes at context 8 (a new block:
    8 -> 9 tokens), "b" at context 5 (room in its block): 1 device block reserved, 2 left. "w1"
    waits with 6 prompt tokens (it and its first token: 2 blocks), "w2" with 3. Budget 8: 2
    decodes, then w1's whole prompt into the device pool's 2 blocks; the budget is spent, w2 waits."""
    state = EngineState(
        waiting=(_rs("w1", prompt=6, left=6, ctx=0, out=0, pool=None, arrival=2),
                 _rs("w2", prompt=3, left=3, ctx=0, out=0, pool=None, arrival=3)),
        running=(_rs("a", ctx=8, arrival=0), _rs("b", ctx=5, arrival=1)),
        free_blocks={DEVICE: 3, HOST: 2}, total_blocks={DEVICE: 8, HOST: 2}, block_size_tokens=4,
        token_budget=8, max_running=8, accelerator=True)
    plan = FcfsScheduler().schedule(state)
    assert plan.device_decodes == ("a", "b") and plan.host_decodes == ()
    assert plan.prefill == (("w1", 6),) and plan.prefill_host == ()
    assert plan.mode == MODE_DEVICE_ONLY
    # 1 device block free: "a"'s decode takes it; w1 goes to the host pool (2 blocks hold its 6 + 1 tokens)
    plan = FcfsScheduler().schedule(EngineState(**{**state.__dict__, "free_blocks": {DEVICE: 1, HOST: 2}}))
    assert plan.prefill == (("w1", 6),) and plan.prefill_host == ("w1",) and plan.mode == MODE_ASYMMETRIC
    # no device block free: "b" (the latest device request, 2 blocks) moves to the host pool (2 free)
    plan = FcfsScheduler().schedule(EngineState(**{**state.__dict__, "free_blocks": {DEVICE: 0, HOST: 2}}))
    assert plan.swap_out == ("b",) and plan.device_decodes == ("a",) and plan.host_decodes == ("b",)
    assert plan.prefill == ()  # w1 fits nowhere now: it waits, and w2 behind it
    # ... and with the host pool full too, "b" is preempted instead
    plan = FcfsScheduler().schedule(EngineState(**{**state.__dict__, "free_blocks": {DEVICE: 0, HOST: 1}}))
    assert plan.preempted == ("b",) and plan.swap_out == () and plan.device_decodes == ("a",)
    # a prefill under way keeps the blocks for the rest of its prompt: "p" (4 of 12 tokens in, 2 more
    # blocks) continues by the budget's 8 tokens while w1 waits for room
    p = _rs("p", prompt=12, left=8, ctx=4, out=0, arrival=1)
    plan = FcfsScheduler().schedule(EngineState(**{**state.__dict__, "running": (_rs("a", ctx=8), p),
                                                   "free_blocks": {DEVICE: 3, HOST: 0}}))
    assert plan.device_decodes == ("a",) and plan.prefill == (("p", 7),)


@pytest.mark.slow
@needs_gguf
def test_smollm2_greedy_equals_generate():
    with Engine.from_pretrained(host_blocks=64, token_budget=64) as e:
        ref_model = AutoModelForCausalLM.from_pretrained(default_model_dir(verbose=False), dtype=torch.float32)
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there"]
        ids = [e.tokenizer.encode(p) for p in prompts]
        outs = e.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
        for o, p in zip(outs, ids):
            assert list(o.new_token_ids) == alone(ref_model, p, 12)
            assert o.new_text == e.tokenizer.decode(o.new_token_ids, skip_special_tokens=True)


def wide_kv_model(family: str):
    """make_model's family with 8 query and 4 KV heads of 16 (K/V 64 wide: the native GEMV's block)."""
    return make_model(family, hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=16)


@pytest.mark.parametrize("family", ["llama", "mistral_sw", "qwen2", "llama3", "qwen3"])
def test_native_layer_calls_keep_the_tokens(family):
    """A covered model with blocked weights (as Engine.from_pretrained packs them) runs each
    iteration in flexplan's native layer calls (fused_step): its greedy tokens equal generate()'s
    on the dense model, through chunked prefill, both pools and an abort (Qwen3: its QK-norm in
    the native pre-attention call); a model it does not cover runs transformers' forward and is
    not counted."""
    import copy

    from flexplan.executor import cpu_linear

    if not (native.decode_status()[0] and cpu_linear.blocking_available()):
        pytest.skip("no native kernels here (no C compiler)")
    model = wide_kv_model(family)
    refs = [alone(model, p) for p in PROMPTS]
    packed = copy.deepcopy(model)
    cpu_linear.pack_module(packed, None, cpu_linear.KERNEL_BLOCKED)
    # both pools (per-layer calls: two attention groups), then the host pool alone (a decode-only
    # iteration of one pool: one native call for all the layers, where no layer slides)
    for device_blocks, host_blocks in ((6, 64), (0, 64)):
        with Engine(packed, device_blocks=device_blocks, host_blocks=host_blocks, block_size_tokens=4,
                    token_budget=16) as e:
            assert e.runner.fused is not None
            e.add_request("doomed", PROMPTS[2], GREEDY)
            got = drain(e, steps=2)
            assert e.abort("doomed")
            for rid, p in zip("abcd", PROMPTS):
                e.add_request(rid, p, GREEDY)
            drain(e, got)
            for rid, ref in zip("abcd", refs):
                assert got[rid][0] == ref, (rid, device_blocks)
            assert e.runner.fused.iterations > 0
            if device_blocks == 0 and not any(e.runner.fused.windows):
                assert e.runner.fused.stack_iterations > 0
            assert_freed(e)


def test_native_layer_calls_only_where_they_cover():
    from flexplan.executor import cpu_linear

    if not (native.decode_status()[0] and cpu_linear.blocking_available()):
        pytest.skip("no native kernels here (no C compiler)")
    for family in ("gemma2", "gpt_oss"):
        with Engine(make_model(family), device_blocks=8, host_blocks=8, block_size_tokens=4) as e:
            assert e.runner.fused is None, family
    with Engine(make_model("llama"), device_blocks=8, host_blocks=8, block_size_tokens=4) as e:
        e.generate([PROMPTS[0]], GREEDY)  # dense weights: covered, but the native GEMV reads blocked ones only
        assert e.runner.fused.iterations == 0
