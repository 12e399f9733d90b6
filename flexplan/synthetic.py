"""Random-weight models built from configs, for benchmarks and validation (no hub is reachable).

``random_llama_dir()`` writes, once, a Llama with TinyLlama's widths (hidden 2048, intermediate
5632, GQA 32/8 heads, vocab 32000, untied LM head) and 8 layers: 491.8M parameters, 1.97 GB in
fp32, into the flexplan cache, as a normal HF folder (config.json + model.safetensors);
``random_llama_bf16_dir()`` the same weights rounded to a bf16 checkpoint.
``random_model_dir(name, config)`` does the same for any config (``LLAMA2_7B_CONFIG``: a
Llama-2-7B-shaped model in bf16 for the GPU offloading benchmark), tensor by tensor.
Folders are written under a temporary name and renamed into place: never half-written.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from flexplan.executor.loading import build_skeleton
from flexplan.smollm import cache_dir
from flexplan.workload import ModelSpec

RANDOM_LLAMA_CONFIG: dict[str, Any] = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=5632,
    num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, pad_token_id=0, hidden_act="silu", torch_dtype="float32",
)
RANDOM_LLAMA_NAME = "random-llama-1GB-fp32"


def llama_params(cfg: dict[str, Any]) -> int:
    return ModelSpec.from_config(cfg, name="random-llama").total_params


LLAMA2_7B_CONFIG: dict[str, Any] = dict(
    RANDOM_LLAMA_CONFIG, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, torch_dtype="bfloat16")
SHARD_BYTES = 2 << 30


def random_llama_dir(seed: int = 0) -> Path:
    """Folder of the >= 1 GB random-weight fp32 Llama, created on first use."""
    n_params = llama_params(RANDOM_LLAMA_CONFIG)
    assert 4 * n_params >= 1e9, f"random Llama holds {4 * n_params / 1e9:.2f} GB, want >= 1 GB"
    return random_model_dir(RANDOM_LLAMA_NAME, RANDOM_LLAMA_CONFIG, seed)


def random_llama_bf16_dir(seed: int = 0) -> Path:
    """The same random Llama as :func:`random_llama_dir` (same seed: its weights rounded to
    bf16) as a bf16 checkpoint, 0.98 GB, created on first use."""
    return random_model_dir("random-llama-bf16", dict(RANDOM_LLAMA_CONFIG, torch_dtype="bfloat16"),
                            seed)


def random_model_dir(name: str, config: dict[str, Any], seed: int = 0) -> Path:
    """``<cache>/models/<name>``: an HF folder with random weights for ``config`` (its
    ``torch_dtype``), written on first use, shard by shard (host memory: one tensor at a time)."""

    target = cache_dir() / "models" / name
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    write_random_model(config, target, seed)
    return target


def _init_tensor(name: str, shape: tuple[int, ...], dtype, generator):
    """As transformers initialises Llama: normal(0, 0.02) matrices, ones for norms, zeros for biases."""
    import torch

    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype)
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator).to(dtype)


def write_random_model(config: dict[str, Any], target: Path, seed: int = 0, shard_bytes: int = SHARD_BYTES) -> None:
    """Write config.json, generation_config.json and safetensors shards (with an index when
    there is more than one) under a temporary name, then rename into ``target``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig


    cfg_args = {k: v for k, v in config.items() if k != "architectures"}
    dtype_name = cfg_args.pop("torch_dtype", "float32")
    dtype = getattr(torch, dtype_name)
    cfg = AutoConfig.for_model(**cfg_args)
    cfg.architectures = list(config.get("architectures", []))
    cfg.dtype = dtype_name
    shapes = [(n, tuple(p.shape)) for n, p in build_skeleton(cfg).named_parameters()]
    elem = torch.empty((), dtype=dtype).element_size()
    total = sum(elem * math.prod(shape) for _, shape in shapes)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        n = elem * math.prod(shape)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    print(f"creating random-weight {config.get('model_type', 'model')} ({total / elem / 1e6:.0f}M params, "
          f"{total / 1e9:.2f} GB {dtype_name}, {len(shards)} shard(s)) in {target}", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        generator = torch.Generator().manual_seed(seed)
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {name: _init_tensor(name, shape, dtype, generator) for name, shape in shard}
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in tensors})
            del tensors
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        cfg.save_pretrained(tmp)
        GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                         pad_token_id=cfg.pad_token_id).save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
