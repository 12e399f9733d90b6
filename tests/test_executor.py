"""Executor equivalence: the same tokens as plain transformers for every policy pair and family."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import TextStreamer

import flexplan.api as api
from flexplan.executor.link import H2D
from flexplan.executor.plans import fixed_plan
from flexplan.estimator.policies import POLICIES

from conftest import FAMILIES, MORE_FAMILIES, WINDOW, left_padded_batch, make_model

GIB = 1 << 30
NEW = 6


def load_fixed(model, prefill, decode, gpu_layers=2, batch=3, input_len=9, output_len=NEW, **kw):
    plan = fixed_plan(model.config, prefill, decode, gpu_layers, batch_size=batch, input_len=input_len,
                      output_len=output_len, gpu_memory_bytes=GIB)
    return api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=GIB, **kw)


# every policy once as prefill and once as decode, each pair mixing places (9 of the 81 pairs)
ROTATED_PAIRS = [(p, POLICIES[(i + 2) % len(POLICIES)]) for i, p in enumerate(POLICIES)]
ALL_PAIRS = list(itertools.product(POLICIES, POLICIES))
# families whose whole matrix runs: Llama-like (fused decode), sliding everywhere, mixed local/global, MoE
FULL_MATRIX = ("llama3", "mistral_sw", "gemma3", "gpt_oss")
_EXPECTED = {}


def _case(*values, fast: bool, id: str):
    """One case of a big family of equivalence tests: the default run keeps a representative few
    (every policy as prefill and as decode, every family), the rest is marked slow."""
    return pytest.param(*values, id=id, marks=() if fast else pytest.mark.slow)


def expected_tokens(ref, family):
    """transformers' greedy tokens of the family's untouched model on the left-padded batch (once per family)."""
    if family not in _EXPECTED:
        ids, mask = left_padded_batch()
        _EXPECTED[family] = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    return _EXPECTED[family]


def _turn(k: int, n: int) -> list[tuple[str, str]]:
    """The k-th family's n rotated pairs, in turn: over the families every pair comes up."""
    return [ROTATED_PAIRS[(n * k + j) % len(ROTATED_PAIRS)] for j in range(n)]


# the default run: every rotated pair on Llama, three of them (in turn) on each other family
@pytest.mark.parametrize("prefill,decode,family", [
    _case(prefill, decode, family, fast=(prefill, decode) in (ROTATED_PAIRS if k == 0 else _turn(k, 3)),
          id=f"{prefill}-{decode}-{family}")
    for prefill, decode in ALL_PAIRS for k, family in enumerate(FAMILIES)])
def test_greedy_tokens_identical(fresh, family, prefill, decode):
    model, ref = fresh(family)
    ids, mask = left_padded_batch()
    expected = expected_tokens(ref, family)
    lm = load_fixed(model, prefill, decode)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    assert lm.last_stats.new_tokens == NEW
    assert lm.plan.prefill.policy == prefill and lm.plan.decode.policy == decode


def _more_cases():
    for k, family in enumerate(MORE_FAMILIES):
        pairs = ALL_PAIRS if family in FULL_MATRIX else ROTATED_PAIRS
        fast = _turn(k, 3 if family in FULL_MATRIX else 2)  # the default run: 2-3 pairs a family, in turn
        for prefill, decode in pairs:
            yield _case(family, prefill, decode, fast=(prefill, decode) in fast, id=f"{family}-{prefill}-{decode}")


@pytest.mark.parametrize("family,prefill,decode", list(_more_cases()))
def test_greedy_tokens_identical_any_family(fresh, family, prefill, decode):
    """Any decoder-only causal LM of transformers, found through its own accessors: the same
    tokens as transformers' generate, batched and left-padded, with windows (4 tokens) shorter
    than the sequence (9 + 6)."""
    model, ref = fresh(family)
    ids, mask = left_padded_batch()
    expected = expected_tokens(ref, family)
    lm = load_fixed(model, prefill, decode, gpu_layers=1)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    assert lm.plan.prefill.policy == prefill and lm.plan.decode.policy == decode


