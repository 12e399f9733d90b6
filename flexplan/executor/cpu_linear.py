"""oneDNN-prepacked weights for the linear layers the CPU computes.

Decode on the CPU is a GEMV per weight matrix: it should stream the weights at memory bandwidth.
Stock ``F.linear`` does not: on the development machine (2 cores of an AMD EPYC Zen 4) it reads a
TinyLlama-sized fp32 weight at ~20 GB/s at batch 1 and ~10 GB/s at batch 8, against a measured
STREAM triad of ~39 GB/s. oneDNN's inner product on a weight reordered once into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``, the kernel torch.compile's CPU freezing
pass uses) reads the same weights at ~32 GB/s (batch 1) and ~26 GB/s (batch 8), and is as fast
or faster for prefill GEMMs (512 tokens, fp32: 217 against 186 GFLOP/s). Measured by
``python benchmarks/bench_cpu_linear.py`` (``benchmarks/results/bench_cpu_linear.json``).

The packed weight REPLACES the dense one (it is the ``weight`` Parameter of the ``nn.Linear``,
an opaque oneDNN tensor of the same shape, dtype and size), so a CPU layer holds one copy.
Calling stock ``F.linear`` on it raises (it never silently computes garbage); ``install``
gives each linear a forward that uses the packed kernel when its weight is packed and
``F.linear`` otherwise, so the same module also runs with dense weights on any device.

bf16 results are bit-identical to ``F.linear`` (both are oneDNN); fp32 ones differ in the last
bits (``F.linear`` goes to an sgemm with another summation order).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

KERNEL_PACKED = "onednn-packed"
KERNEL_PLAIN = "F.linear"
KERNELS = (KERNEL_PACKED, KERNEL_PLAIN)


@functools.lru_cache(maxsize=None)
def packing_available() -> bool:
    """Whether this torch build has oneDNN and the prepacked linear ops, and they work."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 8))
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), w, None, "none", [None], "")
        return bool(torch.allclose(y, torch.full((2, 4), 8.0)))
    except Exception:  # noqa: BLE001 - any failure means: compute with F.linear
        return False


def default_kernel() -> str:
    return KERNEL_PACKED if packing_available() else KERNEL_PLAIN


def pack_batch_hint(decode_batch: int) -> int | None:
    """The batch size oneDNN is told when it picks the packed layout: 1 for batch-1 decode, else
    none. ``benchmarks/bench_cpu_linear.py`` on the development machine (TinyLlama-shaped layers,
    fp32): packed for batch 1, a batch-1 GEMV streams 31.8 GB/s against 28.3 with the generic
    layout; but that layout drops batch 8 to 18.2 GB/s, where the generic one gives 25.8. bf16:
    within 4% either way (26.6 vs 27.6 at batch 1)."""
    return 1 if int(decode_batch) == 1 else None


def pack(weight: torch.Tensor, batch_hint: int | None = None) -> torch.Tensor:
    """A dense [out, in] CPU weight reordered into oneDNN's layout (a new tensor)."""
    with torch.no_grad():
        w = weight.detach().contiguous()
        if batch_hint:
            return torch.ops.mkldnn._reorder_linear_weight(w, int(batch_hint))
        return torch.ops.mkldnn._reorder_linear_weight(w)


def dense(t: torch.Tensor) -> torch.Tensor:
    """The dense tensor behind ``t`` (a packed weight is reordered back, exactly)."""
    return t.to_dense() if t.is_mkldnn else t


def is_packed(t: torch.Tensor | None) -> bool:
    return t is not None and t.is_mkldnn


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = module.weight
    if w.is_mkldnn:
        return packed_linear(x, w, module.bias)
    return F.linear(x, w, module.bias)


def packable(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` (subclasses such as quantised linears keep their own forward)."""
    return type(module) is nn.Linear


def install(module: nn.Linear) -> None:
    """Let ``module`` compute from a packed weight (an instance-level forward)."""
    module.forward = functools.partial(_forward, module)


def uninstall(module: nn.Linear) -> None:
    module.__dict__.pop("forward", None)


def pack_module(root: nn.Module, batch_hint: int | None = None) -> int:
    """Pack every plain CPU linear under ``root`` in place (its weight replaced; one packed for
    another hint is repacked); the count packed. For code that owns a CPU-only module outright
    (calibration's layers)."""
    n = 0
    for m in root.modules():
        if not packable(m) or m.weight.device.type != "cpu":
            continue
        if m.weight.is_mkldnn and getattr(m, "_flexplan_pack_batch", None) == batch_hint:
            continue
        install(m)
        m._parameters["weight"] = nn.Parameter(pack(dense(m.weight), batch_hint), requires_grad=False)
        m._flexplan_pack_batch = batch_hint
        n += 1
    return n


class LinearKernel:
    """``F.linear`` with the CPU executor's kernel, for benchmarks: ``prepare(w, batch)`` turns
    a dense weight into what ``__call__`` takes (packed for that decode batch, or as is)."""

    def __init__(self, kernel: str | None = None, device: str = "cpu"):
        self.name = KERNEL_PLAIN if device != "cpu" else (kernel or default_kernel())

    @property
    def packed(self) -> bool:
        return self.name == KERNEL_PACKED

    def prepare(self, weight: torch.Tensor, batch: int = 1) -> torch.Tensor:
        return pack(weight, pack_batch_hint(batch)) if self.packed else weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, weight) if weight.is_mkldnn else F.linear(x, weight)
