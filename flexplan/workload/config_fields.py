"""Read a HuggingFace ``config.json`` of any decoder-only causal LM into ModelSpec fields.

The reading is generic: every field comes from the names transformers 5 configs use, with
their common aliases (``n_layer`` / ``num_layers``, ``n_embd`` / ``d_model``, ``multi_query``,
``n_head_kv``, ``n_inner`` ...). :data:`TRAITS` holds, per ``model_type``, only what a config
does not say (GPT-J's LM-head bias, Gemma 2's four norms per layer, Qwen3's QK-norm) and the
defaults of a config class where a published ``config.json`` leaves a field out. An unknown
``model_type`` with standard fields reads as a Llama-like model.

Configs that cannot run layer by layer (encoder-decoder, encoder-only, state-space or hybrid
recurrent layers) raise :class:`~flexplan.errors.UnsupportedModelError` with one line saying
what the model is and why.
"""

from __future__ import annotations

from typing import Any

from flexplan.errors import UnsupportedModelError

# Attention kinds a decoder layer may have (``layer_types`` entries); all keep a KV cache.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# MLA models whose transformers attention caches the compressed latent (K: the kv_lora_rank latent,
# V: the shared rotary key, one "head" each) rather than per-head K and V after the up-projection
LATENT_KV_MODEL_TYPES = frozenset({"deepseek_v3", "glm4_moe_lite", "youtu", "axk1", "kimi_linear", "bailing_hybrid"})

