"""A GGUF file's model, as the planner sees it: its transformers config and how its weights are stored.

:func:`hf_config_dict` turns the header's metadata (:mod:`flexplan.workload.gguf_header`) into the
config dict transformers builds for the same file (``AutoConfig.from_pretrained(dir, gguf_file=)``):
transformers' own key tables (``GGUF_CONFIG_MAPPING``, its per-architecture defaults and its
architecture-specific config builders) applied as ``load_gguf_checkpoint`` applies them, without its
reader, which parses every vocabulary string (seconds for a 49k-token vocabulary). Additions
(:data:`ADDED_KEYS`): widths llama.cpp writes that transformers' table leaves unread for some
architectures (qwen3's ``attention.key_length``, qwen3moe's ``expert_feed_forward_length``, gpt-oss's
``attention.sliding_window``), where
the config class's default would otherwise stand in for the file's value. Tests hold the result
equal to transformers' reading wherever transformers reads the file right.

:func:`stored_weights` is the hook for pricing compressed weights: per operator group (the groups of
``ModelSpec.layer_group_params``, plus "embedding", "lm_head" and "final_norm"), which GGUF format
holds how many of its parameters. A tied head reads the embedding's blocks and has no entry.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from flexplan.errors import InvalidInputError, UnsupportedModelError
from flexplan.quant.formats import GGML_TYPE_NAMES, GGUF_FORMATS
from flexplan.workload.gguf_header import GGUFHeader, read_header
from flexplan.workload.model import ModelSpec

# transformers names some GGUF architectures differently (load_gguf_checkpoint's renames)
_HF_ARCHITECTURE = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
# llama.cpp writes Mixtral as "llama" with experts (convert_hf_to_gguf's LlamaModel converts
# MixtralForCausalLM), and transformers reads every "llama" file as a dense Llama, which has no experts:
# a "llama" file with a positive llama.expert_count is read as Mixtral, Llama's keys plus the experts'
_LLAMA_WITH_EXPERTS = ("mixtral", {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"})
# architectures whose head ties to the embedding whatever the file holds (load_gguf_checkpoint's exceptions)
_ALWAYS_TIED = ("falcon", "bloom")
# llama.cpp's keys (after the architecture) -> the config field they set, where transformers' table
# sets that field from no key the file holds (gpt_oss's table reads "sliding_window", llama.cpp writes
# "attention.sliding_window"): the config class's default would stand in for the file's value
ADDED_KEYS = {"attention.key_length": "head_dim", "expert_feed_forward_length": "moe_intermediate_size",
              "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
              "attention.sliding_window": "sliding_window"}
# llama.cpp's DeepSeek keys (convert_hf_to_gguf's DeepseekV2Model: V2, V2-Lite, V3, R1, Kimi K2 all write
# "deepseek2"), which transformers' table does not read: key after the architecture -> config field. The
# head widths, rope scaling and router kind follow from several keys (_deepseek2)
_DEEPSEEK2_KEYS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size", "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size", "expert_count": "n_routed_experts", "expert_used_count": "num_experts_per_tok",
    "expert_shared_count": "n_shared_experts", "expert_feed_forward_length": "moe_intermediate_size",
    "leading_dense_block_count": "first_k_dense_replace", "expert_weights_scale": "routed_scaling_factor",
    "expert_weights_norm": "norm_topk_prob", "attention.q_lora_rank": "q_lora_rank",
    "attention.kv_lora_rank": "kv_lora_rank", "rope.dimension_count": "qk_rope_head_dim",
    "expert_group_count": "n_group", "expert_group_used_count": "topk_group"}
_DEEPSEEK2_REQUIRED = ("block_count", "embedding_length", "attention.head_count", "rope.dimension_count",
                       "attention.kv_lora_rank")
_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax)
# GGUF's tensor names (gguf-py's constants.py TENSOR_NAMES) to ModelSpec's operator groups, first match wins
_GROUPS = (
    (r"token_embd\.", "embedding"), (r"output_norm\.", "final_norm"), (r"output\.", "lm_head"),
    (r"blk\.\d+\.attn_(q|k|v|qkv|output|q_norm|k_norm|sinks|q_a|q_b|kv_a_mqa|kv_b|k_b|v_b|q_a_norm|kv_a_norm)\.",
     "attention"),
    (r"blk\.\d+\.ffn_gate_inp_shexp\.", "shared_experts"), (r"blk\.\d+\.(ffn_gate_inp|exp_probs_b)\.", "router"),
    (r"blk\.\d+\.ffn_\w+_exps\.", "experts"), (r"blk\.\d+\.ffn_\w+_shexp\.", "shared_experts"),
    (r"blk\.\d+\.ffn_(gate|up|down)\.", "mlp"), (r"blk\.\d+\.\w*norm\w*\.", "norms"),
)


def _single(value):
    """transformers reads a one-element array as its element (``load_gguf_checkpoint``)."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


