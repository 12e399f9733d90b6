"""ModelSpec from the configs of many transformers 5 decoder-only LMs, counted exactly.

Each case builds a tiny config with transformers' own config class, instantiates
``AutoModelForCausalLM.from_config`` on the meta device (no memory is allocated) and checks
that :class:`ModelSpec` gives the model's parameter count (tied weights once), each decoder
layer's count, and transformers' own per-layer attention kinds.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from flexplan.errors import MalformedDataError, UnsupportedModelError
from flexplan.workload import costs
from flexplan.workload.model import ModelSpec

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

# Small widths, written under every alias a config class may use; only the keys a class
# knows are passed to it.
TINY = dict(hidden_size=64, n_embd=64, d_model=64, intermediate_size=96, ffn_dim=96, n_inner=96,
            num_attention_heads=4, n_head=4, num_key_value_heads=2, num_kv_heads=2, num_hidden_layers=4,
            n_layer=4, vocab_size=128, head_dim=16, max_position_embeddings=64, n_positions=64,
            moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
            num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)

CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama-biases-tied": ("llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "llama-mqa": ("llama", dict(num_key_value_heads=1)),
    "mistral-window": ("mistral", dict(sliding_window=8)),
    "qwen2": ("qwen2", {}),
    "qwen2-window-top-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", dict(sliding_window=8)),
    "gemma3_text": ("gemma3_text", dict(sliding_window=8, num_hidden_layers=7)),
    "olmo2": ("olmo2", {}),
    "olmo": ("olmo", {}),
    "gpt_neox-parallel": ("gpt_neox", dict(use_parallel_residual=True)),
    "gpt_neox-serial": ("gpt_neox", dict(use_parallel_residual=False, attention_bias=False)),
    "falcon-7b-style": ("falcon", dict(multi_query=True, parallel_attn=True, bias=False)),
    "falcon-40b-style": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2, bias=False)),
    "falcon-serial-bias": ("falcon", dict(multi_query=False, parallel_attn=False, bias=True)),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", dict(shared_expert_intermediate_size=48, decoder_sparse_step=2, mlp_only_layers=[0])),
    "qwen3_moe": ("qwen3_moe", dict(mlp_only_layers=[1])),
    "gpt_oss": ("gpt_oss", dict(sliding_window=8)),
    "deepseek_v3": ("deepseek_v3", dict(first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=24, kv_lora_rank=16,
                                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_group=2, topk_group=1)),
    "deepseek_v3-no-q-lora": ("deepseek_v3", dict(first_k_dense_replace=2, n_shared_experts=2, q_lora_rank=None,
                                                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                                  v_head_dim=16, n_group=2, topk_group=1)),
    "deepseek_v2": ("deepseek_v2", dict(first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=24,
                                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                        n_group=2, topk_group=1)),
    "olmoe": ("olmoe", {}),
    "granitemoe": ("granitemoe", {}),
    "opt": ("opt", {}),
    "gpt2": ("gpt2", {}),
    "gptj": ("gptj", dict(rotary_dim=8)),
    "stablelm": ("stablelm", {}),
    "stablelm-qk-norm-parallel": ("stablelm", dict(qk_layernorm=True, use_parallel_residual=True, use_qkv_bias=True)),
    "granite": ("granite", {}),
    "cohere": ("cohere", {}),
    "cohere-qk-norm": ("cohere", dict(use_qk_norm=True)),
    "starcoder2": ("starcoder2", dict(sliding_window=8)),
    "smollm3": ("smollm3", {}),
    "phi": ("phi", {}),
    "nemotron": ("nemotron", {}),
    # layouts a model_type trait describes (what the config does not say)
    "gpt_bigcode": ("gpt_bigcode", {}),
    "bloom": ("bloom", {}),
    "mpt": ("mpt", dict(d_model=64, n_heads=4, n_layers=4, no_bias=True)),
    "gpt_neo": ("gpt_neo", dict(num_layers=4, num_heads=4, attention_types=[[["global", "local"], 2]], window_size=8)),
    "biogpt": ("biogpt", {}),
    "glm4": ("glm4", {}),
    "exaone4": ("exaone4", {}),
    "llama4_text": ("llama4_text", dict(intermediate_size_mlp=80, moe_layers=[1, 3])),
    "ernie4_5_moe": ("ernie4_5_moe", {}),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", {}),
    "minimax_m2": ("minimax_m2", {}),
    "cohere2": ("cohere2", dict(sliding_window=8)),
    "phimoe": ("phimoe", {}),
    "dbrx-nested-configs": ("dbrx", dict(d_model=64, n_heads=4, n_layers=3, attn_config=dict(kv_n_heads=2, rope_theta=1e4),
                                         ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2))),
}


def _tiny_config(model_type: str, overrides: dict):
    cls = type(AutoConfig.for_model(model_type))
    known = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}))
    kw = {k: v for k, v in TINY.items() if k in known or k.endswith("token_id")}
    kw.update(overrides)
    if "layer_types" in known:
        kw.setdefault("layer_types", None)  # let the class derive them for num_hidden_layers
    return cls(**kw)


def _build(cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)


def _decoder_layers(model, n: int):
    """The decoder's ModuleList of ``n`` layers (``layers`` or GPT-2's ``h``)."""
    decoder = model.get_decoder()
    for module in decoder.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise AssertionError(f"no list of {n} layers in {type(decoder).__name__}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_params_equal_the_transformers_model(case):
    model_type, overrides = CASES[case]
    cfg = _tiny_config(model_type, overrides)
    model = _build(cfg)
    spec = ModelSpec.from_config(cfg, name=case)
    assert spec.family == model_type
    assert spec.total_params == sum(p.numel() for p in model.parameters())  # each Parameter once
    layers = _decoder_layers(model, spec.num_layers)
    for i, layer in enumerate(layers):
        assert spec.layer_params(i) == sum(p.numel() for p in layer.parameters()), f"layer {i}"
        assert sum(spec.layer_group_params(i).values()) == spec.layer_params(i)
    hf_kinds = getattr(cfg, "layer_types", None)
    if hf_kinds:
        assert list(spec.layer_types) == list(hf_kinds)
    assert 0 < spec.active_params <= spec.total_params
    assert (spec.active_params < spec.total_params) == spec.is_moe
    assert costs.c_prefill(spec, 2, 16) > 0 and costs.d_decode(spec, 2, 2, 2) > 0


def test_operator_groups_match_the_modules():
    """Qwen2-MoE layer 1: attention, router (mlp.gate), experts, shared expert + its gate."""
    cfg = _tiny_config(*CASES["qwen2_moe"])
    layer = _decoder_layers(_build(cfg), 4)[1]
    groups = ModelSpec.from_config(cfg).layer_group_params(1)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert groups["attention"] == count(layer.self_attn)
    assert groups["router"] == count(layer.mlp.gate)
    assert groups["experts"] == count(layer.mlp.experts)
    assert groups["shared_experts"] == count(layer.mlp.shared_expert) + count(layer.mlp.shared_expert_gate)
    assert groups["mlp"] == 0


def test_moe_layers_follow_the_config():
    spec = ModelSpec.from_config(_tiny_config(*CASES["qwen2_moe"]))
    assert spec.moe_layers == (False, True, False, True)  # mlp_only_layers [0], decoder_sparse_step 2
    spec = ModelSpec.from_config(_tiny_config(*CASES["deepseek_v3-no-q-lora"]))
    assert spec.moe_layers == (False, False, True, True)  # first_k_dense_replace 2
    assert spec.shared_expert_intermediate_size == 2 * 32
    assert (spec.head_dim, spec.v_head_dim, spec.num_kv_heads) == (16, 16, 4)


def test_sliding_layers_follow_the_config():
    g3 = ModelSpec.from_config(_tiny_config(*CASES["gemma3_text"]))
    assert g3.sliding_window == 8
    assert g3.layer_types == ("sliding_attention",) * 5 + ("full_attention",) + ("sliding_attention",)
    q2 = ModelSpec.from_config(_tiny_config(*CASES["qwen2-window-top-layers"]))
    assert q2.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    assert ModelSpec.from_config(_tiny_config("qwen2", {})).sliding_window is None


# Raw published-style dicts (what a config.json holds), read without transformers.
def test_aliases_of_gpt2_style_configs():
    cfg = dict(model_type="my-gpt", n_layer=3, n_embd=64, n_head=4, n_inner=None, vocab_size=100,
               n_positions=32, layer_norm_epsilon=1e-5)
    spec = ModelSpec.from_config(cfg)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.intermediate_size) == (3, 64, 4, 256)
    assert spec.norm == "layer" and spec.max_position_embeddings == 32


def test_unknown_model_type_with_standard_fields_reads_as_llama_like():
    cfg = dict(model_type="brand-new-lm", hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=2, vocab_size=128, rms_norm_eps=1e-6)
    llama = dict(cfg, model_type="llama")
    assert ModelSpec.from_config(cfg).total_params == ModelSpec.from_config(llama).total_params


def test_nested_text_config_is_read():
    text = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_hidden_layers=6, vocab_size=128, sliding_window=8)
    spec = ModelSpec.from_config(dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"],
                                      text_config=text, vision_config={"model_type": "siglip_vision_model"}))
    assert spec.family == "gemma3_text" and spec.num_layers == 6
    assert spec.layer_types[5] == "full_attention" and spec.layer_types[0] == "sliding_attention"


@pytest.mark.parametrize("cfg,words", [
    (dict(model_type="t5", is_encoder_decoder=True, d_model=64, num_layers=2), "encoder-decoder"),
    (dict(model_type="bart", is_encoder_decoder=True, d_model=64), "encoder-decoder"),
    (dict(model_type="mamba", hidden_size=64, num_hidden_layers=2), "state-space"),
    (dict(model_type="jamba", hidden_size=64, num_hidden_layers=2), "hybrid"),
    (dict(model_type="falcon_h1", hidden_size=64, num_hidden_layers=2), "hybrid"),
    (dict(model_type="qwen3_next", hidden_size=64, num_hidden_layers=2), "linear-attention"),
    (dict(model_type="recurrent_gemma", hidden_size=64, num_hidden_layers=2), "recurrent"),
    (dict(model_type="xlstm", hidden_size=64, num_hidden_layers=2), "recurrent"),
    (dict(model_type="some-hybrid", hidden_size=64, num_hidden_layers=2,
          layer_types=["full_attention", "linear_attention"]), "linear_attention"),
    (dict(model_type="bert", architectures=["BertForMaskedLM"], hidden_size=64), "encoder-only"),
])
def test_models_that_cannot_run_layer_by_layer_get_one_line(cfg, words):
    with pytest.raises(UnsupportedModelError) as info:
        ModelSpec.from_config(cfg, name="x/model")
    msg = str(info.value)
    assert words in msg and cfg["model_type"] in msg and "\n" not in msg


def test_transformers_hybrid_config_is_refused():
    cfg = AutoConfig.for_model("jamba", num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                               expert_layer_period=2, expert_layer_offset=1)
    with pytest.raises(UnsupportedModelError):
        ModelSpec.from_config(cfg)


def test_layer_types_of_the_wrong_length_is_malformed():
    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_hidden_layers=2, vocab_size=128, layer_types=["full_attention"] * 3)
    with pytest.raises(MalformedDataError):
        ModelSpec.from_config(cfg)
