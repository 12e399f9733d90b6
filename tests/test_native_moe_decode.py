"""A routed MoE layer in the native decode layer (native_decode.c's moe_ffn): transformers' top-k
softmax router and the experts' GGUF blocks in the same native call as attention, so a MoE model's
all-CPU decode step is one native call for every layer (cpu_decode.FusedLayer / FusedStack).

What holds, on tiny random Qwen3-MoE, Mixtral and Qwen2-MoE files from gguf's writer: with float activations
the fused layers give the model's own logits within float32 rounding (the router's softmax and the
SiLU are computed natively) and its greedy tokens; the experts' own forward then runs in prefill
only; a router that does not renormalise (Qwen3-MoE's norm_topk_prob=False) is followed; switching
the experts off the one-call path (``fused = False``) or to float activations reaches the fused
layers; experts placed apart from their layer (cpu-experts) keep the executor's own path."""

import pytest
import torch

from gguf_files import EOS_ID, tiny_model, write_gguf
from flexplan.executor import cpu_decode, native
from flexplan.quant.gguf_model import load_gguf_model
from flexplan.quant.quant_experts import QuantExperts
from flexplan.quant.quant_linear import set_float_activation

pytestmark = pytest.mark.skipif(native.decode_status()[0] is None, reason="no native decode ops here")

MOE = ("qwen3_moe", "mixtral", "qwen2_moe")  # Qwen2-MoE: a sigmoid-gated shared expert beside the routed ones


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-native")
    made = {}

    def path(arch, qtype="Q8_0"):
        if (arch, qtype) not in made:
            made[arch, qtype] = root / f"{arch}-{qtype}.gguf"
            write_gguf(tiny_model(arch), made[arch, qtype], qtype, experts_qtype=qtype)
        return made[arch, qtype]

    return path


def _ids(seed=0, length=10):
    return torch.randint(0, EOS_ID, (1, length), generator=torch.Generator().manual_seed(seed))


def _decode(model, ids, n=8):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=EOS_ID, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:], torch.stack(out.scores)[:, 0]


class _Calls:
    """Counts calls of every QuantExperts' own forward (the experts' path outside the fused layer)."""

    def __init__(self, model):
        self.n = 0
        self.orig = QuantExperts.forward

    def __enter__(self):
        counter = self

        def counted(module, *args, **kwargs):
            counter.n += 1
            return counter.orig(module, *args, **kwargs)

        QuantExperts.forward = counted
        return self

    def __exit__(self, *exc):
        QuantExperts.forward = self.orig


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", MOE)
def test_fused_moe_layers_give_the_models_logits(files, arch, qtype):
    model, _ = load_gguf_model(files(arch, qtype), tokenizer=False, float_act=True, log=lambda line: None)
    layers = model.model.layers
    ids = _ids(seed=1)
    want, want_scores = _decode(model, ids)
    changed, fused, _ = cpu_decode.install(layers, [model.model.norm])
    try:
        assert fused == list(range(len(layers)))  # every MoE layer whole, not only its attention
        assert all(layer.forward.moe is not None for layer in layers)
        with _Calls(model) as calls:
            got, scores = _decode(model, ids)
        assert calls.n == len(layers)  # the prefill's only: every decode step's experts ran in the fused layers
    finally:
        cpu_decode.uninstall(changed)
    assert torch.equal(got, want)
    assert torch.allclose(scores, want_scores, atol=1e-4, rtol=1e-4), (scores - want_scores).abs().max()


def test_a_router_that_keeps_the_softmax_unnormalised_is_followed(files):
    """Qwen3-MoE's norm_topk_prob=False: the kept probabilities are the routing weights as they are."""
    model, _ = load_gguf_model(files("qwen3_moe"), tokenizer=False, float_act=True, log=lambda line: None)
    for layer in model.model.layers:
        layer.mlp.gate.norm_topk_prob = False
    ids = _ids(seed=2)
    want, want_scores = _decode(model, ids)
    changed, fused, _ = cpu_decode.install(model.model.layers, [model.model.norm])
    try:
        assert all(layer.forward.norm_topk is False for layer in model.model.layers)
        got, scores = _decode(model, ids)
    finally:
        cpu_decode.uninstall(changed)
    assert torch.equal(got, want)
    assert torch.allclose(scores, want_scores, atol=1e-4, rtol=1e-4)
    # renormalised, the same logits move: the flag reached the native call
    changed, _, _ = cpu_decode.install(model.model.layers, [model.model.norm])
    try:
        for layer in model.model.layers:
            layer.forward.norm_topk = True
            layer.forward._bound = ()
        _, other = _decode(model, ids)
    finally:
        cpu_decode.uninstall(changed)
    assert (other - want_scores).abs().max() > 1e-3


