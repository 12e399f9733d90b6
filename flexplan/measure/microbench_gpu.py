"""GPU and link micro-benchmarks for ``flexplan calibrate`` (torch.cuda). Only called when
``torch.cuda.is_available()``; the tests run their arithmetic on fakes, so they are checked on a
GPU only by a calibration there. What they measure and why: docs/calibration.md ("GPU part").

- GPU GEMV/GEMM at the CPU's shapes in the GPU dtype, weights cycled beyond the L2 cache,
  ``inner`` kernels queued per synchronize so launch latency overlaps.
- GPU memory bandwidth: a device-to-device copy (read + write counted).
- Link: pinned host <-> device copies over transfer sizes (1 MB .. 1 GB).
- Contention (Park & Egger 4.1): a CPU prefill GEMM timed alone and while host-to-device
  copies run on another CUDA stream; factor = time with copy / time alone.
- Per-layer overhead on the GPU: the tiny LlamaDecoderLayer of microbench.py on cuda, the
  slope between a step through 8 of them and through one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from flexplan.measure import microbench as mb

GPU_ROTATE_BYTES = 512 * 2**20  # > 4 x the largest L2 (H100: 50 MB, B200: 126 MB)
GEMM_INNER = 10


def _sync():
    import torch

    torch.cuda.synchronize()


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(torch.cuda.current_device())


def gemm(tokens: tuple[int, ...], sizes: mb.Sizes, dtype: str, tick: Callable[[], None] | None = None) -> list[dict]:
    total = sizes.rotate_bytes or GPU_ROTATE_BYTES
    return mb.gemm(tokens, sizes, dtype, device="cuda", sync=_sync, tick=tick, total_bytes=total, inner=GEMM_INNER)


def memory(sizes: mb.Sizes) -> dict[str, float]:
    """Device copy of ``stream_bytes`` x 4 (at least 256 MB): bytes read + written per second."""
    import torch

    n = max(sizes.stream_bytes * 4, 256 * 2**20) if not sizes.rotate_bytes else sizes.stream_bytes
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.ones(n, dtype=torch.uint8, device="cuda")
    r = mb.time_call(lambda: a.copy_(b), sizes.repeats, sizes.budget_s, _sync, inner=5)
    return {"copy_bytes_per_s": mb._sig(2 * n / r["time_s"]), "array_bytes": int(n), "time_s": mb._sig(r["time_s"])}


def link(sizes: mb.Sizes, direction: str, tick: Callable[[], None] | None = None) -> list[dict]:
    """Pinned host <-> device copies, one row per transfer size: ``time_s`` and ``bytes_per_s``."""
    import torch

    rows = []
    for n in sizes.transfer_bytes:
        host = torch.ones(n, dtype=torch.uint8).pin_memory()
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        src, dst = (host, dev) if direction == "h2d" else (dev, host)
        inner = max(1, min(50, (64 * 2**20) // n))
        r = mb.time_call(lambda: dst.copy_(src, non_blocking=True), sizes.repeats, sizes.budget_s, _sync, inner)
        rows.append({"bytes": int(n), "time_s": mb._sig(r["time_s"]), "time_median_s": mb._sig(r["time_median_s"]),
                     "bytes_per_s": mb._sig(n / r["time_s"])})
        del host, dev
        if tick:
            tick()
    return rows


def cpu_under_copy(sizes: mb.Sizes, cpu_dtype: str) -> dict:
    """CPU prefill GEMM (and decode GEMV) alone and while H2D copies stream on a side stream."""
    import torch

    k, n = sizes.weight_shapes[-1]
    one = replace(sizes, weight_shapes=((k, n),))
    alone_pre, alone_dec = mb.gemm((sizes.sweep_prefill_tokens, 1), one, cpu_dtype)
    chunk = min(256 * 2**20, max(sizes.transfer_bytes))
    host = torch.ones(chunk, dtype=torch.uint8).pin_memory()
    dev = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    r = mb.time_call(lambda: dev.copy_(host, non_blocking=True), 3, 1.0, _sync)
    # enough copies queued to outlast both timed GEMMs (warm-up + repeats each) three times over
    need_s = 3 * (sizes.repeats + 1) * (alone_pre["time_s"] + alone_dec["time_s"]) + 0.5
    count = max(4, math.ceil(need_s / r["time_s"]))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(count):
            dev.copy_(host, non_blocking=True)
    busy_pre, busy_dec = mb.gemm((sizes.sweep_prefill_tokens, 1), one, cpu_dtype)
    overlapped = not side.query()  # copies still running when the GEMMs ended
    side.synchronize()
    # the typical run of each (medians): the copies slow some runs more than others
    out = {"gemm": {"tokens": sizes.sweep_prefill_tokens, "k": k, "n": n, "alone_time_s": alone_pre["time_median_s"],
                    "with_copy_time_s": busy_pre["time_median_s"]},
           "gemv": {"tokens": 1, "k": k, "n": n, "alone_time_s": alone_dec["time_median_s"],
                    "with_copy_time_s": busy_dec["time_median_s"]},
           "copy_bytes": int(chunk), "copy_bytes_per_s": mb._sig(chunk / r["time_s"]),
           "copies_still_running_at_end": bool(overlapped),
           "factor": mb._sig(busy_pre["time_median_s"] / alone_pre["time_median_s"]),
           "gemv_factor": mb._sig(busy_dec["time_median_s"] / alone_dec["time_median_s"])}
    if not overlapped:
        out["note"] = "the copies finished before the GEMMs did: the factor is a lower bound"
    return out


def layer_overhead(sizes: mb.Sizes, dtype: str, stack: int = 8) -> dict[str, float]:
    """What one more layer adds to a decode step on the GPU: the tiny layer's step through
    ``stack`` layers against through one, 10 steps queued per synchronize, every step over the
    same KV length. The slope leaves out what a step pays once whatever its layers; where the
    one-layer step came out slower than the stack's per-layer share allows (a disturbed timing),
    the stack's time per layer, an upper bound, stands instead.

    Every step runs over the same KV length (``fixed_kv``): with the cache growing a key per step,
    torch's SDPA may take cuDNN's attention, which builds a plan per new shape, so a step's first
    pass over a length costs tens of ms and would swamp the per-layer figure."""
    one = mb.layer_overhead(sizes, dtype, device="cuda", sync=_sync, inner=10, fixed_kv=True)
    many = mb.layer_overhead(sizes, dtype, device="cuda", sync=_sync, inner=10, stack=stack, fixed_kv=True)
    out = {**many, "one_layer_step_s": one["time_s"], "stack_step_s": mb._sig(stack * many["time_s"])}
    for key in ("time_s", "time_median_s"):
        slope = (stack * many[key] - one[key]) / (stack - 1)
        out[key] = mb._sig(slope if slope > 0 else many[key])
    return out
