"""Small GGUF files for the tests, written with the ``gguf`` package's GGUFWriter from tiny random
transformers models: what llama.cpp's ``convert_hf_to_gguf.py`` writes for the same models (its
metadata keys, tensor names, Llama's q/k row permutation, Gemma's norms stored as ``w + 1``, a
MoE's experts stacked per layer), without llama.cpp, so the tests that use them always run.

The tokenizer is byte-level BPE (``tokenizer.ggml.model`` "gpt2") over the 256 byte symbols, two
merges and an end-of-text token: 259 tokens, the vocabulary of every model here.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

VOCAB_SIZE = 259
EOS_ID = 258
# transformers model_type -> the GGUF architecture llama.cpp's converter writes it as
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
             "qwen3_moe": "qwen3moe", "mixtral": "llama", "gpt_oss": "gpt-oss", "qwen2_moe": "qwen2moe",
             "gemma2": "gemma2", "phi3": "phi3", "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2"}
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "gemma2",
         "phi3", "deepseek_v3", "deepseek_v2")


_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=16, moe_intermediate_size=32,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def tiny_model(arch: str, seed: int = 0):
    """A random float32 causal LM of family ``arch`` (hidden 64, 2 layers; every linear's input a
    multiple of 32, so each quantises to whole blocks), weights spread enough that the top token is
    not a coin toss."""
    import transformers
    from transformers import AutoModelForCausalLM

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=EOS_ID,
                  eos_token_id=EOS_ID, pad_token_id=EOS_ID, initializer_range=0.2)
    config = {
        "llama": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=True),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False),
        "qwen2": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False),
        "gemma3": lambda: transformers.Gemma3TextConfig(**common, head_dim=16, sliding_window=4,
                                                       query_pre_attn_scalar=256),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=32,
                                                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                                         tie_word_embeddings=False),
        "gpt_oss": lambda: transformers.GptOssConfig(**{**common, "intermediate_size": 32,
                                                        "max_position_embeddings": 131072}, head_dim=16,
                                                     num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                                     tie_word_embeddings=False),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**common, moe_intermediate_size=32,
                                                         shared_expert_intermediate_size=64, num_experts=4,
                                                         num_experts_per_tok=2, tie_word_embeddings=False),
        "gemma2": lambda: transformers.Gemma2Config(**common, head_dim=16, sliding_window=4, query_pre_attn_scalar=256),
        "phi3": lambda: transformers.Phi3Config(**common, tie_word_embeddings=False),  # fused qkv and gate_up
        "mixtral": lambda: transformers.MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=4,
                                                      num_experts_per_tok=2, tie_word_embeddings=False),
        # MLA (a latent of 32, per head 32 + 16 rotary key and 16 value widths), a dense first layer, then
        # routed experts beside a shared one: V3's sigmoid router with a score-correction bias in two groups
        # and YaRN rope, V2's softmax router without a q LoRA
        "deepseek_v3": lambda: transformers.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, **_MLA,
                                                             q_lora_rank=32, n_group=2, topk_group=1,
                                                             routed_scaling_factor=2.5, norm_topk_prob=True,
                                                             rope_parameters=_YARN, tie_word_embeddings=False),
        "deepseek_v2": lambda: transformers.DeepseekV2Config(**{**common, "num_key_value_heads": 4}, **_MLA,
                                                             q_lora_rank=None, topk_method="greedy",
                                                             tie_word_embeddings=False),
    }[arch]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms (and DeepSeek-V3's router bias) away from their initial constant, so a misplaced one shows
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if p.dim() == 1 and p.is_floating_point() and (name.endswith("e_score_correction_bias")
                                                           or not name.endswith(("inv_freq", "_bias"))):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [bytes_to_unicode()[b] for b in range(256)]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotary halves interleaved, rows [n_head, dim, 2]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _shape_metadata(w: gguf.GGUFWriter, config, kv_heads: int) -> None:
    """The keys every converter writes: layers, context, widths, heads, the norms' epsilon."""
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)


