"""Load a model folder (config.json + *.safetensors) straight into its final places.

The module skeleton is built on the meta device (parameters only; small buffers such as the
rotary frequencies are computed for real), then the shards are read tensor by tensor with
``safe_open`` and copied directly into each unit's flat buffers (pinned host, CPU-dtype host or
accelerator). Peak host memory stays near the model's placed size plus one tensor, instead of
a full model loaded first and copied again.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flexplan.errors import InvalidInputError, MalformedDataError
from flexplan.executor.families import check_supported
from flexplan.executor.link import Link
from flexplan.plan_types import Plan


def is_model_folder(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def read_config(path):
    from transformers import AutoConfig

    p = Path(path)
    if not (p / "config.json").is_file():
        raise InvalidInputError(f"{p} is not a model folder: it has no config.json (expected config.json + *.safetensors)")
    try:
        return AutoConfig.from_pretrained(str(p))
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise MalformedDataError(f"cannot read {p / 'config.json'}: {e}") from None


def build_skeleton(config) -> torch.nn.Module:
    """The ``*ForCausalLM`` module tree with parameters on meta (no memory) and real buffers."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    check_supported(config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


class SafetensorsSource:
    """``source(name) -> tensor``: one tensor read from the shard that holds it."""

    def __init__(self, folder, tied: dict[str, str] | None = None):
        from safetensors import safe_open

        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise InvalidInputError(f"{self.folder} has no *.safetensors shards")
        self._files = {f: safe_open(str(f), framework="pt") for f in files}
        self._where = {k: f for f, h in self._files.items() for k in h.keys()}
        self.tied = tied or {}

    def key_for(self, name: str) -> str:
        for cand in (name, name.removeprefix("model."), f"model.{name}"):
            if cand in self._where:
                return cand
        if name in self.tied:
            return self.key_for(self.tied[name])
        raise MalformedDataError(f"{self.folder}: no tensor {name!r} in the safetensors shards")

    def __call__(self, name: str) -> torch.Tensor:
        key = self.key_for(name)
        return self._files[self._where[key]].get_tensor(key)

    def close(self) -> None:
        self._files.clear()


def load_streaming(path, plan: Plan, accelerator: str | Link = "cuda", *, gpu_memory_bytes: int | None = None,
                   pinned_memory_budget_bytes: int | None = None, cpu_cores: int | None = None) -> torch.nn.Module:
    """A ``*ForCausalLM`` whose weights were streamed from ``path`` into the places ``plan``
    needs, with the executor installed (``model.flexplan_executor``); its ``generate()`` runs
    the plan (use ``flexplan.load`` for per-request KV caches and statistics)."""
    from flexplan.executor.runner import Executor

    link = accelerator if isinstance(accelerator, Link) else Link(accelerator)
    config = read_config(path)
    model = build_skeleton(config)
    tied = {}
    if getattr(config, "tie_word_embeddings", False):
        emb = model.get_input_embeddings()
        emb_name = next(n for n, m in model.named_modules() if m is emb)
        tied["lm_head.weight"] = f"{emb_name}.weight"
    source = SafetensorsSource(path, tied)
    try:
        executor = Executor(model, plan, link, source=source, accelerator_budget_bytes=gpu_memory_bytes,
                            pinned_budget_bytes=pinned_memory_budget_bytes, cpu_cores=cpu_cores)
    finally:
        source.close()
    model.flexplan_executor = executor
    try:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(path))
    except (OSError, ValueError):
        pass
    return model
