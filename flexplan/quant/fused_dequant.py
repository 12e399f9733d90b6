"""Fused dequantisation: :mod:`flexplan.quant.torch_dequant`'s per-format functions compiled by
``torch.compile`` (inductor: Triton on CUDA, C++ on the CPU) into one kernel a format, which reads
the blocks once and writes the weights once in the requested dtype, instead of one kernel per op
each writing a full intermediate (Park & Egger's D, ``flexplan/estimator/dequant_terms.py``).

The rule, stated here only: blocks on a CUDA device are dequantised by their format's compiled
function (``dynamic=True``: one compile a format, dtype and device serves every shape;
``fullgraph=True``: no silent graph break back into eager ops), unless

- ``FLEXPLAN_FUSED_DEQUANT=0`` is set (:data:`ENV_VAR`): eager ops always, or
- compiling or running a compiled function has failed once in this process (no Triton, no C++
  compiler, an unsupported Python, any exception): eager ops for the rest of the process, after one
  line on stderr saying why (an out-of-memory error is the caller's and is raised as it is).

Other devices run the eager ops unless the caller names their type in ``device_types`` (the tests
compile on the CPU). Fewer than two blocks run eagerly too: a size of 0 or 1 would compile its own
specialisation, and there is nothing to fuse in one block.

The compiled functions compute what the eager ones do (the same float32 ops in the same order, a
cast last); tests/test_quant_fused_dequant.py checks them bit for bit on the CPU and against the
CPU's eager result on CUDA (the latter not yet run on a GPU).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

from flexplan.quant.formats import GGUF_FORMATS
from flexplan.quant.torch_dequant import DEQUANTIZERS, as_blocks

ENV_VAR = "FLEXPLAN_FUSED_DEQUANT"  # "0": eager torch ops always
FUSED_DEVICE_TYPES = ("cuda",)  # where QuantLinear's accelerator path runs the compiled functions

_compiled: dict[int, Callable[[torch.Tensor, torch.dtype], torch.Tensor]] = {}
_off_why: str | None = None  # why compiling failed in this process (then eager from there on)


def _compile(fn: Callable) -> Callable:
    """The compiled form of one format's function (built lazily: torch.compile compiles at its first call)."""
    # emulate_precision_casts: eager's rounding, step by step; else Triton contracts d * q + m into one
    # FMA (one rounding, not two) and the weights leave gguf's bits by an ulp
    return torch.compile(fn, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})


def enabled() -> bool:
    """Whether the compiled functions are used: not turned off by :data:`ENV_VAR`, no failure yet."""
    return os.environ.get(ENV_VAR, "1").strip() != "0" and _off_why is None


def off_reason() -> str | None:
    """Why compiling failed in this process (fused dequantisation then stays off), or None."""
    return _off_why


def _turn_off(ggml_type: int, device: torch.device, error: Exception) -> None:
    global _off_why
    first = (str(error).strip().splitlines() or [""])[0][:200]
    name = GGUF_FORMATS[ggml_type].name
    _off_why = f"torch.compile failed on {name} ({device.type}): {type(error).__name__}: {first}"
    print(f"flexplan: fused dequantisation off for this process ({_off_why}); dequantising with eager torch ops "
          f"(set {ENV_VAR}=0 to skip the attempt)", file=sys.stderr)


def dequantize(data: torch.Tensor, ggml_type: int, in_features: int, dtype: torch.dtype = torch.float32,
               device_types: tuple[str, ...] = FUSED_DEVICE_TYPES) -> torch.Tensor:
    """:func:`flexplan.quant.torch_dequant.dequantize`'s result (uint8 [rows, row_bytes] in, [rows,
    in_features] of dtype out, on data's device), by the compiled function where the module's rule
    says so (its device type in ``device_types``), by the eager ops otherwise."""
    blocks = as_blocks(data, ggml_type, in_features)
    ggml_type, rows = int(ggml_type), data.shape[0]
    if enabled() and data.device.type in device_types and blocks.shape[0] >= 2:
        if ggml_type not in _compiled:
            _compiled[ggml_type] = _compile(DEQUANTIZERS[ggml_type])
        try:
            return _compiled[ggml_type](blocks, dtype).reshape(rows, in_features)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # any failure of the compiler or its kernel: eager from now on
            _turn_off(ggml_type, data.device, e)
    if rows == 0:
        return torch.empty(0, in_features, dtype=dtype, device=data.device)
    return DEQUANTIZERS[ggml_type](blocks, dtype).reshape(rows, in_features)