@lru_cache(maxsize=64)
def _declared_fields(model_type: str | None) -> frozenset[str]:
    """The fields the config class of ``model_type`` declares (an added key sets only those: gpt-oss's
    experts are ``intermediate_size`` wide, it has no ``moe_intermediate_size``)."""
    from transformers import CONFIG_MAPPING

    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        return frozenset()
    return frozenset(inspect.signature(cls.__init__).parameters) | frozenset(getattr(cls, "__dataclass_fields__", ()))


def hf_config_dict(header: GGUFHeader) -> dict:
    """The transformers config dict of the file ``header`` describes (see the module docstring)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    try:  # transformers' per-architecture config builders (qwen35, lfm2, ...), newer than 5.0
        from transformers.integrations.gguf.gguf_config_mapping import GGUF_CONFIG_ARCHS, get_gguf_config
    except ImportError:
        GGUF_CONFIG_ARCHS, get_gguf_config = {}, None
    md, arch = header.metadata, header.architecture
    if not arch:
        raise InvalidInputError(f"{header.path}: the GGUF metadata names no general.architecture")
    if arch in GGUF_CONFIG_ARCHS:  # transformers' own builder for this architecture
        return get_gguf_config(md, header.tensor_names)
    if arch == "deepseek2":
        return _vocab_from_tokens(_deepseek2(header, GGUF_CONFIG_MAPPING["tokenizer"]), md)
    name = md.get("general.name")
    # transformers loads a "llama" file named exactly "mistral" as Mistral (llama.cpp writes Mistral as llama)
    hf_arch = "mistral" if "llama" in arch and name == "mistral" else _HF_ARCHITECTURE.get(arch, arch)
    tables = GGUF_CONFIG_MAPPING
    if arch == "llama" and int(_single(md.get("llama.expert_count")) or 0) > 0:
        hf_arch, experts = _LLAMA_WITH_EXPERTS
        tables = {**GGUF_CONFIG_MAPPING, hf_arch: {**GGUF_CONFIG_MAPPING["llama"], **experts}}
    if hf_arch not in tables:
        known = sorted(k for k in GGUF_CONFIG_MAPPING if k not in ("general", "tokenizer"))
        raise UnsupportedModelError(f"{header.path}: GGUF architecture {arch!r} has no transformers config mapping; "
                                    f"transformers reads {', '.join(known + sorted(GGUF_CONFIG_ARCHS))}")
    cfg: dict = {"tie_word_embeddings": "output.weight" not in header.tensor_names or arch in _ALWAYS_TIED}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(hf_arch, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        cfg.setdefault(key, value)
    read = set()  # the config fields transformers' table set from this file's keys
    for key, value in md.items():
        prefix, _, rest = key.replace(arch, hf_arch).partition(".")
        target = tables.get(prefix, {}).get(rest)
        if target is None or target == -1:
            continue
        value = _single(value)
        cfg[target] = value.replace(arch, hf_arch) if isinstance(value, str) and arch in value else value
        read.add(target)
    declared = _declared_fields(cfg.get("model_type"))
    for key, target in ADDED_KEYS.items():
        value = md.get(f"{arch}.{key}")
        if value is not None and target not in read and target in declared:
            # llama.cpp writes a window of 0 for none (convert_hf_to_gguf on a config without one)
            cfg[target] = None if target == "sliding_window" and int(_single(value)) == 0 else int(_single(value))
    if cfg.get("model_type") == "gemma3":  # a Gemma 3 GGUF holds the text model only
        cfg["model_type"] = "gemma3_text"
    return _vocab_from_tokens(cfg, md)


def _vocab_from_tokens(cfg: dict, md: dict) -> dict:
    """``cfg`` with the vocabulary's size from the token list where no key gave it."""
    if "vocab_size" not in cfg and isinstance(md.get("tokenizer.ggml.tokens"), (int, list)):
        tokens = md["tokenizer.ggml.tokens"]
        cfg["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    return cfg


def _deepseek2(header: GGUFHeader, tokenizer_keys: dict) -> dict:
    """The config of a llama.cpp "deepseek2" file (transformers reads none): DeepSeek-V3's (sigmoid
    router with a score-correction bias: V3, R1, Kimi K2) or V2's (softmax router: V2, V2-Lite). The
    converter writes MLA as one key/value head of the latent's width; the per-head widths are in the
    ``_mla`` keys (files before them: in key_length / value_length), and YaRN's ``mscale_all_dim`` as
    ``yarn_log_multiplier`` / 0.1 (llama.cpp's convention; ``mscale`` the same, as DeepSeek's configs set them)."""
    md, a = header.metadata, "deepseek2."

    def key(name, default=None):
        value = md.get(a + name)
        return default if value is None else _single(value)

    missing = [a + k for k in _DEEPSEEK2_REQUIRED if a + k not in md]
    if missing or (a + "attention.key_length_mla" not in md and a + "attention.key_length" not in md):
        raise InvalidInputError(f"{header.path}: a deepseek2 file without {', '.join(missing) or a + 'attention.key_length'}"
                                "; its metadata is incomplete (convert it again with llama.cpp's convert_hf_to_gguf.py)")
    cfg = {field: _single(md[a + k]) for k, field in _DEEPSEEK2_KEYS.items() if a + k in md}
    cfg.update({field: _single(md[f"tokenizer.{k}"]) for k, field in tokenizer_keys.items() if f"tokenizer.{k}" in md})
    rope = int(key("rope.dimension_count"))
    if key("attention.key_length_mla") is not None:
        nope, v = int(key("attention.key_length_mla")) - rope, int(key("attention.value_length_mla"))
    else:
        nope, v = int(key("attention.key_length")) - rope, int(key("attention.value_length"))
    heads = int(cfg["num_attention_heads"])
    sigmoid = (key("expert_gating_func") == _SIGMOID_GATING
               or (key("expert_gating_func") is None and any(n.endswith("exp_probs_b.bias") for n in header.tensor_names)))
    groups = int(cfg.get("n_group") or 1)
    cfg.update(model_type="deepseek_v3" if sigmoid else "deepseek_v2", num_key_value_heads=heads,
               qk_nope_head_dim=nope, v_head_dim=v, q_lora_rank=cfg.get("q_lora_rank"), n_group=groups,
               topk_group=int(cfg.get("topk_group") or 1), norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
               tie_word_embeddings="output.weight" not in header.tensor_names)
    if not sigmoid:
        cfg["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    theta = float(cfg.pop("rope_theta", 10000.0))
    rope_parameters = {"rope_type": "default", "rope_theta": theta}
    if key("rope.scaling.type") == "yarn":
        mscale = round(float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)  # stored as float32
        rope_parameters = {"rope_type": "yarn", "rope_theta": theta, "factor": float(key("rope.scaling.factor")),
                           "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
                           "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
                           "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)),
                           "mscale": mscale, "mscale_all_dim": mscale}
    cfg["rope_parameters"] = rope_parameters
    return cfg


def hf_config(header: GGUFHeader):
    """The transformers ``PretrainedConfig`` of the file (the config class's defaults filled in)."""
    from transformers import AutoConfig

    cfg = dict(hf_config_dict(header))
    try:
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    except (KeyError, ValueError) as e:
        raise UnsupportedModelError(f"{header.path}: transformers has no config class for it ({e})") from None


def _format_name(ggml_type: int) -> str:
    fmt = GGUF_FORMATS.get(ggml_type)
    return fmt.name if fmt is not None else GGML_TYPE_NAMES.get(ggml_type, f"GGML type {ggml_type}")


# MLA's kv_b_proj as llama.cpp's converter (since its MLA absorption) writes it: attn_k_b [heads,
# kv_lora_rank, nope] (each head's key rows transposed) and attn_v_b [heads, v, kv_lora_rank]. The loader
# (flexplan.quant.gguf_model) puts them back together dequantised, so they are priced and placed as F32
KV_B_HALVES = ("attn_k_b", "attn_v_b")
_HELD_FLOAT = re.compile(rf"blk\.\d+\.({'|'.join(KV_B_HALVES)})\.")


def stored_weights(header: GGUFHeader) -> tuple[tuple[str, str, int], ...]:
    """(operator group, GGUF format, parameters) for every group and format the file holds, sorted
    (as the loader holds them: :data:`_HELD_FLOAT` tensors as F32)."""
    counts: dict[tuple[str, str], int] = {}
    for t in header.tensors:
        group = next((g for pattern, g in _GROUPS if re.match(pattern, t.name)), "other")
        key = (group, "F32" if _HELD_FLOAT.match(t.name) else _format_name(t.ggml_type))
        counts[key] = counts.get(key, 0) + t.numel
    return tuple(sorted((g, f, n) for (g, f), n in counts.items()))


@lru_cache(maxsize=16)
def _spec(path: str, size_bytes: int, mtime_ns: int) -> ModelSpec:
    header = read_header(path)
    spec = ModelSpec.from_config(hf_config(header), name=Path(path).name)
    return replace(spec, stored_weights=stored_weights(header))


def spec_from_gguf(path: str | Path) -> ModelSpec:
    """The ModelSpec of GGUF file ``path``, named after the file, from its header alone (cached per
    file version: a run resolves its model several times)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise InvalidInputError(f"{path}: no such GGUF file; pass the path of a .gguf file")
    st = p.stat()
    return _spec(str(p.resolve()), st.st_size, st.st_mtime_ns)
