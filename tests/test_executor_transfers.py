"""The stand-in's transfer log: prefetch order, bytes moved per step, what crosses at the switch."""

from __future__ import annotations

import pytest
import torch

import flexplan.api as api
from flexplan.executor.link import D2H, H2D
from flexplan.executor.plans import fixed_plan

from conftest import left_padded_batch

GIB = 1 << 30
NEW = 5
LENGTHS = (7, 4, 9)  # batch 3, padded width 9


def run(fresh, family, prefill, decode, gpu_layers=2):
    model, ref = fresh(family)
    ids, mask = left_padded_batch(LENGTHS)
    plan = fixed_plan(model.config, prefill, decode, gpu_layers, batch_size=3, input_len=9, output_len=NEW,
                      gpu_memory_bytes=GIB)
    lm = api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=GIB)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    return lm


def param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def kv_bytes(config, tokens, batch=3) -> int:
    kv_dim = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    return 2 * batch * tokens * kv_dim * 4


def steps(lm, phase):
    return sorted({t for what, t in lm.executor.link.order if what == phase})


def order_in_step(lm, step):
    order, out, inside = lm.executor.link.order, [], False
    for what, x in order:
        if what in ("prefill", "decode"):
            inside = x == step
        elif inside:
            out.append((what, x))
    return out


def test_gpu_offload_prefetches_next_layer_before_current_ends(fresh):
    lm = run(fresh, "llama", "gpu-offload", "gpu-offload")
    n = lm.config.num_hidden_layers
    for step in steps(lm, "prefill") + steps(lm, "decode"):
        order = order_in_step(lm, step)
        assert [x for w, x in order if w == "prefetch"] == list(range(n))
        for i in range(n):
            assert order.index(("prefetch", i)) < order.index(("compute", i))
            if i + 1 < n:  # layer i+1 is on its way while layer i computes
                assert order.index(("prefetch", i + 1)) < order.index(("computed", i))
                assert order.index(("prefetch", i + 1)) > order.index(("prefetch", i))


def test_gpu_offload_decode_step_moves_weights_and_kv(fresh):
    lm = run(fresh, "mistral", "gpu-offload", "gpu-offload")
    link, cfg = lm.executor.link, lm.config
    layers = lm.model.model.layers
    weights = sum(param_bytes(layer) for layer in layers)
    for k, step in enumerate(steps(lm, "decode")):
        past = 9 + k  # tokens already in the cache when this step starts
        assert link.bytes_moved(H2D, step=step, kind="weights") == weights
        assert link.bytes_moved(H2D, step=step, kind="kv") == len(layers) * kv_bytes(cfg, past)
        assert link.bytes_moved(D2H, step=step, kind="kv") == len(layers) * kv_bytes(cfg, 1)  # only the new token
        assert link.bytes_moved(H2D, step=step, kind="hidden") == 3 * cfg.hidden_size * 4
    assert link.bytes_moved(H2D, phase="prefill", kind="kv") == 0  # empty past
    assert link.bytes_moved(D2H, phase="prefill", kind="kv") == len(layers) * kv_bytes(cfg, 9)
    stats = lm.last_stats
    assert stats.decode.h2d_bytes == link.bytes_moved(H2D, phase="decode") > (NEW - 1) * weights
    assert stats.decode.link_bandwidth_bytes_per_s > 0 and stats.decode.flops_per_s > 0


def test_partial_streams_only_the_first_layers(fresh):
    lm = run(fresh, "qwen2", "gpu-offload-partial", "gpu-offload-partial", gpu_layers=1)
    link = lm.executor.link
    layers = lm.model.model.layers
    for step in steps(lm, "decode"):
        assert link.bytes_moved(H2D, step=step, kind="weights") == sum(param_bytes(layers[i]) for i in range(3))
        assert {t.layer for t in link.transfers if t.step == step and t.kind in ("weights", "kv")} == {0, 1, 2}


def test_splitgen_decode_moves_only_hidden_states(fresh):
    lm = run(fresh, "opt", "splitgen", "splitgen")
    link, cfg = lm.executor.link, lm.config
    for step in steps(lm, "decode"):
        kinds = {t.kind for t in link.transfers if t.step == step and t.direction == H2D}
        assert kinds <= {"hidden", "aux"}  # aux: this step's position ids / mask for the GPU layers
        assert link.bytes_moved(H2D, step=step, kind="hidden") == 3 * cfg.hidden_size * 4  # one transfer
        assert [t.layer for t in link.transfers if t.step == step and t.kind == "hidden"] == [2]
        assert link.bytes_moved(D2H, step=step) == link.bytes_moved(D2H, step=step, kind="logits") == 3 * cfg.vocab_size * 4
    assert link.bytes_moved(H2D, kind="weights") == 0 and link.bytes_moved(H2D, kind="kv") == 0


def test_switch_offload_prefill_to_splitgen_keeps_last_layers_resident(fresh):
    """FlexInfer 5.3 scenario 1: prefill streams, decode splitgen. The last M layers are stored
    on the accelerator from the start (never streamed) with their KV; the rest go to the host."""
    lm = run(fresh, "llama", "gpu-offload", "splitgen", gpu_layers=2)
    link, ex = lm.executor.link, lm.executor
    assert {t.layer for t in link.transfers if t.kind == "weights"} == {0, 1}
    assert {t.layer for t in link.transfers if t.kind == "kv" and t.direction == D2H and t.phase == "prefill"} == {0, 1}
    assert link.bytes_moved(H2D, kind="kv-switch") == link.bytes_moved(D2H, kind="kv-switch") == 0
    assert set(ex.layers[3].storages) == {"accelerator"}
    assert set(ex.layers[0].storages) == {"pinned"}  # fp32 both sides: one pinned copy streams and computes
    for step in steps(lm, "decode"):
        assert link.bytes_moved(H2D, step=step, kind="weights") == 0


@pytest.mark.parametrize("prefill,decode,direction", [("gpu", "cpu", D2H), ("cpu", "gpu", H2D), ("gpu", "gpu-offload", D2H)])
def test_switch_moves_prompt_kv_once(fresh, prefill, decode, direction):
    lm = run(fresh, "llama", prefill, decode)
    link, cfg = lm.executor.link, lm.config
    n = cfg.num_hidden_layers
    assert link.bytes_moved(direction, kind="kv-switch") == n * kv_bytes(cfg, 9)
    assert lm.last_stats.switch_bytes == n * kv_bytes(cfg, 9)
    if decode == "cpu":
        assert link.bytes_moved(H2D, phase="decode") == 0


def test_cpu_policy_moves_nothing(fresh):
    lm = run(fresh, "qwen2", "cpu", "cpu")
    assert lm.executor.link.transfers == []
    assert lm.last_stats.accelerator == "none" or lm.last_stats.h2d_bytes == 0