@pytest.mark.parametrize("arch", MOE)
def test_the_executors_decode_step_is_one_native_call_with_the_files_blocks(files, arch):
    """flexplan.load: an all-CPU decode step of a MoE file runs in the native stack (router and
    experts included), its tokens those of the model alone; with float activations its logits too."""
    import flexplan

    path = files(arch)
    alone, _ = load_gguf_model(path, tokenizer=False, float_act=True, log=lambda line: None)
    lm = flexplan.load(str(path))
    set_float_activation(lm.model, True)
    ids = _ids(seed=3)
    want, want_scores = _decode(alone, ids)
    with _Calls(lm.model) as calls:
        got, scores = _decode(lm, ids)
    assert lm.last_stats.native_stack_steps == len(want) - 1
    assert calls.n == len(alone.model.layers)  # the prefill's only
    assert torch.equal(got, want)
    assert torch.allclose(scores, want_scores, atol=1e-4, rtol=1e-4)
    # llama.cpp's int8 activations again (a switch, not a tensor move): the stack follows it
    set_float_activation(lm.model, False)
    set_float_activation(alone, False)
    want, _ = _decode(alone, ids)
    got, _ = _decode(lm, ids)
    assert lm.last_stats.native_stack_steps == len(want) - 1
    assert torch.equal(got, want)


def test_experts_off_the_one_call_path_leave_the_layer_to_transformers(files):
    """``fused = False`` on the experts (their Python loop): the fused layers step aside at once,
    even after the stack had checked them."""
    import flexplan

    lm = flexplan.load(str(files("qwen3_moe")))
    ids = _ids(seed=4)
    _decode(lm, ids, n=3)
    assert lm.last_stats.native_stack_steps == 2
    experts = [m for m in lm.model.modules() if isinstance(m, QuantExperts)]
    for m in experts:
        m.fused = False
    with _Calls(lm.model) as calls:
        _decode(lm, ids, n=3)
    assert lm.last_stats.native_stack_steps == 0
    assert calls.n == 3 * len(experts)  # prefill and both decode steps, every layer


def test_experts_placed_apart_keep_the_executors_path(files):
    """cpu-experts (the CPU standing in for the accelerator): the layer computes on the accelerator,
    its experts on the host copy; the fused layer leaves the experts to the executor's forward."""
    import flexplan

    lm = flexplan.load(str(files("qwen3_moe")), plan={"prefill": "cpu-experts", "decode": "cpu-experts"},
                       accelerator="cpu", gpu_memory_bytes=1 << 30)
    ex = lm.executor
    apart = [found[1] for i, found in enumerate(ex.expert_modules)
             if found and ex.placement.experts_on_cpu(i, "decode") and ex.placement.experts_on_cpu(i, "prefill")]
    assert apart
    ids = _ids(seed=5)
    with torch.no_grad():
        got = lm.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=EOS_ID)
    assert all(p.calls == 4 for p in apart)  # the prefill and every decode step, on the host
    alone, _ = load_gguf_model(files("qwen3_moe"), tokenizer=False, log=lambda line: None)
    with torch.no_grad():
        assert torch.equal(got, alone.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                               pad_token_id=EOS_ID))


@pytest.mark.parametrize("arch", MOE)
def test_the_spec_prices_the_stack_exactly_where_it_runs(files, arch):
    """ModelSpec.native_decode_stack (the estimator's rule for pricing a decode step as the native
    stack's) holds for a MoE file whose experts are kernel blocks, where the executor's stack runs;
    the same model with float experts (no blocks) is not one."""
    import flexplan
    from flexplan.workload import resolve_model

    path = files(arch)
    spec = resolve_model(path)
    assert spec.native_decode_stack and not spec.native_decode_stack_with(())
    lm = flexplan.load(str(path))
    _decode(lm, _ids(seed=6), n=3)
    assert lm.last_stats.native_stack_steps == 2


@pytest.mark.parametrize("arch", MOE)
def test_the_serving_engine_runs_a_moe_file_in_its_native_step(files, arch):
    """The engine's native iteration (serving.fused_step: per layer the native calls, a decode-only
    iteration one call for all the layers) takes a MoE file's layers too: each request's greedy
    tokens those of the model alone, two requests sharing the batch."""
    from flexplan.serving.engine import Engine
    from flexplan.serving.types import SamplingParams

    path = files(arch)
    alone, _ = load_gguf_model(path, tokenizer=False, log=lambda line: None)
    prompts = ([5, 6, 7, 8, 9, 10, 11], list(range(30, 52)))
    want = []
    for p in prompts:
        with torch.no_grad():
            ids = torch.tensor([p])
            out = alone.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 pad_token_id=EOS_ID)[0, len(p):].tolist()
        want.append(out[:out.index(EOS_ID) + 1] if EOS_ID in out else out)
    with Engine.from_pretrained(path, host_blocks=32, block_size_tokens=4, token_budget=32) as e:
        assert e.runner.fused is not None
        outs = e.generate([list(p) for p in prompts], SamplingParams(max_tokens=6, temperature=0.0))
        assert e.runner.fused.iterations > 0 and e.runner.fused.stack_iterations > 0
    assert [list(o.new_token_ids) for o in outs] == want