def test_parts_windows_and_fused_layers_found_per_family(fresh):
    """What the executor found: OPT's and Falcon's stacks, sliding layers, the fused path only
    on layers it covers (Llama-like), the latent KV cache of DeepSeek V3's MLA."""
    found = {}
    for family in ("opt350", "falcon", "gemma3", "llama3", "qwen3_moe", "mixtral", "granite", "deepseek_v3"):
        model, _ = fresh(family)
        ex = load_fixed(model, "cpu", "cpu").executor
        found[family] = ex
    opt, falcon = found["opt350"].parts, found["falcon"].parts
    assert set(opt.embedding) == {"model.decoder.embed_tokens", "model.decoder.embed_positions", "model.decoder.project_in"}
    assert list(opt.head) == ["model.decoder.project_out", "lm_head"]
    assert falcon.layers_prefix == "transformer.h" and list(falcon.head) == ["transformer.ln_f", "lm_head"]
    assert found["gemma3"].windows == [WINDOW, WINDOW, None]
    assert found["llama3"].fused_layers == [0, 1] and found["llama3"].native_stack_steps == 0
    assert found["mixtral"].fused_layers == [] and found["mixtral"].native_attention == {0, 1}  # MoE: attention only
    assert found["qwen3_moe"].fused_layers == [] and found["qwen3_moe"].native_attention == {0, 1}  # QK-norm too
    assert found["granite"].fused_layers == []  # its layers scale the residual: not Llama's forward
    assert tuple(found["deepseek_v3"].kv_geometry[0]) == (1, 16, 1, 8)


def test_layer_windows_under_both_cache_kwargs_forms(monkeypatch):
    """transformers 5.24 gives cache kwargs per layer; 5.17 (the H200 machine's) one dict for all
    layers, whose sliding_window belongs to the windowed layer types only."""
    import transformers.cache_utils as cu

    from flexplan.executor.families import layer_windows

    config = make_model("gemma3").config
    expected = [WINDOW, WINDOW, None]
    assert layer_windows(config) == expected
    types = ["sliding_attention", "sliding_attention", "full_attention"]
    monkeypatch.setattr(cu, "get_layer_types_and_kwargs", lambda c: (types, {"sliding_window": WINDOW}))
    assert layer_windows(config) == expected
    monkeypatch.setattr(cu, "get_layer_types_and_kwargs",
                        lambda c: (["chunked_attention", "full_attention"], {"sliding_window": 8}))
    assert layer_windows(config) == [8, None]


def test_sliding_layers_hand_attention_the_window(fresh):
    """A sliding layer keeps the whole context but returns, and reports mask sizes for, only
    what DynamicSlidingWindowLayer would; its prefetch copies stop at the window."""
    model, ref = fresh("mistral_sw")
    ids, mask = left_padded_batch()
    lm = load_fixed(model, "gpu-offload", "gpu-offload")
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    kv = lm.executor._cache.layers[0]
    assert kv.is_sliding and kv.get_max_length() == WINDOW and kv.length == 9 + NEW - 1
    assert kv.get_mask_sizes(1) == (WINDOW, kv.length - WINDOW + 1)
    per_token = 3 * 2 * 16 * 4  # one of K, V: batch 3 x 2 KV heads x 16 dims x fp32
    prefetched = [t.nbytes for t in lm.executor.link.transfers if t.kind == "kv" and t.direction == H2D and t.layer == 0]
    assert max(prefetched) == (WINDOW - 1) * per_token


@pytest.mark.parametrize("guess", [(1, 8, 1, 8), (4, 32, 4, 32)])
@pytest.mark.parametrize("prefill,decode", [("gpu-offload", "gpu-offload-partial"), ("splitgen", "gpu")])
def test_kv_geometry_the_config_got_wrong_is_corrected_at_the_first_update(fresh, monkeypatch, guess, prefill,
                                                                          decode):
    """A cache layout the config does not describe (too small: buffers reallocated, slots too;
    too large: viewed with the real shapes) still gives transformers' tokens, and the next
    request is sized from what the model really stored."""
    import flexplan.executor.runner as runner
    from flexplan.executor.kv_cache import KVGeometry

    monkeypatch.setattr(runner, "kv_geometry", lambda config, spec=None: KVGeometry(*guess))
    model, ref = fresh("llama3")
    ids, mask = left_padded_batch()
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    lm = load_fixed(model, prefill, decode, gpu_layers=1)
    for _ in range(2):
        assert torch.equal(lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False),
                           expected)
    assert [tuple(g) for g in lm.executor.kv_geometry] == [(2, 16, 2, 16)] * 2


@pytest.mark.parametrize("family,what", [("mamba", "linear_attention"), ("t5", "encoder-decoder"),
                                         ("qwen3_next", "linear_attention"), ("rwkv", "RWKV")])
