"""Compressed weights under every policy on the CPU stand-in (issue 40): a model whose linears hold
GGUF blocks (QuantLinear) is placed by the executor like any other: the host keeps the blocks as
loaded, pinned memory and the accelerator hold them as they are, streamed layers cross the link as
blocks, and an accelerator's linears dequantise them per call (QuantLinear.forward_dequantised).

On the stand-in the accelerator is host memory, where QuantLinear runs its native kernels: the
tokens of every policy pair equal the ``cpu`` policy's. Forcing the accelerator's path (every
linear dequantised by torch ops) the tokens equal a dequantise-then-float32 copy of the same model
under the same plan."""

import copy
import itertools
import sys

import pytest
import torch
import transformers
from torch import nn

import flexplan
from conftest import needs_gguf
from flexplan import api
from flexplan.estimator.policies import REGISTRY
from flexplan.executor.plans import fixed_plan
from flexplan.memory import footprint
from flexplan.planner import _inventory
from flexplan.quant import kernels
from flexplan.quant.quant_experts import QuantExperts
from flexplan.quant.quant_linear import QuantLinear
from flexplan.workload import resolve_model

POLICIES = sorted(REGISTRY)
FORMATS = sorted(kernels.NATIVE_FORMATS)
# every policy once as prefill and once as decode (the default run); every pair is slow
ROTATED_PAIRS = [(p, POLICIES[(i + 2) % len(POLICIES)]) for i, p in enumerate(POLICIES)]
OTHER_PAIRS = [pair for pair in itertools.product(POLICIES, POLICIES) if pair not in ROTATED_PAIRS]
PROMPT = torch.tensor([[5, 17, 99, 3, 42, 7, 8, 200, 31, 64]])
NEW_TOKENS = 6
GIB = 1 << 30

pytestmark = pytest.mark.skipif(kernels.status()[0] is None, reason="the quantised kernels did not build")


def _block_model(fmt: str, seed: int = 0) -> nn.Module:
    """A tiny Llama (hidden 256: whole K-quant super-blocks) whose decoder linears hold random
    valid ``fmt`` blocks (kernels.random_blocks); the head stays float."""
    config = transformers.LlamaConfig(vocab_size=259, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=258)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear) and name.startswith("model.layers."):
            qt = kernels.random_blocks(kernels.NATIVE_FORMATS[fmt], m.out_features, m.in_features, gen, scale=4e-3)
            model.set_submodule(name, QuantLinear(qt))
    return model


def _dequantised(model: nn.Module) -> nn.Module:
    """The same model with every QuantLinear replaced by an nn.Linear of its dequantised blocks."""
    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        if isinstance(m, QuantLinear):
            lin = nn.Linear(m.in_features, m.out_features, bias=False)
            with torch.no_grad():
                lin.weight.copy_(m.forward_dequantised(torch.eye(m.in_features)).T)
            ref.set_submodule(name, lin)
    return ref


def _plan(model, prefill, decode):
    return fixed_plan(model.config, prefill, decode, 1, batch_size=1, input_len=PROMPT.shape[1],
                      output_len=NEW_TOKENS, dtype="float32", cpu_dtype="float32")


def _tokens(model, prefill, decode):
    lm = api.load(model, plan=_plan(model, prefill, decode), accelerator="cpu", gpu_memory_bytes=GIB)
    out = lm.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return out[0, PROMPT.shape[1]:].tolist(), lm


@pytest.fixture(scope="module")
def block_models():
    return {fmt: _block_model(fmt) for fmt in FORMATS}


@pytest.mark.parametrize("pairs", [pytest.param(ROTATED_PAIRS, id="rotated-pairs"),
                                   pytest.param(OTHER_PAIRS, id="other-pairs", marks=pytest.mark.slow)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_runs_under_every_policy_pair(block_models, one_thread, fmt, pairs):
    model = block_models[fmt]
    want, _ = _tokens(model, "cpu", "cpu")
    for prefill, decode in pairs:
        got, lm = _tokens(model, prefill, decode)
        assert got == want, (fmt, prefill, decode)
        # the caller's model is left as it was: its blocks are still host tensors of their own
        assert all(m.blocks.device.type == "cpu" for m in model.modules() if isinstance(m, QuantLinear))


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "Q8_0"])
@pytest.mark.parametrize("policy", ["gpu", "gpu-offload", "cpu-attention", "split-points", "splitgen"])
def test_the_accelerators_path_equals_the_dequantised_float_model(block_models, one_thread, monkeypatch, fmt, policy):
    """Every QuantLinear on the dequantising path (what an accelerator's linears run): the tokens
    equal the float32 model of the dequantised blocks under the same plan."""
    model = block_models[fmt]
    want, _ = _tokens(_dequantised(model), policy, policy)
    calls = []

    def dequantising(self, x):
        calls.append(self.blocks.data_ptr())
        return QuantLinear.forward_dequantised(self, x)

    monkeypatch.setattr(QuantLinear, "forward", dequantising)
    got, _ = _tokens(model, policy, policy)
    assert calls and got == want


