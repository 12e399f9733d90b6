"""flexplan.quant.gguf_model: a GGUF file run on its own blocks (QuantLinear), against a
dequantise-then-float32 reference model of the same blocks."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from conftest import needs_gguf
from flexplan.errors import FlexplanError
from flexplan.quant.gguf_model import load_gguf_model
from flexplan.quant.quant_linear import QuantLinear, set_float_activation

TEXT = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "austen_pride_and_prejudice_ch1.txt"
# int8-activation path vs the float32 reference, teacher-forced top-1 over TEXT (464 tokens):
# measured 0.948 (SmolLM2 Q4_1, AVX2, 2026-11-28); the bound leaves ~2 points of margin
INT8_TOP1_BOUND = 0.93


def _write(path, arch, tensors):
    w = gguf.GGUFWriter(str(path), arch)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype) if qtype is not None else w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_missing_file_is_refused_naming_what_works(tmp_path):
    with pytest.raises(FlexplanError, match=r"no such GGUF file.*llama"):
        load_gguf_model(tmp_path / "absent.gguf")


def test_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write(path, "gpt2", {"token_embd.weight": (np.zeros((4, 32), np.float32), None)})
    with pytest.raises(FlexplanError, match=r"architecture 'gpt2' is not supported; flexplan runs llama"):
        load_gguf_model(path)


def test_unsupported_type_is_refused_by_name(tmp_path):
    path = tmp_path / "q8k.gguf"  # Q8_K: llama.cpp's activation format, no weight type (Q2_K and the like load dequantised)
    _write(path, "llama", {"blk.0.attn_q.weight": (np.zeros((4, 292), np.uint8), gguf.GGMLQuantizationType.Q8_K)})
    with pytest.raises(FlexplanError, match=r"Q8_K .*flexplan runs .* on their blocks"):
        load_gguf_model(path)


@pytest.fixture(scope="module")
def smollm2():
    from flexplan.smollm import gguf_path

    model, tok = load_gguf_model(gguf_path())
    ref, _ = load_gguf_model(gguf_path(), tokenizer=False, dequantize_all=True)
    return model, ref, tok


@needs_gguf
@pytest.mark.slow
def test_linears_hold_raw_blocks(smollm2):
    model, _, _ = smollm2
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 30 * 7 + 1  # every decoder linear and the tied head (token_embd's Q8_0 blocks)
    assert all(m.dense is None and m.blocks.dtype == torch.uint8 for m in linears)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())


@needs_gguf
@pytest.mark.slow
def test_float_activation_tokens_equal_the_dequantised_reference(smollm2):
    model, ref, tok = smollm2
    set_float_activation(model, True)
    try:
        ids = tok("The capital of France is", return_tensors="pt").input_ids
        got = model.generate(ids, max_new_tokens=16, do_sample=False)
        want = ref.generate(ids, max_new_tokens=16, do_sample=False)
        assert torch.equal(got, want)
    finally:
        set_float_activation(model, False)


@needs_gguf
@pytest.mark.slow
def test_int8_activation_top1_agreement_over_the_committed_text(smollm2):
    model, ref, tok = smollm2
    ids = tok(TEXT.read_text(), return_tensors="pt").input_ids
    with torch.no_grad():
        agree = (model(ids).logits.argmax(-1) == ref(ids).logits.argmax(-1)).float().mean().item()
    assert agree >= INT8_TOP1_BOUND, agree


@needs_gguf
@pytest.mark.slow
def test_flexplan_load_of_a_gguf_path_runs_its_blocks_under_the_cpu_policy():
    import flexplan
    from flexplan.smollm import gguf_path

    lm = flexplan.load(str(gguf_path()))
    assert (lm.plan.prefill.policy, lm.plan.decode.policy) == ("cpu", "cpu")
    assert sum(isinstance(m, QuantLinear) for m in lm.model.modules()) == 211
    ids = lm.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = lm.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 8) and "Paris" in lm.tokenizer.decode(out[0])


def test_weights_choices_that_do_not_fit_the_source_are_refused_naming_what_works(tmp_path):
    import flexplan

    with pytest.raises(FlexplanError, match=r"weights='gguf'.*take a .gguf file path"):
        flexplan.load(str(tmp_path / "folder"), weights="gguf")
    with pytest.raises(FlexplanError, match=r"weights='int4' quantises a model folder"):
        flexplan.load(str(tmp_path / "m.gguf"), weights="int4")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_native_decoder_layers_run_the_blocks_as_the_dequantised_reference(tmp_path, arch, qtype):
    """The fused native decoder layers (flexplan.executor.cpu_decode) on a GGUF file's blocks: every
    layer covered, and on the exact float-activation path the tokens equal the dequantise-then-
    float32 model's, per layer (transformers' generate) and as one native call for the whole stack
    (flexplan.load's executor)."""
    import flexplan
    from flexplan.executor import cpu_decode, native
    from flexplan.quant import kernels
    from gguf_files import tiny_model, write_gguf

    if native.decode_status()[0] is None or kernels.status()[0] is None:
        pytest.skip("no native kernels here (no C compiler)")
    path = tmp_path / f"{arch}-{qtype}.gguf"
    write_gguf(tiny_model(arch), path, qtype)
    ref, _ = load_gguf_model(path, tokenizer=False, dequantize_all=True)
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    want = ref.generate(ids, max_new_tokens=12, do_sample=False)

    model, _ = load_gguf_model(path, tokenizer=False, float_act=True)
    changed, fused, _ = cpu_decode.install(model.model.layers, [model.model.norm])
    assert fused == list(range(len(model.model.layers)))
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), want)
    cpu_decode.uninstall(changed)

    lm = flexplan.load(str(path))
    set_float_activation(lm.model, True)
    assert torch.equal(lm.generate(ids, max_new_tokens=12, do_sample=False), want)
    assert lm.last_stats.native_stack_steps == 11  # every decode step one native call for all the layers


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_1", "Q8_0"])
def test_the_accelerator_path_dequantises_as_the_reference(tmp_path, qtype):
    """An input off the CPU takes QuantLinear.forward_dequantised (the blocks dequantised by torch
    ops where the input is): forced here on the CPU, a tiny Llama's tokens equal the dequantise-
    then-float32 model's, whose weights are gguf's own dequantisation."""
    from gguf_files import tiny_model, write_gguf

    path = tmp_path / f"llama-{qtype}.gguf"
    write_gguf(tiny_model("llama"), path, qtype)
    ref, _ = load_gguf_model(path, tokenizer=False, dequantize_all=True)
    model, _ = load_gguf_model(path, tokenizer=False)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.forward = m.forward_dequantised
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    want = ref.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), want)


def test_a_k_quant_linear_off_the_cpu_path_equals_gguf():
    from flexplan.quant import kernels
    from flexplan.quant.formats import BY_NAME

    g = torch.Generator().manual_seed(11)
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        qt = kernels.random_blocks(BY_NAME[name], 40, 512, g)
        lin = QuantLinear(qt, bias=torch.randn(40, generator=g))
        x = torch.randn(3, 512, generator=g)
        want = torch.nn.functional.linear(x, qt.dequantize(), lin.bias)
        assert torch.equal(lin.forward_dequantised(x), want), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_gguf_model_moved_to_cuda_runs_its_blocks_there(tmp_path):
    from gguf_files import tiny_model, write_gguf

    path = tmp_path / "llama-Q4_1.gguf"
    write_gguf(tiny_model("llama"), path, "Q4_1")
    ref, _ = load_gguf_model(path, tokenizer=False, dequantize_all=True)
    model, _ = load_gguf_model(path, tokenizer=False)
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    with torch.no_grad():
        got = model.to("cuda")(ids.cuda()).logits.cpu()
        want = ref(ids).logits
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-3)
