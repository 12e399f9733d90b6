"""Random-weight models built from configs, for benchmarks and validation (no hub is reachable).

``random_llama_dir()`` writes, once, a Llama with TinyLlama's widths (hidden 2048, intermediate
5632, GQA 32/8 heads, vocab 32000, untied LM head) and 8 layers: 491.8M parameters, 1.97 GB in
fp32, into the flexplan cache, as a normal HF folder (config.json + model.safetensors).
The folder is written under a temporary name and renamed into place: never half-written.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

RANDOM_LLAMA_CONFIG: dict[str, Any] = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=5632,
    num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, pad_token_id=0, hidden_act="silu", torch_dtype="float32",
)
RANDOM_LLAMA_NAME = "random-llama-1GB-fp32"


def llama_params(cfg: dict[str, Any]) -> int:
    from flexplan.workload import ModelSpec

    return ModelSpec.from_config(cfg, name="random-llama").total_params


def random_llama_dir(seed: int = 0) -> Path:
    """Folder of the >= 1 GB random-weight fp32 Llama, created on first use."""
    from flexplan.smollm import cache_dir

    target = cache_dir() / "models" / RANDOM_LLAMA_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    n_params = llama_params(RANDOM_LLAMA_CONFIG)
    assert 4 * n_params >= 1e9, f"random Llama holds {4 * n_params / 1e9:.2f} GB, want >= 1 GB"
    print(f"creating random-weight Llama ({n_params / 1e6:.0f}M params, {4 * n_params / 1e9:.2f} GB fp32) in {target}",
          file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{RANDOM_LLAMA_NAME}.tmp-", dir=target.parent))
    try:
        torch.manual_seed(seed)
        cfg = {k: v for k, v in RANDOM_LLAMA_CONFIG.items() if k not in ("model_type", "architectures", "torch_dtype")}
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32)
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model.save_pretrained(tmp, safe_serialization=True)
        del model
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
