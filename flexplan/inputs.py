"""Arguments of ``flexplan.load`` and ``FlexModel.generate()`` checked at the door.

Each check raises one of flexplan's typed errors (``flexplan/errors.py``) with one line that says
what was wrong and what would work, before any weight is moved or any kernel sees the input:
an id outside the vocabulary is refused here, not as an ``IndexError`` from a CPU kernel.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from flexplan.errors import DoesNotFitError, InvalidInputError, UnsupportedModelError, suggest
from flexplan.estimator.policies import POLICIES
from flexplan.executor.plans import check_overrides
from flexplan.hardware import get_hardware
from flexplan.hardware.spec import Hardware, canonical_dtype
from flexplan.plan_types import Plan
from flexplan.workload import costs

PHASE_KEYS = ("prefill", "decode")
LAYER_KEYS = ("gpu_layers", "prefill_gpu_layers", "decode_gpu_layers")
SHAPE_KEYS = ("batch_size", "input_len", "output_len")
_CUDA = re.compile(r"cuda(:\d+)?")


def _is_int(x: Any) -> bool:
    import numbers

    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _type(x: Any) -> str:
    return type(x).__name__


# ----------------------------------------------------------------------------- load()


def check_model_argument(model_or_path: Any) -> None:
    """A folder path that exists, or a loaded transformers causal LM (a module with ``generate``
    and an output head)."""
    from torch import nn

    if isinstance(model_or_path, (str, os.PathLike)):
        path = Path(model_or_path).expanduser()
        if not path.exists():
            raise InvalidInputError(
                f"{model_or_path} does not exist: not a model folder; pass a folder with config.json and "
                "*.safetensors shards, or a loaded transformers model (AutoModelForCausalLM.from_pretrained(...))")
        return
    if not isinstance(model_or_path, nn.Module):
        raise InvalidInputError(
            f"flexplan.load takes a model folder path or a loaded transformers *ForCausalLM, got {_type(model_or_path)}")
    config = getattr(model_or_path, "config", None)
    name = type(model_or_path).__name__
    if config is None:
        raise UnsupportedModelError(f"{name} has no transformers config: pass a *ForCausalLM model "
                                    "(AutoModelForCausalLM) or its folder")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; flexplan runs decoder-only causal LMs "
                                    "(AutoModelForCausalLM)")
    head = model_or_path.get_output_embeddings() if hasattr(model_or_path, "get_output_embeddings") else None
    if not hasattr(model_or_path, "generate") or head is None:
        raise UnsupportedModelError(f"{name} is not a causal LM (no generate() or no LM head); load it with "
                                    "AutoModelForCausalLM, e.g. LlamaForCausalLM rather than LlamaModel")


def check_accelerator(accelerator: Any) -> None:
    """None, "cpu", "cuda" or "cuda:N" (or a torch.device of those)."""
    if accelerator is None:
        return
    text = str(accelerator).lower() if isinstance(accelerator, str) or _type(accelerator) == "device" else None
    if text is None or not (text == "cpu" or _CUDA.fullmatch(text)):
        raise InvalidInputError(f"accelerator must be 'cuda' (or 'cuda:N'), 'cpu' (the CPU stand-in) or None (CUDA "
                                f"if available, else the CPU alone), got {accelerator!r}")


def check_byte_budget(name: str, value: Any) -> None:
    """None or a whole, non-negative number of bytes."""
    if value is None:
        return
    whole = _is_int(value) or (isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if not whole or value < 0:
        raise InvalidInputError(f"{name} must be a non-negative whole number of bytes (e.g. 8 << 30 for 8 GiB), "
                                f"got {value!r}")


def gib_bytes(text: str) -> int:
    """argparse type of the commands' --gpu-memory / --cpu-memory: GiB as typed, whole bytes returned."""
    import argparse

    try:
        gib = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GiB as a number (e.g. 1.5), got {text!r}") from None
    if not math.isfinite(gib) or gib < 0:
        raise argparse.ArgumentTypeError(f"memory must be a finite number of GiB >= 0, got {text}")
    return round(gib * (1 << 30))


def port_number(text: str) -> int:
    """argparse type of serve's --port: a TCP port, 0-65535 (0: any free one)."""
    import argparse

    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number (e.g. 8000), got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {port}")
    return port


def positive_ms(text: str) -> float:
    """argparse type of a time in milliseconds (serve's --tpot-target-ms): a finite number > 0."""
    import argparse

    try:
        ms = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds as a number (e.g. 200), got {text!r}") from None
    if not math.isfinite(ms) or ms <= 0:
        raise argparse.ArgumentTypeError(f"a time must be a finite number of milliseconds > 0, got {text}")
    return ms