def test_streamed_layers_cross_the_link_as_blocks(block_models, one_thread):
    """gpu-offload: a weight slot holds one layer's blocks (plus its float norms), and each decode
    step copies the streamed layers' blocks, not float weights."""
    model = block_models["Q4_0"]
    _, lm = _tokens(model, "gpu-offload", "gpu-offload")
    ex = lm.executor
    layer = ex.parts.layers[0]
    blocks = sum(m.blocks.numel() for m in layer.modules() if isinstance(m, QuantLinear))
    floats = sum(p.numel() * 4 for p in layer.parameters() if p.is_floating_point())
    params = sum(m.in_features * m.out_features for m in layer.modules() if isinstance(m, QuantLinear))
    assert blocks == params * 18 // 32  # Q4_0: 18 bytes per 32 weights
    assert blocks + floats <= ex.slots.nbytes <= blocks + floats + 64 * 16  # tensors padded to 64 bytes
    assert ex.slots.nbytes < 0.2 * params * 4  # a float32 layer's slot would be > 5x larger


MEMORY_PAIRS = [("gpu", "gpu"), ("gpu-offload", "cpu-attention"), ("split-points", "gpu-offload-partial"), ("cpu", "cpu")]


@pytest.mark.parametrize("arch,prefill,decode", [("llama", *p) for p in MEMORY_PAIRS]
                         + [("qwen3_moe", *p) for p in MEMORY_PAIRS + [("cpu-experts", "cpu-experts")]]
                         + [("deepseek_v3", "cpu", "cpu"), ("deepseek_v3", "gpu-offload", "cpu-experts")])
def test_memory_model_predicts_what_the_executor_allocates_for_blocks(tmp_path, one_thread, prefill, decode, arch):
    """The planner's memory model of a GGUF file's blocks (from its header alone) against the bytes
    the executor's link holds once placed, per memory."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from gguf_files import tiny_model, write_gguf

    path = tmp_path / "tiny.Q4_1.gguf"
    write_gguf(tiny_model(arch), path, "Q4_1", experts_qtype="Q4_1")  # a MoE's experts: blocks too
    spec = resolve_model(str(path))
    lm = flexplan.load(str(path), plan={"prefill": prefill, "decode": decode, "gpu_layers": 1}
                       if REGISTRY[prefill].needs_gpu_layers or REGISTRY[decode].needs_gpu_layers
                       else {"prefill": prefill, "decode": decode}, accelerator="cpu", gpu_memory_bytes=GIB)
    ex = lm.executor
    ex.new_cache(1, 16, 8)
    kernel = ex.backend.linear_kernel if ex.backend.packs_weights else None
    need = footprint(_inventory(spec, spec.stored_weights), ex.placement, 1, 8, 16, kernel)
    for where in ("accelerator", "pinned", "host"):
        real, pred = ex.link.live_bytes(where), need.allocated(where)
        assert abs(pred - real) <= 0.02 * max(real, 1), (where, pred, real)


def _moe_file(tmp_path, fmt: str):
    """A tiny Qwen3-MoE GGUF file, every weight (routed experts too) in ``fmt``."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from gguf_files import tiny_model, write_gguf

    path = tmp_path / f"tiny-moe.{fmt}.gguf"
    write_gguf(tiny_model("qwen3_moe"), path, fmt, experts_qtype=fmt)
    return path


def _file_tokens(path, prefill, decode):
    plan = {"prefill": prefill, "decode": decode}
    if REGISTRY[prefill].needs_gpu_layers or REGISTRY[decode].needs_gpu_layers:
        plan["gpu_layers"] = 1
    lm = flexplan.load(str(path), plan=plan, accelerator="cpu", gpu_memory_bytes=GIB)
    out = lm.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return out[0, PROMPT.shape[1]:].tolist(), lm


def test_routed_experts_on_blocks_run_under_every_policy(tmp_path, one_thread):
    """A MoE file's experts held as blocks (QuantExperts) under each policy (cpu-experts among them:
    the host computes them on their blocks): the cpu policy's tokens."""
    path = _moe_file(tmp_path, "Q4_0")
    want, lm = _file_tokens(path, "cpu", "cpu")
    assert any(isinstance(m, QuantExperts) for m in lm.model.modules())
    for prefill, decode in ROTATED_PAIRS:
        assert _file_tokens(path, prefill, decode)[0] == want, (prefill, decode)


