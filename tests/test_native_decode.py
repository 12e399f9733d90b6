"""flexplan's fused CPU decode ops (native_decode.c, flexplan/executor/cpu_decode.py) against PyTorch and transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexplan.executor import cpu_decode, native

needs_decode = pytest.mark.skipif(native.decode_status()[0] is None, reason=f"{native.decode_status()[1]}")


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).abs().max() / ref.double().abs().max())


@needs_decode
@pytest.mark.parametrize("rows,n", [(1, 64), (3, 40), (9, 576)])
def test_rmsnorm_matches_llama_formula(rows, n):
    ops = native.decode_status()[0]
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(rows, n, generator=g), torch.randn(n, generator=g)
    ref = w.double() * (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6))
    assert _rel(ops.rmsnorm(x, w, 1e-6), ref) < 1e-6


@needs_decode
@pytest.mark.parametrize("d", [8, 64, 80])
def test_rope_matches_rotate_half(d):
    ops = native.decode_status()[0]
    g = torch.Generator().manual_seed(d)
    x, cos, sin = torch.randn(3, 5, d, generator=g), torch.randn(3, d, generator=g), torch.randn(3, d, generator=g)
    rot = torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)
    ref = x * cos[:, None] + rot * sin[:, None]
    ops.rope_(x, cos, sin)
    assert _rel(x, ref) < 1e-6


@needs_decode
@pytest.mark.parametrize("keys", [1, 31, 32, 33, 100])
@pytest.mark.parametrize("d,hq,hk", [(64, 8, 2), (24, 4, 4), (128, 4, 1)])
def test_decode_attention_matches_sdpa_on_a_strided_cache(keys, d, hq, hk):
    """One query per sequence, grouped heads, a padding mask, keys read through the strides of a
    [capacity, batch, heads, d] cache view (flexplan's KV layout) across chunk boundaries."""
    ops = native.decode_status()[0]
    g = torch.Generator().manual_seed(keys * d)
    b, cap = 3, keys + 5
    kbuf, vbuf = torch.randn(cap, b, hk, d, generator=g), torch.randn(cap, b, hk, d, generator=g)
    k, v = kbuf[:keys].permute(1, 2, 0, 3), vbuf[:keys].permute(1, 2, 0, 3)
    q = torch.randn(b, hq, d, generator=g)
    mask = torch.ones(b, keys, dtype=torch.bool)
    mask[1, : keys // 2] = False  # a left-padded row
    ref = F.scaled_dot_product_attention(q[:, :, None].double(), k.double(), v.double(),
                                         attn_mask=mask[:, None, None], scale=0.2, enable_gqa=hq != hk)[:, :, 0]
    assert _rel(ops.decode_attention(q, k, v, mask, 0.2), ref) < 1e-5
    ref = F.scaled_dot_product_attention(q[:, :, None].double(), k.double(), v.double(), scale=0.2,
                                         enable_gqa=hq != hk)[:, :, 0]
    assert _rel(ops.decode_attention(q, k, v, None, 0.2), ref) < 1e-5


@needs_decode
def test_fully_masked_row_gives_zeros_not_nan():
    ops = native.decode_status()[0]
    k = v = torch.randn(1, 1, 40, 16)
    out = ops.decode_attention(torch.randn(1, 2, 16), k, v, torch.zeros(1, 40, dtype=torch.bool), 0.25)
    assert torch.equal(out, torch.zeros_like(out))


def _wide_model(family: str, **overrides):
    """Widths the blocked kernel takes (every linear's out a multiple of 64), head_dim 64."""
    import transformers

    cfg = dict(vocab_size=192, hidden_size=256, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen3":
        cfg["head_dim"] = 64  # its QK-norm per head
    config = {"qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig,
              "qwen3": transformers.Qwen3Config}.get(family, transformers.LlamaConfig)(**cfg, **overrides)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif p.dim() == 1 and family in ("qwen2", "qwen3"):
                p.add_(0.1 * torch.randn_like(p))  # biases and QK-norms that matter
    return model


def _counted(monkeypatch, ops, name: str) -> list:
    calls = []
    fn = getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *a, **k: (calls.append(1), fn(*a, **k))[1])
    return calls


def test_rotary_rows_kept_per_position_are_the_modules_own():
    stack = _wide_model("llama").model
    rot = stack.rotary_emb
    rows, x = cpu_decode.RotaryRows(stack), torch.zeros(1, 1, 256)

    def module(pos):
        return tuple(t.reshape(1, 64) for t in rot(x, torch.full((1, 1), pos)))

    for pos in (0, 5, 5, 127):
        assert all(torch.equal(a, b) for a, b in zip(rows(x, pos, 1, 64), module(pos)))
    assert sorted(rows.rows) == [0, 5, 127]
    cos3, sin3 = rows(x, 5, 3, 64)  # a batch at one position: the row for each
    assert cos3.shape == (3, 64) and all(torch.equal(r, module(5)[0][0]) for r in cos3)
    with torch.no_grad():  # new frequencies: what was kept is dropped
        rot.inv_freq.mul_(2.0)
    assert torch.equal(rows(x, 5, 1, 64)[0], module(5)[0]) and list(rows.rows) == [5]
    dynamic = _wide_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    rows = cpu_decode.RotaryRows(dynamic.model)  # its frequencies follow the length: never kept
    assert rows(x, 3, 1, 64) is not None and rows.rows == {} and not rows.static

    class Shifted(type(rot)):  # a forward of its own (here: one position on): never kept
        def forward(self, x, position_ids):
            return super().forward(x, position_ids + 1)

    stack.rotary_emb = shifted = Shifted(stack.config)
    rows = cpu_decode.RotaryRows(stack)
    want = shifted(x, torch.full((1, 1), 3))[0].reshape(1, 64)
    assert torch.equal(rows(x, 3, 1, 64)[0], want) and rows.rows == {} and not rows.static


@needs_decode
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("path", ["stack", "layer"])
def test_fused_decode_runs_every_step_and_matches_transformers(family, path, one_thread, monkeypatch):
    """The whole-stack native step (one call per decode step), or without it the whole-layer one
    (one call per layer and step), runs every decode step (counted); greedy tokens of a
    left-padded batch equal transformers' own and logits agree to float32 precision."""
    import copy

    from conftest import left_padded_batch

    from flexplan import api

    if not native.available():
        pytest.skip(native.status()[1])
    ref = _wide_model(family)
    ops = native.decode_status()[0]
    stack_calls, layer_calls = _counted(monkeypatch, ops, "decode_stack"), _counted(monkeypatch, ops,
                                                                                    "layer_post_attention")
    lm = api.load(copy.deepcopy(ref), plan={"prefill": "cpu", "decode": "cpu", "cpu_dtype": "float32"},
                  accelerator="cpu", dtype="float32")
    assert lm.executor.backend.linear_kernel == "flexplan-blocked"
    if path == "layer":
        monkeypatch.setattr(lm.executor, "_cpu_step_ready", lambda st: False)
    ids, mask = left_padded_batch((7, 4, 9))
    ids = ids % 192
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    ours, theirs = lm.generate(**kw), ref.generate(**kw)
    assert torch.equal(ours.sequences, theirs.sequences)
    if path == "stack":
        assert (len(stack_calls), len(layer_calls)) == (5, 0)  # 5 decode steps, each one call
        assert lm.last_stats.native_stack_steps == 5 and "5 by the native decode stack" in lm.last_stats.summary()
    else:
        assert (len(stack_calls), len(layer_calls)) == (0, 2 * 5)  # 2 layers x 5 decode steps
    for a, b in zip(ours.scores, theirs.scores):
        assert _rel(a, b) < 1e-4
    assert "native fused" in lm.last_stats.cpu_decode_ops


@needs_decode
def test_native_stack_looks_up_embeddings_and_norms_and_leaves_a_bad_id_to_the_embedding(one_thread):
    """The step's embedding rows and final norm computed in the native call equal the modules'; an
    id with no row leaves the cache as it was and gets the embedding's own IndexError."""
    import copy

    from flexplan import api
    from flexplan.executor.families import CACHE_KWARG

    ref = _wide_model("llama")
    lm = api.load(copy.deepcopy(ref), plan={"prefill": "cpu", "decode": "cpu", "cpu_dtype": "float32"},
                  accelerator="cpu", dtype="float32")
    stack = lm.executor._stack
    looked_up = []  # the embedding module's own calls (the native call runs no hooks)
    lm.model.model.embed_tokens.register_forward_hook(lambda *a: looked_up.append(1))
    cache = lm.executor.new_cache(1, 16, 4)
    with torch.no_grad():
        lm.model(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=True, **{CACHE_KWARG: cache})
        steps = stack.steps
        with pytest.raises(IndexError):
            lm.model(input_ids=torch.tensor([[192]]), use_cache=True, **{CACHE_KWARG: cache})
        assert stack.steps == steps and all(kv.length == 4 for kv in cache.layers)
        ours = lm.model(input_ids=torch.tensor([[9]]), use_cache=True, **{CACHE_KWARG: cache}).logits
        assert stack.steps == steps + 1 and len(looked_up) == 1  # the prefill's
        theirs = ref(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).logits[:, -1:]
    assert _rel(ours, theirs) < 1e-4


@needs_decode
def test_native_stack_checks_its_layers_once_until_a_parameter_is_rebound(one_thread, monkeypatch):
    """The per-layer checks (each layer's tensors, each cache's buffers) run at a generate's first
    native step and again only after a parameter was pointed elsewhere (weights.set_param counts
    it): a weight rebound between two steps of one generate is read from the next step on."""
    import copy

    from transformers import LogitsProcessor, LogitsProcessorList

    from flexplan import api
    from flexplan.executor.weights import set_param

    class AtStep(LogitsProcessor):
        def __init__(self, fn, step):
            self.fn, self.step, self.calls = fn, step, 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == self.step:
                self.fn()
            return scores

    if not native.available():
        pytest.skip(native.status()[1])
    ref = _wide_model("llama")
    lm = api.load(copy.deepcopy(ref), plan={"prefill": "cpu", "decode": "cpu", "cpu_dtype": "float32"},
                  accelerator="cpu", dtype="float32")
    stack, fills = lm.executor._stack, []
    fill = cpu_decode.FusedLayer._fill
    monkeypatch.setattr(cpu_decode.FusedLayer, "_fill", lambda self: (fills.append(1), fill(self))[1])
    ids = torch.tensor([[5, 9, 14, 3]])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(lm.generate(ids, **kw), ref.generate(ids, **kw))
    assert stack.steps == 7 and len(fills) == 2  # 2 layers, checked at the first of 7 native steps
    # after the third token, layer 0's down projection negated: in the reference in place, in the
    # executor's copy by pointing the parameter at a negated tensor (the old one's memory let go)
    down = lm.model.model.layers[0].mlp.down_proj
    flip_ours = AtStep(lambda: set_param(down, "weight", down.weight.detach().neg()), 3)
    flip_ref = AtStep(lambda: ref.model.layers[0].mlp.down_proj.weight.data.mul_(-1.0), 3)
    fills.clear()
    ours = lm.generate(ids, logits_processor=LogitsProcessorList([flip_ours]), **kw)
    theirs = ref.generate(ids, logits_processor=LogitsProcessorList([flip_ref]), **kw)
    assert torch.equal(ours, theirs) and len(fills) == 4  # checked again after the rebinding
    flip_ref.fn()  # the reference as it was, for the unflipped tokens' check below
    unflipped = ref.generate(ids, **kw)
    assert not torch.equal(theirs, unflipped)  # the flip changed the tokens: reading it is what the test sees


@needs_decode
@pytest.mark.parametrize("prefill,decode,stack_steps", [("splitgen", "cpu", 5), ("cpu", "splitgen", 0)])
def test_native_stack_runs_only_when_every_decode_layer_is_on_the_cpu(prefill, decode, stack_steps, one_thread):
    """After a splitgen prefill the decode step's KV moves to the host and the native stack takes
    the step; a splitgen decode (last layer on the stand-in accelerator) keeps the per-layer path.
    Greedy tokens equal transformers' either way."""
    import copy

    from conftest import left_padded_batch

    from flexplan import api

    if not native.available():
        pytest.skip(native.status()[1])
    ref = _wide_model("llama")
    lm = api.load(copy.deepcopy(ref), plan={"prefill": prefill, "decode": decode, "gpu_layers": 1,
                                            "cpu_dtype": "float32"}, accelerator="cpu", dtype="float32")
    ids, mask = left_padded_batch((7, 4, 9))
    kw = dict(input_ids=ids % 192, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(lm.generate(**kw), ref.generate(**kw))
    assert lm.last_stats.native_stack_steps == stack_steps


@needs_decode
def test_native_stack_decodes_after_a_streamed_prefill_in_another_dtype(one_thread):
    """FlexInfer's pair: prefill streams layers to the accelerator (bf16), decode runs on the CPU
    (fp32). The CPU's own packed copy serves decode, so the native stack takes every step, and the
    tokens equal those of the same plan run layer by layer."""
    import copy

    from conftest import left_padded_batch

    from flexplan import api

    if not native.available():
        pytest.skip(native.status()[1])
    ref = _wide_model("llama")
    plan = {"prefill": "gpu-offload", "decode": "cpu", "cpu_dtype": "float32"}
    ids, mask = left_padded_batch((7, 4, 9))
    kw = dict(input_ids=ids % 192, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    outs = []
    for stack in (True, False):
        lm = api.load(copy.deepcopy(ref), plan=plan, accelerator="cpu", dtype="bfloat16")
        if not stack:
            lm.executor._cpu_step_ready = lambda st: False
        outs.append(lm.generate(**kw))
        assert lm.last_stats.native_stack_steps == (5 if stack else 0)
        assert lm.executor.placement.layer_places(0) == {"host", "pinned"}
    assert torch.equal(*outs)


@needs_decode
def test_native_stack_leaves_steps_past_a_sliding_window_to_the_layers(one_thread):
    """Mistral with an 8-token window: steps whose keys fit in the window run natively, later ones
    by layer (with transformers' sliding-window mask); tokens equal transformers'."""
    import copy

    from flexplan import api

    if not native.available():
        pytest.skip(native.status()[1])
    ref = _wide_model("mistral", sliding_window=8)
    lm = api.load(copy.deepcopy(ref), plan={"prefill": "cpu", "decode": "cpu", "cpu_dtype": "float32"},
                  accelerator="cpu", dtype="float32")
    ids = torch.arange(3, 8).view(1, 5)  # keys 6..8 fit the window at steps 1-3, keys 9..12 do not
    kw = dict(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(lm.generate(**kw), ref.generate(**kw))
    assert lm.last_stats.native_stack_steps == 3


def test_without_native_ops_layers_keep_transformers_forward(monkeypatch):
    monkeypatch.setenv("FLEXPLAN_NATIVE", "0")
    native.decode_status.cache_clear()
    try:
        ops, why = native.decode_status()
        assert ops is None and "FLEXPLAN_NATIVE=0" in why
        model = _wide_model("llama")
        assert cpu_decode.install(model.model.layers, [model.model.norm]) == ([], [], [])
        assert "forward" not in model.model.layers[0].__dict__
        assert cpu_decode.describe().startswith("transformers' ops")
    finally:
        native.decode_status.cache_clear()


def _bf16_packing() -> bool:
    """Whether oneDNN can pack a bf16 linear weight on this CPU (it needs AVX-512 BF16 support
    or AVX-NE-CONVERT; an AVX2-only CPU refuses)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(64, 64, dtype=torch.bfloat16), 1)
        return True
    except RuntimeError:
        return False


@needs_decode
@pytest.mark.parametrize("cpu_dtype,masked", [
    pytest.param("bfloat16", True, marks=pytest.mark.skipif(not _bf16_packing(), reason="no bf16 oneDNN packing on this CPU")),
    ("float32", False)])
def test_unmasked_decode_gets_the_all_true_mask_only_where_transformers_attends(cpu_dtype, masked, one_thread):
    """The fused ops attend without a mask in fp32; a bf16 CPU layer still runs transformers' SDPA,
    whose unmasked grouped-query CPU path is ~10x slower, so it keeps getting the all-true mask."""
    from flexplan import api

    model = _wide_model("llama")
    seen = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True)
    lm = api.load(model, plan={"prefill": "cpu", "decode": "cpu", "cpu_dtype": cpu_dtype}, accelerator="cpu",
                  dtype=cpu_dtype)
    assert lm.executor._fused
    lm.generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    decode_masks = seen[1:]  # the first call is the prefill
    if masked:
        assert decode_masks and all(m is not None and bool(m.all()) for m in decode_masks)
    else:
        assert not decode_masks  # fp32: the fused layer ran, not transformers' attention


@needs_decode
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("source", ["model", "folder"])
def test_16bit_checkpoint_on_the_float32_cpu_keeps_16bit_weights_with_float32_results(dtype, source, one_thread,
                                                                                        tmp_path):
    """A bf16 / fp16 model on the CPU alone (which computes in float32 here): the linear weights
    and the tied-or-not LM head stay 16-bit in the blocked layout, the host holds about half the
    bytes, the native stack takes every decode step, and scores equal bit for bit those of the
    same model widened to float32 first (greedy tokens equal transformers' float32 ones)."""
    import copy

    from conftest import left_padded_batch

    from flexplan import api

    if not native.available():
        pytest.skip(native.status()[1])
    import transformers

    ref = _wide_model("llama").to(dtype)
    wide = copy.deepcopy(ref).float()
    if source == "folder":  # the reference as transformers loads it (rotary frequencies computed in float32)
        ref.save_pretrained(tmp_path)
        wide = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    plan = {"prefill": "cpu", "decode": "cpu", "cpu_dtype": "float32"}
    lm = api.load(str(tmp_path) if source == "folder" else copy.deepcopy(ref), plan=plan)
    lm32 = api.load(copy.deepcopy(wide), plan=plan)
    assert (lm.executor.plan.dtype, lm.executor.plan.cpu_dtype) == (str(dtype)[6:], "float32")
    layer = lm.model.model.layers[1]
    assert layer.mlp.down_proj.weight.dtype == dtype and layer.mlp.down_proj.weight.dim() == 3
    assert lm.model.lm_head.weight.dtype == dtype and layer.input_layernorm.weight.dtype == torch.float32
    host = lambda m: m.executor.memory_need(m.executor.placement).host["CPU weights"]  # noqa: E731
    linears = sum(p.numel() for n, p in wide.named_parameters() if p.dim() == 2 and "embed" not in n)
    assert host(lm32) - host(lm) == 2 * linears  # 4 -> 2 bytes per linear weight, nothing else changed
    ids, mask = left_padded_batch((7, 4, 9))
    kw = dict(input_ids=ids % 192, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    ours, widened = lm.generate(**kw), lm32.generate(**kw)
    assert lm.last_stats.native_stack_steps == 5
    assert torch.equal(ours.sequences, widened.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, widened.scores))
    assert torch.equal(ours.sequences, wide.generate(**kw).sequences)
