"""How the CPU computes its layers: threads, dtype, linear kernel, and IPEX when (and only when) it works.

FlexInfer (section 5.4) runs CPU layers with IPEX kernels. IPEX is archived and pinned to
torch 2.8, so it is used only when ``import intel_extension_for_pytorch`` works AND its
major.minor matches the installed torch; otherwise stock PyTorch. Which one ran is recorded
in the run statistics. With stock PyTorch the CPU's linears compute from packed weights
(``cpu_linear``: flexplan's blocked layout and native kernel for float32, oneDNN's packed layout
for the rest) unless the caller asks for plain ``F.linear``.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass

import torch

from flexplan.errors import InvalidInputError
from flexplan.executor import cpu_linear
from flexplan.executor.host_allocator import keep_freed_memory
from flexplan.hardware import get_hardware


@dataclass(frozen=True)
class CPUBackend:
    name: str  # "stock PyTorch 2.x" or "IPEX 2.x"
    threads: int
    why: str  # why this backend (IPEX missing, incompatible, ...)
    ipex: object | None = None
    linear_kernel: str = cpu_linear.KERNEL_PLAIN  # cpu_linear.KERNELS
    allocator: str = ""  # host_allocator.keep_freed_memory(): what malloc does with freed activations

    @property
    def packs_weights(self) -> bool:
        return self.linear_kernel in cpu_linear.PACKING_KERNELS

    def optimize(self, module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
        """IPEX's module-level optimisation for a layer the CPU computes in every phase. Weights
        are not repacked, so the layer's parameters stay views of its flat buffer."""
        if self.ipex is None:
            return module
        try:
            return self.ipex.optimize(module, dtype=dtype if dtype != torch.float32 else None, inplace=True,
                                      weights_prepack=False)
        except Exception:  # noqa: BLE001 - IPEX declined this module: stock PyTorch runs it
            return module


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def ipex_status() -> tuple[object | None, str]:
    """(the ipex module or None, a one-line reason)."""
    try:
        version = importlib.metadata.version("intel_extension_for_pytorch")
    except importlib.metadata.PackageNotFoundError:
        return None, "intel_extension_for_pytorch is not installed"
    if _major_minor(version) != _major_minor(torch.__version__):
        return None, f"IPEX {version} is built for torch {'.'.join(_major_minor(version))}, installed torch is {torch.__version__}"
    try:
        import intel_extension_for_pytorch as ipex  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means stock PyTorch
        return None, f"import intel_extension_for_pytorch failed: {type(e).__name__}: {e}"
    return ipex, f"IPEX {version} matches torch {torch.__version__}"


def configure(cores: int | None = None, use_ipex: bool = True, linear_kernel: str | None = None) -> CPUBackend:
    """Set the intra-op thread count to the hardware's cores, keep freed host memory for the next
    step (host_allocator) and pick the backend. ``linear_kernel``
    (stock PyTorch only): ``"flexplan-blocked"`` (float32 weights blocked for flexplan's native
    GEMV, other weights oneDNN-packed; the default where the native GEMV builds), ``"onednn-packed"``
    (the default where only oneDNN's packed linear is there) or ``"F.linear"``."""
    why_not = cpu_linear.kernel_unavailable(linear_kernel) if linear_kernel is not None else None
    if why_not:
        raise InvalidInputError(why_not)
    threads = int(cores) if cores else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    allocator = keep_freed_memory()
    ipex, why = ipex_status() if use_ipex else (None, "IPEX disabled by the caller")
    if ipex is not None:
        return CPUBackend(f"IPEX {ipex.__version__}", threads, why, ipex, allocator=allocator)
    return CPUBackend(f"stock PyTorch {torch.__version__}", threads, why,
                      linear_kernel=linear_kernel or cpu_linear.default_kernel(), allocator=allocator)


def local_cpu_dtype() -> str:
    """The dtype this CPU computes fast: the hardware model's answer when it can introspect,
    else float32 (bf16 GEMMs are only fast with AMX or AVX-512 BF16)."""
    try:
        return get_hardware("local").cpu.compute_dtype
    except Exception:  # noqa: BLE001 - introspection unavailable: the safe choice
        return "float32"


def local_cpu_cores() -> int | None:
    try:
        return int(get_hardware("local").cpu.cores)
    except Exception:  # noqa: BLE001
        return None