def test_non_layerwise_models_refused_in_one_line(family, what):
    import transformers

    from flexplan.errors import UnsupportedModelError
    from flexplan.executor.families import check_supported

    config = transformers.AutoConfig.for_model(family)
    with pytest.raises(UnsupportedModelError) as e:
        check_supported(config)
    assert what in str(e.value) and "\n" not in str(e.value) and repr(family) in str(e.value)


def test_model_without_kv_cache_refused_and_odd_get_decoder_found(fresh):
    """GPT-1 keeps no KV cache: refused in one line. ModernBERT-decoder's get_decoder() answers
    its LM head: the stack is found by its layer list instead, and runs."""
    import transformers

    from flexplan.errors import UnsupportedModelError

    gpt1 = transformers.OpenAIGPTLMHeadModel(transformers.OpenAIGPTConfig(
        n_embd=32, n_layer=2, n_head=2, vocab_size=160, n_positions=64)).eval()
    with pytest.raises(UnsupportedModelError, match="'openai-gpt' keeps no KV cache"):
        api.load(gpt1, plan={"prefill": "cpu", "decode": "cpu"}, accelerator="cpu", gpu_memory_bytes=GIB)
    config = transformers.ModernBertDecoderConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, vocab_size=160, pad_token_id=0,
                                                  local_attention=4, global_attn_every_n_layers=2)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids, mask = left_padded_batch()
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    import copy

    lm = load_fixed(copy.deepcopy(ref), "gpu-offload", "splitgen", gpu_layers=1)
    assert lm.executor.parts.layers_prefix == "model.layers"
    assert torch.equal(lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False), expected)


def test_tiny_mamba_refused_at_load_before_allocation():
    import transformers

    from flexplan.errors import UnsupportedModelError

    model = transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=160, hidden_size=32, state_size=4, num_hidden_layers=2)).eval()
    with pytest.raises(UnsupportedModelError, match="'mamba' has linear_attention layers"):
        api.load(model, plan={"prefill": "cpu", "decode": "cpu"}, accelerator="cpu", gpu_memory_bytes=GIB)


@pytest.mark.parametrize("prefill,decode", [("gpu-offload", "splitgen"), ("cpu", "gpu"), ("gpu", "cpu")])
def test_sampling_with_seed_matches_transformers(fresh, prefill, decode):
    model, ref = fresh("qwen2")
    ids, mask = left_padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=20, top_p=0.9,
              temperature=0.8)
    torch.manual_seed(123)
    expected = ref.generate(**kw)
    lm = load_fixed(model, prefill, decode)
    torch.manual_seed(123)
    assert torch.equal(lm.generate(**kw), expected)


def test_streamer_and_dict_output(fresh, capsys):
    class Tok:  # the least a TextStreamer needs
        def decode(self, ids, **kw):
            return " ".join(str(int(i)) for i in ids)

    model, ref = fresh("llama")
    ids, mask = left_padded_batch(lengths=(5,))
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    lm = load_fixed(model, "splitgen", "gpu-offload-partial", batch=1, input_len=5)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                      streamer=TextStreamer(Tok(), skip_prompt=True), return_dict_in_generate=True, output_scores=True)
    assert torch.equal(out.sequences, expected)
    assert len(out.scores) == NEW
    printed = capsys.readouterr().out.split()
    assert printed == [str(int(t)) for t in expected[0, 5:]]


def test_eos_stops_generation(fresh):
    model, ref = fresh("opt")
    ids, mask = left_padded_batch(lengths=(6,))
    free = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    eos = int(free[0, 6 + 2])  # make the third new token the end of sequence
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    lm = load_fixed(model, "gpu-offload", "cpu", batch=1, input_len=6)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    assert torch.equal(out, expected)
    assert out.shape[1] <= 6 + 3
    assert lm.last_stats.new_tokens == out.shape[1] - 6


def test_beam_search_matches_transformers(fresh):
    model, ref = fresh("mistral")
    ids, mask = left_padded_batch(lengths=(5, 3))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, num_beams=2)
    expected = ref.generate(**kw)
    lm = load_fixed(model, "gpu-offload", "splitgen", batch=4, input_len=5, output_len=4)
    assert torch.equal(lm.generate(**kw), expected)