# model_type -> what the config does not say. Keys:
#   gated: SwiGLU/GeGLU MLP (gate, up, down) vs plain (up, down)     norm: "rms" | "layer"
#   norm_bias: LayerNorm holds a bias                                norms: norms per decoder layer
#   qk_norm: "head" (head_dim weights), "full" (q_dim / kv_dim weights), "head_ln" (LayerNorm of head_dim)
#   parallel: attention and MLP read the same input                  sinks: per-head attention sinks
#   lm_head_bias, learned_pos (rows beyond max_position_embeddings: OPT's offset 2)
#   defaults: config-class defaults for fields a published config.json may omit
TRAITS: dict[str, dict[str, Any]] = {
    "opt": dict(gated=False, norm="layer", learned_pos=2, defaults=dict(tie_word_embeddings=True, enable_bias=True)),
    "gpt2": dict(gated=False, norm="layer", learned_pos=0, bias=True, defaults=dict(tie_word_embeddings=True)),
    "gpt_bigcode": dict(gated=False, norm="layer", learned_pos=0, bias=True,
                        defaults=dict(tie_word_embeddings=True, multi_query=True)),
    "gptj": dict(gated=False, norm="layer", norms=1, parallel=True, qkv_bias=False, o_bias=False, mlp_bias=True,
                 lm_head_bias=True),
    "codegen": dict(gated=False, norm="layer", norms=1, parallel=True, qkv_bias=False, o_bias=False, mlp_bias=True,
                    lm_head_bias=True),
    "gpt_neox": dict(gated=False, norm="layer", mlp_bias=True,
                     defaults=dict(attention_bias=True, use_parallel_residual=True)),
    "gpt_neox_japanese": dict(gated=False, norm="layer"),
    "kolibri1": dict(norms=4, qk_norm="head"),
    "falcon": dict(gated=False, norm="layer", defaults=dict(bias=False, parallel_attn=True, multi_query=True,
                                                           tie_word_embeddings=True)),
    "phi": dict(gated=False, norm="layer", norms=1, parallel=True, bias=True, lm_head_bias=True),
    "starcoder2": dict(gated=False, norm="layer", defaults=dict(use_bias=True)),
    "stablelm": dict(norm="layer", o_bias=False, qk_norm="full"),
    "cohere": dict(norm="layer", norm_bias=False, norms=1, parallel=True, qk_norm="full", defaults=dict(tie_word_embeddings=True)),
    "cohere2": dict(norm="layer", norm_bias=False, norms=1, parallel=True, defaults=dict(tie_word_embeddings=True)),
    "olmo": dict(norm="layer", norm_affine=False),
    "olmo2": dict(qk_norm="full"),
    "olmo3": dict(qk_norm="full"),
    "olmoe": dict(qk_norm="full"),
    "qwen2": dict(qkv_bias=True, o_bias=False, mlp_bias=False),
    "qwen2_moe": dict(qkv_bias=True, o_bias=False, mlp_bias=False, defaults=dict(qkv_bias=True)),
    "qwen3": dict(qk_norm="head"),
    "qwen3_moe": dict(qk_norm="head"),
    "mistral": dict(qkv_bias=False, o_bias=False, mlp_bias=False),
    "gemma": dict(defaults=dict(tie_word_embeddings=True)),
    "gemma2": dict(norms=4, window_every=2, defaults=dict(tie_word_embeddings=True)),
    "gemma3_text": dict(norms=4, qk_norm="head", window_every=6,
                        defaults=dict(tie_word_embeddings=True, vocab_size=262_208, sliding_window=4096,
                                      sliding_window_pattern=6, max_position_embeddings=131_072, head_dim=256,
                                      rms_norm_eps=1e-6)),
    "gpt_oss": dict(sinks=True, qkv_bias=True, o_bias=True, router_bias=True, expert_bias=True),
    "nemotron": dict(gated=False, norm="layer"),
    "openai-gpt": dict(gated=False, norm="layer", bias=True, ffn_4h=True, learned_pos=0, final_norm=False,
                       defaults=dict(tie_word_embeddings=True)),
    "ctrl": dict(gated=False, norm="layer", bias=True, lm_head_bias=True, defaults=dict(tie_word_embeddings=True)),
    "xglm": dict(gated=False, norm="layer", bias=True, defaults=dict(tie_word_embeddings=True)),
    "gpt_neox_japanese": dict(gated=False, norm="layer"),
    "kolibri1": dict(norms=4, qk_norm="head"),
    "dbrx": dict(norm="layer", norm_bias=False),
    "bloom": dict(gated=False, norm="layer", bias=True, ffn_4h=True, embed_norm=True,
                  defaults=dict(tie_word_embeddings=True)),
    "mpt": dict(gated=False, norm="layer", ffn_4h=True, qkv_bias=False, o_bias=False, mlp_bias=False,
                defaults=dict(tie_word_embeddings=True, no_bias=True)),  # no_bias: LayerNorms only
    "gpt_neo": dict(gated=False, norm="layer", learned_pos=0, qkv_bias=False, o_bias=True, mlp_bias=True,
                    defaults=dict(tie_word_embeddings=True)),
    "biogpt": dict(gated=False, norm="layer", bias=True, learned_pos=2, defaults=dict(tie_word_embeddings=True)),
    "cohere2_moe": dict(norm="layer", norm_bias=False, norms=1, parallel=True),
    "exaone_moe": dict(qk_norm="head"),
    "hy_v3": dict(qk_norm="head"),
    "hunyuan_v1_moe": dict(qk_norm="head", shared_ffn="intermediate_size"),  # shared_mlp of intermediate_size
    "apertus": dict(gated=False, qk_norm="head", extra=lambda h, i, hd: 2),  # xIELU's alpha_p, alpha_n
    "arcee": dict(gated=False),
    "jais2": dict(gated=False, norm="layer"),
    "nanochat": dict(gated=False, norm_affine=False, qk_norm=None),
    "glm": dict(o_bias=False),
    "glm4": dict(o_bias=False, norms=4),
    "exaone4": dict(qk_norm="head"),
    "hunyuan_v1_dense": dict(qk_norm="head"),
    "mellum": dict(qk_norm="head"),
    "minimax_m2": dict(qk_norm="full"),
    "flex_olmo": dict(qk_norm="full"),
    "phimoe": dict(norm="layer"),
    "granite_swa": dict(sinks=True),
    "granitemoe_swa": dict(sinks=True),
    "bitnet": dict(extra=lambda h, i, hd: h + i),  # attn_sub_norm, ffn_sub_norm
    "diffllama": dict(extra=lambda h, i, hd: 4 * hd),  # lambda_q1, lambda_k1, lambda_q2, lambda_k2
    "hyperclovax": dict(norms=4),
    "llama4_text": dict(dense_ffn="intermediate_size_mlp", shared_ffn="intermediate_size", qk_norm=None),  # L2 norm
    "ernie4_5_moe": dict(router_bias=True),  # e_score_correction_bias is a Parameter there
    "persimmon": dict(gated=False, norm="layer", bias=True, qk_norm="head_ln"),
}