def check_cpu_threads(value: Any) -> None:
    if value is not None and (not _is_int(value) or value < 1):
        raise InvalidInputError(f"cpu_threads must be a positive int (or None: the calibrated count, else all "
                                f"cores), got {value!r}")


def check_plan_argument(plan: Any, num_layers: int) -> None:
    """'auto', a flexplan.Plan, or a dict of overrides with known keys, known policy names, whole
    layer counts in [0, num_layers] and positive shapes."""

    if isinstance(plan, Plan):
        return
    if isinstance(plan, str):
        if plan != "auto":
            raise InvalidInputError(f"plan must be 'auto', a flexplan.Plan or a dict of overrides such as "
                                    f"{{'prefill': 'cpu', 'decode': 'cpu'}}, got {plan!r}")
        return
    if not isinstance(plan, dict):
        raise InvalidInputError(f"plan must be 'auto', a flexplan.Plan or a dict of overrides, got {_type(plan)}")
    check_overrides(plan)
    for key in PHASE_KEYS:
        name = plan.get(key)
        if name is not None and name not in POLICIES:
            hint = suggest(name, POLICIES) if isinstance(name, str) else ""
            raise InvalidInputError(f"unknown {key} policy {name!r}; use one of {', '.join(POLICIES)}.{hint}")
    for key in LAYER_KEYS:
        m = plan.get(key)
        if m is None:
            continue
        if not _is_int(m) or not 0 <= m <= num_layers:
            raise InvalidInputError(f"{key} must be a whole number of layers between 0 and {num_layers} "
                                    f"(this model's layers), got {m!r}")
    for key in SHAPE_KEYS:
        v = plan.get(key)
        if v is not None and (not _is_int(v) or v < 1):
            raise InvalidInputError(f"{key} must be a positive int, got {v!r}")
    for key in ("dtype", "cpu_dtype"):
        if plan.get(key) is not None:
            canonical_dtype(plan[key])


def check_hardware(hardware: Any) -> None:
    """None, "local", a hwdb name or composition (resolved now: UnknownHardwareError names the
    close ones), or a flexplan Hardware."""

    if hardware is None or hardware == "local" or isinstance(hardware, Hardware):
        return
    if not isinstance(hardware, str):
        raise InvalidInputError(f"hardware must be 'local', a hwdb name such as 'flexinfer-server2' or a "
                                f"flexplan Hardware, got {_type(hardware)}")

    get_hardware(hardware)


def check_load_arguments(model_or_path: Any, accelerator: Any, dtype: Any, gpu_memory_bytes: Any,
                         pinned_memory_budget_bytes: Any, cpu_threads: Any, hardware: Any = "local") -> None:
    """Everything ``load`` can check before it reads a config (the plan is checked against the
    config's layer count by :func:`check_plan_argument`)."""

    check_model_argument(model_or_path)
    check_accelerator(accelerator)
    if dtype is not None:
        canonical_dtype(dtype)
    check_byte_budget("gpu_memory_bytes", gpu_memory_bytes)
    check_byte_budget("pinned_memory_budget_bytes", pinned_memory_budget_bytes)
    check_cpu_threads(cpu_threads)
    check_hardware(hardware)


# ----------------------------------------------------------------------------- generate()