def _metadata(w: gguf.GGUFWriter, config, arch: str, name: str) -> None:
    w.add_name(name)
    if arch == "deepseek2":
        _deepseek2_metadata(w, config)
        return
    _shape_metadata(w, config, config.num_key_value_heads)
    rope = config.rope_parameters
    w.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])  # Gemma 3: the global layers' base
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    if config.to_dict().get("head_dim") is not None:  # the converter writes the widths a config states
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(config.sliding_window)
    if arch == "phi3":  # the converter's Phi3MiniModel: 0 where the config has no window
        w.add_sliding_window(config.sliding_window or 0)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == "gpt-oss":  # the converter's GptOssModel: its window and experts (rope: the class's YaRN defaults)
        w.add_sliding_window(config.sliding_window)
        w.add_expert_count(config.num_local_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.intermediate_size)
    if config.model_type == "mixtral":  # the converter's LlamaModel: the experts' count, their width is the FFN's
        w.add_expert_count(config.num_local_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
    w.add_vocab_size(config.vocab_size)
    _tokenizer_metadata(w)


def _tokenizer_metadata(w: gguf.GGUFWriter) -> None:
    tokens = _byte_tokens() + ["\u0120t", "he", "<|endoftext|>"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(["\u0120 t", "h e"])
    w.add_bos_token_id(EOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(EOS_ID)


def _deepseek2_metadata(w: gguf.GGUFWriter, config) -> None:
    """convert_hf_to_gguf.py's DeepseekV2Model (V2 and V3): MLA as one key/value head of the latent's
    width, the per-head widths in the _mla keys, YaRN's mscale_all_dim as 0.1 x yarn_log_multiplier, the
    router's kind as the gating function (a V3 config's scoring_func "sigmoid")."""
    _shape_metadata(w, config, 1)
    rope = config.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_leading_dense_block_count(config.first_k_dense_replace)
    w.add_vocab_size(config.vocab_size)
    if config.q_lora_rank is not None:
        w.add_q_lora_rank(config.q_lora_rank)
    w.add_kv_lora_rank(config.kv_lora_rank)
    w.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    w.add_value_length(config.kv_lora_rank)
    w.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    w.add_value_length_mla(config.v_head_dim)
    w.add_expert_feed_forward_length(config.moe_intermediate_size)
    w.add_expert_count(config.n_routed_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_expert_shared_count(config.n_shared_experts)
    w.add_expert_weights_scale(config.routed_scaling_factor)
    if config.model_type == "deepseek_v3":
        w.add_expert_weights_norm(config.norm_topk_prob)
        w.add_expert_group_count(config.n_group)
        w.add_expert_group_used_count(config.topk_group)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_rope_dimension_count(config.qk_rope_head_dim)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    _tokenizer_metadata(w)


def _tensors(model, arch: str, experts_apart: bool = False):
    """(GGUF name, float32 array) for every tensor the converter writes, in torch order; routed
    experts stacked per layer, or (``experts_apart``) one tensor per expert as converters wrote
    Mixtral before April 2024 (``blk.N.ffn_gate.E.weight``)."""
    config = model.config
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     config.num_hidden_layers)
    for hf_name, p in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        value = p.detach().float().numpy().copy()
        if ".experts." in hf_name and hf_name.endswith(("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")):
            layer = hf_name.split(".layers.")[1].split(".")[0]
            suffix = "bias" if hf_name.endswith("_bias") else "weight"
            if arch == "gpt-oss" and suffix == "weight":
                value = value.swapaxes(1, 2)  # transformers holds gpt-oss's experts [E, in, out]
            if "gate_up_proj" not in hf_name:
                stacks = {"ffn_down": value}
            elif arch == "gpt-oss":  # GptOssModel.modify_tensors: gate the even rows, up the odd ones
                stacks = {"ffn_gate": value[:, 0::2], "ffn_up": value[:, 1::2]}
            else:
                stacks = dict(zip(("ffn_gate", "ffn_up"), np.split(value, 2, axis=1)))
            for kind, stack in stacks.items():
                if experts_apart:
                    yield from ((f"blk.{layer}.{kind}.{e}.{suffix}", stack[e]) for e in range(stack.shape[0]))
                else:
                    yield f"blk.{layer}.{kind}_exps.{suffix}", np.ascontiguousarray(stack)
            continue
        if hf_name.endswith("kv_b_proj.weight") and arch == "deepseek2":  # DeepseekV2Model: k_b transposed, v_b
            heads, nope = config.num_attention_heads, config.qk_nope_head_dim
            kv_b = value.reshape(heads, nope + config.v_head_dim, -1)
            base = names.get_name(hf_name.removesuffix(".weight"))
            yield base.replace("attn_kv_b", "attn_k_b") + ".weight", np.ascontiguousarray(kv_b[:, :nope].swapaxes(1, 2))
            yield base.replace("attn_kv_b", "attn_v_b") + ".weight", np.ascontiguousarray(kv_b[:, nope:])
            continue
        if hf_name.endswith("e_score_correction_bias"):  # the converter's name: exp_probs_b, with .bias
            yield names.get_name(hf_name.removesuffix("_bias")) + ".bias", value
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(f"no GGUF name for {hf_name}")
        if not gguf_name.endswith((".weight", ".bias")):  # a bare parameter (gpt-oss's sinks): filter_tensors adds it
            gguf_name += ".weight"
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
            value = _permute(value, heads)
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            value = value.reshape(-1)  # the converter writes the shared expert's one-row gate 1-D
        if arch in ("gemma2", "gemma3") and "norm" in gguf_name:
            value = value + 1  # transformers' Gemma RMSNorm scales by (1 + w); llama.cpp stores w + 1
        yield gguf_name, value


def _rope_freqs(config) -> np.ndarray | None:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: the "llama3" rope scaling as one
    divisor per rotary frequency (``rope_freqs.weight``); None for other scalings."""
    import math

    rope = config.rope_parameters
    if rope.get("rope_type", "").lower() != "llama3":
        return None
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def write_gguf(model, path, qtype: str = "F32", name: str | None = None, experts_apart: bool = False,
               experts_qtype: str | None = None) -> None:
    """``model`` as a GGUF file: 2-D weights in ``qtype`` (F32, F16, Q8_0, Q4_0, Q4_1: gguf's own
    quantisers), 1-D tensors, experts' stacks (in ``experts_qtype`` where given, e.g. MXFP4 as
    gpt-oss's files hold them) and the F32 choice as float32; ``experts_apart``: see :func:`_tensors`."""
    config = model.config
    arch = GGUF_ARCH[config.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, config, arch, name or f"tiny-{config.model_type}")
    q = gguf.GGMLQuantizationType[qtype]
    for gguf_name, value in _tensors(model, arch, experts_apart):
        weight = gguf_name.endswith(".weight")  # biases stay float32, as the converter keeps them
        if weight and value.ndim == 3 and experts_qtype is not None:
            eq = gguf.GGMLQuantizationType[experts_qtype]
            w.add_tensor(gguf_name, gguf.quants.quantize(value, eq), raw_dtype=eq)
        elif weight and value.ndim == 2 and q not in (gguf.GGMLQuantizationType.F32,):
            data = value.astype(np.float16) if q == gguf.GGMLQuantizationType.F16 else gguf.quants.quantize(value, q)
            w.add_tensor(gguf_name, data, raw_dtype=q)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(value, dtype=np.float32))
    if arch == "llama" and (factors := _rope_freqs(config)) is not None:
        w.add_tensor("rope_freqs.weight", factors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def file_and_folder(root, arch: str = "llama", qtype: str = "Q8_0"):
    """A tiny ``arch`` model as a ``qtype`` GGUF file under ``root`` and as the HuggingFace folder of
    the same float32 model with the file's tokenizer: (file, folder)."""
    from flexplan.quant.gguf_model import gguf_config_and_tokenizer

    model = tiny_model(arch)
    path = root / f"tiny-{arch}.{qtype}.gguf"
    write_gguf(model, path, qtype)
    folder = root / f"tiny-{arch}"
    model.save_pretrained(folder)
    gguf_config_and_tokenizer(path)[1].save_pretrained(folder)
    return path, folder