# Not decoder-only: (kind, why it cannot run layer by layer).
_RECURRENT = "its layers keep a recurrent state, not a KV cache, so flexplan cannot run it layer by layer"
NOT_LAYERWISE: dict[str, str] = {
    **{t: f"a state-space model: {_RECURRENT}" for t in ("mamba", "mamba2", "falcon_mamba")},
    **{t: f"a hybrid attention/state-space model: {_RECURRENT}" for t in (
        "jamba", "falcon_h1", "zamba", "zamba2", "bamba", "granitemoehybrid", "nemotron_h", "plamo2", "lfm2",
        "lfm2_moe", "hunyuan_v1_moe_hybrid")},
    **{t: f"a hybrid linear-attention model: {_RECURRENT}" for t in ("qwen3_next", "minimax", "kimi_linear")},
    **{t: f"a recurrent model: {_RECURRENT}" for t in ("recurrent_gemma", "xlstm", "rwkv")},
}
# BERT-style encoders: refused unless used as a causal LM (is_decoder, a *ForCausalLM / *LMHeadModel
# architecture, or a bare config), which runs layer by layer like any decoder (planned from the generic fields).
ENCODER_ONLY = ("bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
                "modernbert", "camembert", "mpnet", "bert-generation", "big_bird", "data2vec-text", "ernie",
                "megatron-bert", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta-xl", "xmod", "rembert")
_NON_CAUSAL_SUFFIXES = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
                        "ForQuestionAnswering", "ForPreTraining", "ForMultipleChoice")


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config: a nested ``text_config`` (Gemma 3, Llama 4,
    Mistral 3 ...) when the top level has no layers of its own."""
    sub = cfg.get("text_config")
    if isinstance(sub, dict) and not any(k in cfg for k in ("num_hidden_layers", "n_layer", "num_layers")):
        out = dict(sub)
        out.setdefault("model_type", f"{cfg.get('model_type')}_text")
        return out
    return cfg


def reject_non_layerwise(cfg: dict[str, Any], name: str) -> None:
    """UnsupportedModelError for a config that is not a decoder-only stack of attention layers."""
    mt = cfg.get("model_type")
    archs = [a for a in (cfg.get("architectures") or []) if isinstance(a, str)]
    if cfg.get("is_encoder_decoder") or "decoder_layers" in cfg or "num_decoder_layers" in cfg:
        raise UnsupportedModelError(
            f"{name} ({mt}) is an encoder-decoder model: flexplan plans and runs decoder-only causal LMs only")
    if mt in NOT_LAYERWISE:
        raise UnsupportedModelError(f"{name} ({mt}) is {NOT_LAYERWISE[mt]}")
    # a BERT-style stack counts as a decoder when it is configured as one, when its architectures name a
    # causal-LM head, or when no architecture is recorded (a config a causal-LM class was built from)
    causal_head = (cfg.get("is_decoder") or not archs or any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs))
    if (mt in ENCODER_ONLY and not causal_head) or (archs and all(a.endswith(_NON_CAUSAL_SUFFIXES) for a in archs)):
        raise UnsupportedModelError(
            f"{name} ({mt}, {', '.join(archs) or 'no architectures'}) is an encoder-only model, not a causal LM: "
            "flexplan plans and runs decoder-only causal LMs only")
    for key in ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern"):
        kinds = cfg.get(key)
        if isinstance(kinds, str):
            kinds = list(kinds)
        odd = sorted({str(k) for k in (kinds or []) if k not in ATTENTION_LAYER_TYPES})
        if odd and key != "hybrid_override_pattern" or (key == "hybrid_override_pattern" and set(odd) - {"*", "-", "E"}):
            raise UnsupportedModelError(
                f"{name} ({mt}) has {', '.join(map(repr, odd))} layers in {key}: {_RECURRENT}")


def first(cfg: dict[str, Any], *keys: str, default: Any = KeyError) -> Any:
    """The first of ``keys`` with a value in ``cfg`` (aliases of one field), else ``default``."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    if default is KeyError:
        raise KeyError(keys[0])
    return default


