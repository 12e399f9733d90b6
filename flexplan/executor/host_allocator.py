"""Host memory that a step frees stays with the process for the next step (glibc's malloc tuned once).

A CPU layer allocates its activations afresh each call (projections, MLP intermediates, the KV
cache that ``torch.cat`` grows) and frees them a few milliseconds later. glibc's malloc adapts its
thresholds as it goes: blocks above the mmap threshold (128 KiB, rising to the largest block freed)
are mapped and unmapped per call, and the heap is trimmed back to the kernel whenever its free top
exceeds twice that threshold. Either way the next call touches fresh pages, and each 4 KiB page
costs a fault and a zeroing in the kernel: a batched prefill of a small model can spend a third
of its time there. The calibration's bare layers reuse their buffers and never pay it, so without
the thresholds fixed here (no faults after the first call) the estimator would price the executor
that much fast (``benchmarks/bench_host_allocator.py`` times both).

:func:`keep_freed_memory` sets, once per process, the mmap threshold to glibc's maximum (32 MiB on
64-bit: larger blocks, e.g. weights, are still mapped) and the trim threshold to :data:`TRIM_BYTES`
(freed heap memory up to that is kept, not returned), much as the allocators PyTorch's CPU
inference guides suggest preloading (jemalloc, tcmalloc) keep freed memory for reuse. The process's
resident memory can then stay up to ~TRIM_BYTES above what it holds live.
``FLEXPLAN_HOST_ALLOCATOR=default`` leaves malloc as it is; other C libraries (musl) are left alone,
and so is any process whose ``malloc`` is not glibc's (an allocator preloaded or linked in, whatever
its name: the symbol the process resolves is compared with glibc's own).
"""

from __future__ import annotations

import ctypes
import os
import platform

ENV = "FLEXPLAN_HOST_ALLOCATOR"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit); above it mallopt fails
TRIM_BYTES = 1 << 30

_state: str | None = None


def keep_freed_memory() -> str:
    """Tune glibc's malloc as the module docstring says (once; later calls return the first
    answer). Returns one line saying what the process's allocator is doing."""
    global _state
    if _state is not None:
        return _state
    if os.environ.get(ENV, "").strip().lower() in ("default", "0", "off", "no"):
        _state = f"malloc as the C library sets it (${ENV}={os.environ[ENV]})"
        return _state
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        _state = f"malloc as the C library sets it (not glibc: {platform.libc_ver()[0] or platform.system()})"
        return _state
    try:
        libc = ctypes.CDLL("libc.so.6")
        if not _malloc_is(libc):
            _state = ("another malloc than glibc's, left as it is"
                      + (f" (LD_PRELOAD={os.environ['LD_PRELOAD']})" if os.environ.get("LD_PRELOAD") else ""))
            return _state
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES) == 1
    except (OSError, AttributeError) as e:
        _state = f"malloc as the C library sets it (mallopt unavailable: {e})"
        return _state
    _state = (f"glibc malloc keeping freed memory (mmap above {MMAP_THRESHOLD_BYTES >> 20} MiB, trim above "
              f"{TRIM_BYTES >> 20} MiB)" if ok else "malloc as the C library sets it (mallopt refused the thresholds)")
    return _state


def _malloc_is(libc: ctypes.CDLL) -> bool:
    """Whether the ``malloc`` this process calls is ``libc``'s own."""
    address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
    return address(ctypes.CDLL(None).malloc) == address(libc.malloc)