@pytest.mark.parametrize("prefill,decode", [("cpu-experts", "cpu-experts"), ("gpu-offload", "cpu-experts")])
def test_an_expert_cache_holds_blocks_on_the_accelerator(tmp_path, one_thread, prefill, decode):
    """Layer 0 caches all four experts, layer 1 two: the cached ones compute from their blocks on
    the accelerator, the rest on the host; the cpu policy's tokens. The cache holds blocks."""
    from dataclasses import replace

    from flexplan.plan_types import ExpertCache
    from flexplan.quant.gguf_model import gguf_config_and_tokenizer

    path = _moe_file(tmp_path, "Q4_0")
    want, _ = _file_tokens(path, "cpu", "cpu")
    config = gguf_config_and_tokenizer(path, tokenizer=False)[0]
    plan = fixed_plan(config, prefill, decode, 0, batch_size=1, input_len=PROMPT.shape[1], output_len=NEW_TOKENS,
                      gpu_memory_bytes=GIB)
    plan = replace(plan, expert_cache=ExpertCache({0: (0, 1, 2, 3), 1: (1, 3)}, {0: 1.0, 1: 0.5}, 0, 0.0, "test"))
    lm = flexplan.load(str(path), plan=plan, accelerator="cpu", gpu_memory_bytes=GIB)
    out = lm.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    assert out[0, PROMPT.shape[1]:].tolist() == want
    caches = [place.cached for _, place in filter(None, lm.executor.expert_modules)]
    assert [c.ids for c in caches] == [(0, 1, 2, 3), (1, 3)]
    assert all(c.module.gate_up_blocks.dtype == torch.uint8 for c in caches)
    rates = lm.executor.expert_cache_hit_rates()
    assert rates[0] == 1.0 and 0.0 <= rates[1] <= 1.0


@pytest.mark.parametrize("policy", ["gpu", "gpu-offload", "cpu-experts"])
def test_routed_experts_dequantised_on_the_accelerators_path_equal_the_float_model(tmp_path, one_thread,
                                                                                  monkeypatch, policy):
    """QuantExperts on the path an accelerator takes (each selected expert's blocks dequantised by
    torch ops) and every QuantLinear dequantising: the tokens of the float32 model of the same file."""
    path = _moe_file(tmp_path, "Q8_0")
    ref = flexplan.load(str(path), weights="float32", plan={"prefill": policy, "decode": policy}, accelerator="cpu",
                        gpu_memory_bytes=GIB)
    want = ref.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False,
                        min_new_tokens=NEW_TOKENS)[0, PROMPT.shape[1]:].tolist()
    calls = []
    monkeypatch.setattr(QuantExperts, "_native_here", lambda self, x, blocks: calls.append(blocks.shape) is not None)
    monkeypatch.setattr(QuantLinear, "forward", QuantLinear.forward_dequantised)
    got, lm = _file_tokens(path, policy, policy)
    assert any(isinstance(m, QuantExperts) for m in lm.model.modules())  # the experts kept as blocks
    assert calls and got == want


@needs_gguf
def test_a_gguf_file_loads_under_another_policy(one_thread):
    """The embedded SmolLM2's Q4_1 file under gpu-offload on the stand-in: its blocks stream."""
    from flexplan.smollm import gguf_path

    lm = flexplan.load(str(gguf_path()), plan={"prefill": "gpu-offload", "decode": "gpu-offload"}, accelerator="cpu")
    ids = lm.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = lm.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in lm.tokenizer.decode(out[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("policy", ["gpu", "gpu-offload", "cpu-attention", "split-points"])
def test_blocks_on_cuda_equal_the_dequantised_float_model(block_models, policy):
    """On a GPU the accelerator's layers hold blocks and dequantise them there (float32 on both
    sides, so the comparison is of the same arithmetic but the GEMM kernels')."""
    model = block_models["Q4_K"]

    def run(m):
        plan = _plan(m, policy, policy)
        lm = api.load(m, plan=plan, accelerator="cuda", dtype="float32")
        return lm.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT.shape[1]:].tolist(), lm

    want, _ = run(_dequantised(model))
    got, lm = run(model)
    assert got == want
    on_gpu = [m for m in lm.model.modules() if isinstance(m, QuantLinear) and m.blocks.device.type == "cuda"]
    assert on_gpu or policy == "split-points"  # a split layer binds its blocks to the slot per step