def test_plan_overrides_dict_and_cpu_dtype_conversion(fresh):
    """bf16 on the (stand-in) accelerator, fp32 on the CPU: the KV cache is converted at the
    switch and the result stays close to the fp32 reference."""
    model, ref = fresh("llama")
    ids, mask = left_padded_batch()
    plan = fixed_plan(model.config, "gpu", "splitgen", 2, dtype="bfloat16", cpu_dtype="float32",
                      batch_size=3, input_len=9, output_len=3, gpu_memory_bytes=GIB)
    lm = api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=GIB)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                      return_dict_in_generate=True, output_logits=True)
    ref_out = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                           return_dict_in_generate=True, output_logits=True)
    torch.testing.assert_close(out.logits[0], ref_out.logits[0], atol=0.5, rtol=0.05)
    stores = {i: {p: st.layout.dtype for p, st in lm.executor.layers[i].storages.items()} for i in (0, 3)}
    assert stores[0] == {"host": torch.float32, "accelerator": torch.bfloat16}  # CPU copy in fp32 for decode
    assert stores[3] == {"accelerator": torch.bfloat16}
    switched = [t for t in lm.executor.link.transfers if t.kind == "kv-switch"]
    assert {t.layer for t in switched} == {0, 1}  # the CPU's layers' KV left the accelerator


def test_dict_overrides_and_user_model_generate(fresh):
    model, ref = fresh("llama")
    ids, mask = left_padded_batch()
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    lm = api.load(model, plan={"prefill": "gpu-offload", "decode": "splitgen", "gpu_layers": 1,
                               "dtype": "float32", "cpu_dtype": "float32"}, accelerator="cpu", gpu_memory_bytes=GIB)
    assert (lm.plan.prefill.policy, lm.plan.decode.policy, lm.plan.decode.gpu_layers) == ("gpu-offload", "splitgen", 1)
    assert torch.equal(lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False), expected)
    # a direct model.generate() (transformers' own DynamicCache) still runs correctly under the plan
    assert torch.equal(lm.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False),
                       expected)


def test_auto_plans_per_request_shape(fresh):
    model, ref = fresh("qwen2")
    weights = sum(p.numel() * 4 for p in model.parameters())
    lm = api.load(model, plan={"cpu_dtype": "float32"}, accelerator="cpu", dtype="float32",
                  gpu_memory_bytes=weights // 2)
    for lengths, new in (((7, 4, 9), 6), ((20,), 3), ((7, 4, 9), 6)):
        ids, mask = left_padded_batch(lengths)
        out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        assert torch.equal(out, ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False))
        p = lm.last_stats.plan
        assert (p.batch_size, p.input_len, p.output_len) == (len(lengths), max(lengths), new)
        assert lm.executor.plan is p and p.cpu_dtype == "float32"
        assert lm.last_stats.predicted_ttft_s > 0 and lm.last_stats.ttft_s > 0 and lm.last_stats.tpot_s > 0
    assert len(lm._plans) == 2  # planned once per shape


@pytest.mark.parametrize("prefill,decode", [_case(p, d, fast=(p, d) in ROTATED_PAIRS, id=f"{p}-{d}")
                                            for p, d in ALL_PAIRS])
def test_bf16_accelerator_fp32_cpu_every_pair(fresh, prefill, decode):
    """Weights and KV converted between the accelerator dtype and the CPU dtype on every path
    (pinned <-> host conversions, the switch): logits stay within bf16 error of fp32."""
    for a, b in _bf16_accelerator_logits(fresh, "mistral", prefill, decode, gpu_layers=2):
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)


def _bf16_accelerator_logits(fresh, family, prefill, decode, gpu_layers):
    """(flexplan, transformers) logits of 3 greedy steps, flexplan with a bf16 accelerator and an fp32 CPU."""
    model, ref = fresh(family)
    ids, mask = left_padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
              output_logits=True)
    expected = ref.generate(**kw)
    plan = fixed_plan(model.config, prefill, decode, gpu_layers, dtype="bfloat16", cpu_dtype="float32", batch_size=3,
                      input_len=9, output_len=3)
    out = api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=GIB).generate(**kw)
    return zip(out.logits, expected.logits)


@pytest.mark.parametrize("family,prefill,decode", [("gemma3", "gpu", "splitgen"), ("mixtral", "gpu-offload", "cpu"),
                                                   ("deepseek_v3", "cpu", "gpu-offload-partial"),
                                                   ("gpt2", "gpu-offload", "splitgen")])
def test_bf16_accelerator_fp32_cpu_any_family(fresh, family, prefill, decode):
    """Sliding layers, 3-D expert weights, MLA's latent cache and Conv1D projections converted
    between the accelerator's bf16 and the CPU's fp32 (weights, KV at the switch and in streaming)."""
    for a, b in _bf16_accelerator_logits(fresh, family, prefill, decode, gpu_layers=1):
        torch.testing.assert_close(a, b, atol=0.1 * float(b.abs().max()), rtol=0.05)