def _vocab_and_width(model) -> tuple[int, int | None]:
    """(ids the embedding holds, its embedding width) from the model's input embedding."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None) or int(model.config.vocab_size)
    width = getattr(emb, "embedding_dim", None)
    return int(vocab), (int(width) if width is not None else None)


def check_input_ids(ids: Any, vocab: int, name: str = "input_ids") -> None:
    import torch

    if isinstance(ids, dict) or hasattr(ids, "keys"):
        raise InvalidInputError(f"{name} is a {_type(ids)} (a tokenizer's output?); pass it unpacked: "
                                "generate(**inputs, max_new_tokens=N)")
    if not isinstance(ids, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch tensor of token ids (batch x tokens), got {_type(ids)}; "
                                "use tokenizer(..., return_tensors='pt')")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InvalidInputError(f"{name} must hold integer token ids (torch.long), got {ids.dtype}; "
                                f"use {name}.long() if they are whole numbers")
    if ids.dim() != 2:
        fix = f"{name}.unsqueeze(0) for one sequence" if ids.dim() == 1 else "shape (batch, tokens)"
        raise InvalidInputError(f"{name} must be 2-D (batch x tokens), got shape {tuple(ids.shape)}; use {fix}")
    if ids.numel() == 0:
        raise InvalidInputError(f"{name} is empty (shape {tuple(ids.shape)}); give at least one sequence of at "
                                "least one token")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise InvalidInputError(f"{name} holds token id {bad}, outside this model's vocabulary [0, {vocab}); "
                                "was it tokenized with another model's tokenizer?")


def check_attention_mask(mask: Any, shape: tuple[int, int]) -> None:
    import torch

    if not isinstance(mask, torch.Tensor):
        raise InvalidInputError(f"attention_mask must be a torch tensor of 0/1 (batch x tokens), got {_type(mask)}")
    if tuple(mask.shape) != tuple(shape):
        raise InvalidInputError(f"attention_mask has shape {tuple(mask.shape)} but the inputs are {tuple(shape)} "
                                "(batch x tokens); pass the mask the tokenizer returned with them")
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise InvalidInputError("attention_mask must hold only 0 (padding) and 1 (token), got other values; pass "
                                "the tokenizer's mask")
    if mask.numel() and not bool((mask != 0).any(dim=-1).all()):
        row = int((~(mask != 0).any(dim=-1)).nonzero()[0, 0])
        raise InvalidInputError(f"attention_mask row {row} is all zeros: that sequence has no token to attend to; "
                                "drop it or give it at least one token")


def check_inputs_embeds(embeds: Any, width: int | None) -> None:
    import torch

    if not isinstance(embeds, torch.Tensor) or not embeds.dtype.is_floating_point:
        raise InvalidInputError(f"inputs_embeds must be a floating-point torch tensor (batch x tokens x hidden), "
                                f"got {getattr(embeds, 'dtype', _type(embeds))}")
    if embeds.dim() != 3 or embeds.shape[0] == 0 or embeds.shape[1] == 0:
        raise InvalidInputError(f"inputs_embeds must be 3-D and non-empty (batch x tokens x hidden), got shape "
                                f"{tuple(embeds.shape)}")
    if width is not None and embeds.shape[-1] != width:
        raise InvalidInputError(f"inputs_embeds have hidden size {embeds.shape[-1]} but this model embeds tokens in "
                                f"{width}; build them with model.get_input_embeddings()(input_ids)")


def check_count(name: str, value: Any, minimum: int = 1) -> None:
    if value is not None and (not _is_int(value) or value < minimum):
        raise InvalidInputError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_generate_arguments(model, inputs: Any, kwargs: dict[str, Any]) -> None:
    """What ``generate()`` is given: ids in the vocabulary, a matching 0/1 mask, embeddings of the
    model's width, positive token and beam counts. Raises InvalidInputError."""
    vocab, width = _vocab_and_width(model)
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    embeds = kwargs.get("inputs_embeds")
    if ids is None and embeds is None:
        raise InvalidInputError("generate() needs input_ids (batch x tokens) or inputs_embeds (batch x tokens x "
                                "hidden); e.g. lm.generate(**tokenizer(prompts, return_tensors='pt', padding=True))")
    if embeds is not None:
        check_inputs_embeds(embeds, width)
        shape = tuple(embeds.shape[:2])
    if ids is not None:
        check_input_ids(ids, vocab, "inputs" if inputs is not None else "input_ids")
        shape = tuple(ids.shape) if embeds is None else shape
    if kwargs.get("attention_mask") is not None:
        check_attention_mask(kwargs["attention_mask"], shape)
    check_count("max_new_tokens", kwargs.get("max_new_tokens"))
    max_length = kwargs.get("max_length")
    if max_length is not None:
        check_count("max_length", max_length)
        if kwargs.get("max_new_tokens") is None and max_length <= shape[1]:
            raise InvalidInputError(f"max_length {max_length} leaves no room for new tokens after a {shape[1]}-token "
                                    "prompt; pass max_new_tokens=N instead")
    for key in ("num_beams", "num_return_sequences", "min_new_tokens"):
        check_count(key, kwargs.get(key), 0 if key == "min_new_tokens" else 1)


def check_kv_fits_host(spec, batch: int, tokens: int, kv_elem_bytes: int, host_memory_bytes: int) -> None:
    """Refuse a request whose KV cache alone, all layers in host memory, exceeds the machine's
    physical memory (it could never run; the accelerator and pinned budgets are checked by the
    executor). ``spec``: the model's ModelSpec."""

    need = spec.num_layers * costs.kv_cache_bytes_per_layer(spec, batch, tokens, kv_elem_bytes)
    if need > host_memory_bytes:
        gib = 1 << 30
        raise DoesNotFitError(f"batch {batch} x {tokens} tokens needs {need / gib:.1f} GiB of KV cache, more than "
                              f"this machine's {host_memory_bytes / gib:.1f} GiB of memory; use a smaller batch, a "
                              "shorter prompt or fewer max_new_tokens")
