"""weights="int4" / "int8": a float checkpoint's decoder and head linears quantised at load into the
blocks the kernels run (flexplan.quant.at_load), and plan() pricing them (issue 40, item 2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flexplan
from flexplan.errors import InvalidInputError
from flexplan.quant.at_load import AT_LOAD_FORMATS, load_quantized_folder, quantize
from flexplan.quant.quant_linear import QuantLinear


def _folder(tmp_path, tied: bool, hidden: int = 128):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path / f"llama-{'tied' if tied else 'untied'}-{hidden}"
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_folder_quantised_at_load_runs_its_linears_on_blocks_near_the_float_model(tmp_path, tied, weights):
    ref, path = _folder(tmp_path, tied)
    model = load_quantized_folder(path, weights, log=lambda line: None)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    assert {m.format.name for m in linears} == {AT_LOAD_FORMATS[weights].name}
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    # a random model's logits are nearly flat (its argmax flips on noise): judged by their error
    # relative to their spread, measured 0.013 (int8) and 0.14-0.15 (int4) here
    rel = float((a - b).norm() / (a - a.mean(-1, keepdim=True)).norm())
    assert rel < (0.03 if weights == "int8" else 0.25), rel
    # the caller's checkpoint weights, quantised as llama.cpp's reference quantizer does
    q = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn.q_proj"))
    want = quantize("q", ref.model.layers[0].self_attn.q_proj.weight, AT_LOAD_FORMATS[weights])
    assert torch.equal(q.file_blocks(), want.data)


def test_a_width_the_groups_do_not_divide_is_refused_clearly(tmp_path):
    _, path = _folder(tmp_path, tied=True, hidden=80)  # 80 inputs: not a multiple of 32
    with pytest.raises(InvalidInputError, match="not a multiple of"):
        load_quantized_folder(path, "int4", log=lambda line: None)


def test_an_unknown_choice_is_refused(tmp_path):
    _, path = _folder(tmp_path, tied=True)
    with pytest.raises(InvalidInputError, match="int4"):
        load_quantized_folder(path, "int3", log=lambda line: None)


def test_plan_prices_weights_quantised_at_load(tmp_path):
    _, path = _folder(tmp_path, tied=True)
    dense = flexplan.plan(str(path), "local", batch_size=1, input_len=1, output_len=1, dtype="float32")
    sizes = {}
    for w in ("int8", "int4"):
        p = flexplan.plan(str(path), "local", batch_size=1, input_len=1, output_len=1, weights=w)
        assert (p.prefill.policy, p.decode.policy, p.cpu_dtype) == ("cpu", "cpu", "float32")
        assert any("quantised at load" in n for n in p.notes)
        sizes[w] = p.decode.cpu_memory_bytes
    assert sizes["int4"] < sizes["int8"] < dense.decode.cpu_memory_bytes
    model = load_quantized_folder(path, "int4", log=lambda line: None)
    held = sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))
    held += sum(p.numel() * 4 for p in model.parameters() if p.is_floating_point())  # the blocks are uint8 parameters
    assert sizes["int4"] == pytest.approx(held, rel=0.05)  # plus one token's KV and activations


def test_int4_on_a_gguf_file_is_refused():
    from flexplan.smollm import gguf_path

    with pytest.raises(InvalidInputError, match="GGUF file"):
        flexplan.plan(str(gguf_path()), "local", weights="int4")


def test_the_group_formats_are_the_block_formats_a_kernel_runs():
    for fmt in AT_LOAD_FORMATS.values():
        assert fmt.native_kernel and fmt.block_weights == 32
    assert np.isclose(AT_LOAD_FORMATS["int4"].bytes_per_weight, 20 / 32)


def test_flexplan_load_of_a_folder_with_weights_int4_runs_the_blocks_under_a_priced_plan(tmp_path):
    _, path = _folder(tmp_path, tied=True)
    lm = flexplan.load(str(path), weights="int4")
    assert (lm.plan.prefill.policy, lm.plan.decode.policy) == ("cpu", "cpu")
    assert any("quantised at load" in n for n in lm.plan.notes)  # priced as the blocks it holds
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(2))
    want = load_quantized_folder(path, "int4", log=lambda line: None).generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(lm.generate(ids, max_new_tokens=6, do_sample=False), want)
    # blocks under any plan: the stand-in's gpu policy gives the same tokens
    gpu = flexplan.load(str(path), weights="int4", plan={"prefill": "gpu", "decode": "gpu"}, accelerator="cpu")
    assert gpu.plan.decode.policy == "gpu" and torch.equal(gpu.generate(ids, max_new_tokens=6, do_sample=False), want)
    with pytest.raises(InvalidInputError, match="model folder"):
        flexplan.load(str(tmp_path / "nothing-here"), weights="int8")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_a_moe_folders_routed_experts_are_quantised_at_load_too(tmp_path, family):
    """transformers' fused experts become QuantExperts on the same blocks, gpt-oss's transposed and
    gated its own way: within the bound of the dense layers' int8 error of the float model, and the
    dequantised blocks are the quantizer's (gguf's reference) values of each expert's weights."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_files import tiny_model
    from flexplan.quant.quant_experts import QuantExperts

    from safetensors.torch import save_file

    ref = tiny_model(family)
    path = tmp_path / family  # the tensors as transformers 5 holds them (save_pretrained writes one per expert)
    ref.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path / "model.safetensors")
    model = load_quantized_folder(path, "int8", log=lambda line: None)
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert len(experts) == 2 and {e.gate_up_format.name for e in experts} == {"Q8_0"}
    want = ref.model.layers[1].mlp.experts
    transposed = bool(getattr(want, "is_transposed", False))
    for leaf, name in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
        w = getattr(want, leaf).detach()
        w = w.transpose(1, 2) if transposed else w
        assert torch.equal(experts[1].dequantized(name), quantize(leaf, w, AT_LOAD_FORMATS["int8"]).dequantize())
    ids = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    # the error relative to the logits' spread, as above (the dense linears int8 too): 0.027-0.117 over
    # three seeds and these families (int8 moves a router's near-ties to other experts; llama alone: 0.045)
    rel = float((a - b).norm() / (a - a.mean(-1, keepdim=True)).norm())
    assert rel < 0.2, rel