def layer_kinds(cfg: dict[str, Any], traits: dict[str, Any], n: int) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window): explicit ``layer_types``, else Gemma-style
    ``sliding_window_pattern``, else Qwen-style ``use_sliding_window`` + ``max_window_layers``,
    else every layer sliding when ``sliding_window`` is set (Mistral, Phi-3, Starcoder2)."""
    window = cfg.get("sliding_window") or cfg.get("window_size")
    window = int(window) if window else None
    explicit = cfg.get("layer_types")
    if not explicit and cfg.get("attention_types"):  # GPT-Neo: [[["global", "local"], 12]]
        names = {"global": "full_attention", "local": "sliding_attention"}
        explicit = [names[k] for kinds, times in cfg["attention_types"] for _ in range(times) for k in kinds]
    if explicit:
        kinds = tuple(str(k) for k in explicit)
        if len(kinds) != n:
            raise ValueError(f"layer_types has {len(kinds)} entries for {n} layers")
    elif window is None:
        kinds = ("full_attention",) * n
    elif cfg.get("use_sliding_window") is False:
        kinds, window = ("full_attention",) * n, None
    elif cfg.get("sliding_window_pattern") or traits.get("window_every"):
        every = int(cfg.get("sliding_window_pattern") or traits["window_every"])
        kinds = tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n))
    elif cfg.get("use_sliding_window") and cfg.get("max_window_layers") is not None:
        start = int(cfg["max_window_layers"])
        kinds = tuple("sliding_attention" if i >= start else "full_attention" for i in range(n))
    else:
        kinds = ("sliding_attention",) * n
    if "sliding_attention" not in kinds:
        window = None
    elif window is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
    return kinds, window


def moe_layer_flags(cfg: dict[str, Any], n: int, num_experts: int) -> tuple[bool, ...]:
    """Which decoder layers hold routed experts: ``mlp_only_layers`` and ``decoder_sparse_step``
    (Qwen-MoE), ``first_k_dense_replace`` (DeepSeek), ``mlp_layer_types``; else all of them."""
    if not num_experts:
        return (False,) * n
    types = cfg.get("mlp_layer_types")
    if types:
        return tuple(t in ("sparse", "moe") for t in types)
    if isinstance(cfg.get("moe_layers"), list):  # Llama 4: indices of the MoE layers
        return tuple(i in set(cfg["moe_layers"]) for i in range(n))
    if cfg.get("moe_layer_interval") is not None:  # ERNIE 4.5
        start, end = int(cfg.get("moe_layer_start_index") or 0), cfg.get("moe_layer_end_index")
        end = n - 1 if end is None or end < 0 else int(end)
        return tuple((i + 1) % int(cfg["moe_layer_interval"]) == 0 and start <= i <= end for i in range(n))
    dense_first = int(cfg.get("first_k_dense_replace") or 0)
    only_mlp = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    return tuple(i >= dense_first and i not in only_mlp and (i + 1) % step == 0 for i in range(n))


def _bias_fields(cfg: dict[str, Any], traits: dict[str, Any], mt: str) -> dict[str, bool]:
    """qkv_bias, o_bias, mlp_bias from attention_bias / qkv_bias / bias / use_bias / enable_bias."""
    bias = cfg.get("bias", cfg.get("use_bias", cfg.get("enable_bias", traits.get("bias"))))
    attn_bias = bool(first(cfg, "attention_bias", "qkv_bias", "use_qkv_bias", default=bias or False))
    qkv_bias = traits.get("qkv_bias", attn_bias)
    if mt in ("stablelm", "qwen2_moe"):
        qkv_bias = bool(first(cfg, "use_qkv_bias", "qkv_bias", default=qkv_bias))
    o_bias = traits.get("o_bias", bool(first(cfg, "attention_out_bias", default=attn_bias)))
    mlp_bias = traits.get("mlp_bias", bool(first(cfg, "mlp_bias", default=bias or False)))
    if mt == "falcon":
        qkv_bias = o_bias = mlp_bias = bool(cfg.get("bias", False))
    return dict(qkv_bias=bool(qkv_bias), o_bias=bool(o_bias), mlp_bias=bool(mlp_bias))


def _block_fields(cfg: dict[str, Any], traits: dict[str, Any], mt: str) -> dict[str, Any]:
    """Norm kind, norms per layer, QK-norm and parallel attention+MLP."""
    norm = traits.get("norm") or ("layer" if any(k in cfg for k in ("layer_norm_eps", "layer_norm_epsilon")) and
                                  "rms_norm_eps" not in cfg else "rms")
    new_falcon = mt == "falcon" and cfg.get("new_decoder_architecture")
    parallel = bool(traits.get("parallel") or cfg.get("use_parallel_residual") or
                    (mt == "falcon" and (cfg.get("parallel_attn") or new_falcon)))
    norms = traits.get("norms", 2)
    if mt == "falcon":
        norms = int(cfg.get("num_ln_in_parallel_attn") or 2) if new_falcon else (1 if parallel else 2)
    elif mt == "stablelm" and parallel:
        norms = 1
    flag = first(cfg, "qk_layernorm", "use_qk_norm", "qk_norm", default=False)
    qk_norm = traits.get("qk_norm", "")
    if qk_norm is None:  # the config's QK-norm holds no parameters (Llama 4's L2 norm)
        qk_norm = ""
    elif mt in ("stablelm", "cohere", "persimmon", "phi"):  # optional QK-norm, switched by the config
        qk_norm = (traits.get("qk_norm") or "head_ln") if flag else ""
    elif flag:
        qk_norm = qk_norm or "head"
    return dict(norm=norm, norm_bias=traits.get("norm_bias", norm == "layer" and not cfg.get("no_bias")),
                norm_affine=traits.get("norm_affine", True), norms_per_layer=norms, qk_norm=qk_norm,
                parallel_block=parallel)


def _moe_fields(cfg: dict[str, Any], traits: dict[str, Any], mt: str, n: int, inter: int) -> dict[str, Any]:
    """Routed experts, experts per token, expert and shared-expert widths, MoE layers."""
    top_k = int(first(cfg, "num_experts_per_tok", "experts_per_token", "moe_topk", "top_k", "num_experts_per_token",
                      "moe_k", "moe_top_k", default=0) or 0)
    e = int(first(cfg, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", default=0) or 0)
    if not (e and top_k):
        return dict(intermediate_size=inter, moe_layers=(False,) * n)
    expert_inter = int(first(cfg, "moe_intermediate_size", "expert_intermediate_size", default=inter))
    shared_inter, shared_gate = 0, False
    n_shared = first(cfg, "n_shared_experts", "moe_num_shared_experts", "num_shared_experts", default=0)
    if cfg.get("shared_expert_intermediate_size"):
        shared_inter, shared_gate = int(cfg["shared_expert_intermediate_size"]), mt == "qwen2_moe"
    elif n_shared:
        shared_inter = int(n_shared) * expert_inter
    if traits.get("shared_ffn"):
        shared_inter = int(cfg[traits["shared_ffn"]])
    if traits.get("dense_ffn"):
        inter = int(cfg[traits["dense_ffn"]])
    return dict(intermediate_size=inter, num_experts=e, experts_per_token=top_k, expert_intermediate_size=expert_inter,
                shared_expert_intermediate_size=shared_inter, shared_expert_gate=shared_gate,
                moe_layers=moe_layer_flags(cfg, n, e), router_bias=traits.get("router_bias", False),
                expert_bias=traits.get("expert_bias", False))


def spec_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelSpec keyword arguments (all but ``name``) from a flat decoder config dict."""
    mt = str(cfg.get("model_type") or "unknown")
    traits = TRAITS.get(mt, {})
    defaults = traits.get("defaults", {})
    cfg = {**defaults, **{k: v for k, v in cfg.items() if v is not None or k not in defaults}}
    for sub in ("attn_config", "ffn_config"):  # DBRX nests attention and MoE fields
        if isinstance(cfg.get(sub), dict):
            cfg = {**cfg[sub], **cfg}
    n = int(first(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers"))
    h = int(first(cfg, "hidden_size", "n_embd", "d_model", "dim"))
    heads = int(first(cfg, "num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads"))
    if heads <= 0:
        raise ValueError(f"num_attention_heads must be positive, got {heads}")
    kv_heads = first(cfg, "num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num",
                     "kv_n_heads", default=None)
    if "multi_query" in cfg and not (mt == "falcon" and cfg.get("new_decoder_architecture")):
        kv_heads = 1 if cfg.get("multi_query") else heads  # GPT-BigCode, Falcon-7B: the flag decides
    elif kv_heads is None:
        kv_heads = heads
    head_dim = int(cfg.get("head_dim") or h // heads)
    ffn_keys = ("intermediate_size", "ffn_dim", "ffn_hidden_size", "n_inner", "dff")
    if traits.get("ffn_4h") or (any(k in cfg for k in ffn_keys) and all(cfg.get(k) is None for k in ffn_keys)):
        inter = 4 * h  # GPT-2 / GPT-J / Falcon: n_inner / ffn_hidden_size None means 4 x hidden
    elif cfg.get("intermediate_multiple_size"):  # GPT-NeoX-Japanese
        inter = h * int(cfg["intermediate_multiple_size"])
    elif not any(k in cfg for k in ffn_keys) and cfg.get("moe_intermediate_size"):
        inter = int(cfg["moe_intermediate_size"])  # every layer MoE: no dense width given
    else:
        inter = int(first(cfg, *ffn_keys))
    v_head_dim = int(cfg.get("v_head_dim") or head_dim)
    mla = {}
    if cfg.get("kv_lora_rank"):  # DeepSeek MLA
        rope = int(cfg["qk_rope_head_dim"])
        head_dim = int(cfg["qk_nope_head_dim"]) + rope
        kv_heads = heads  # K and V per head after the up-projection (unless the latent is cached)
        mla = dict(kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                   qk_rope_head_dim=rope, kv_latent=mt in LATENT_KV_MODEL_TYPES)
    kinds, window = layer_kinds(cfg, traits, n)
    learned_rows = 0
    if "learned_pos" in traits:
        learned_rows = int(first(cfg, "max_position_embeddings", "n_positions")) + traits["learned_pos"]
    out = dict(
        family=mt, num_layers=n, hidden_size=h, num_heads=heads, num_kv_heads=int(kv_heads), head_dim=head_dim,
        v_head_dim=v_head_dim, vocab_size=int(first(cfg, "vocab_size", "padded_vocab_size")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), gated_mlp=traits.get("gated", True),
        max_position_embeddings=int(first(cfg, "max_position_embeddings", "n_positions", "max_sequence_length",
                                          "seq_length", default=4096)),
        learned_pos_embeddings=learned_rows, attention_sinks=traits.get("sinks", False),
        lm_head_bias=traits.get("lm_head_bias", False), layer_types=kinds, sliding_window=window,
        attention_chunk_size=int(cfg["attention_chunk_size"]) if "chunked_attention" in kinds else None,
        extra_layer_params=traits["extra"](h, inter, head_dim) if "extra" in traits else 0,
        embedding_norm=bool(traits.get("embed_norm")), final_norm=traits.get("final_norm", True),
        **_bias_fields(cfg, traits, mt), **_block_fields(cfg, traits, mt), **_moe_fields(cfg, traits, mt, n, inter),
        **mla,
    )
    if mt == "opt":
        proj = cfg.get("word_embed_proj_dim", h)
        out.update(word_embed_proj_dim=None if proj in (None, h) else int(proj),
                   norm_affine=bool(cfg.get("layer_norm_elementwise_affine", True)),
                   final_norm=bool(cfg.get("do_layer_norm_before", True)) and not cfg.get("_remove_final_layer_norm", False))
    return out
