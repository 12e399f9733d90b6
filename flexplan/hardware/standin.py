"""The CPU standing in for the accelerator, so every executor path runs without a GPU.

Its "GPU" is this machine's own CPU and memory, and its "link" is a host memcpy; the
estimator then predicts the stand-in honestly (slowly), and the planner can be forced to
any policy for tests.
"""

from __future__ import annotations

from dataclasses import replace

from flexplan.hardware import get_hardware
from flexplan.hardware.spec import GPUSpec, Hardware, LinkSpec


def standin_hardware(gpu_memory_bytes: int, base: Hardware | None = None) -> Hardware:
    base = base or get_hardware("local")
    cpu = base.cpu
    flops = {d: cpu.peak_flops_per_s.get(cpu.compute_dtype, 0.0) if d == cpu.compute_dtype else v
             for d, v in cpu.peak_flops_per_s.items()}
    gpu = GPUSpec(name="CPU stand-in accelerator", memory_bytes=int(gpu_memory_bytes),
                  memory_bandwidth_bytes_per_s=cpu.memory_bandwidth_bytes_per_s, peak_flops_per_s=flops,
                  runtime_reserved_bytes=0)
    # a memcpy reads and writes: half the memory bandwidth each way
    link = LinkSpec(name="host memcpy", h2d_bandwidth_bytes_per_s=cpu.memory_bandwidth_bytes_per_s / 2,
                    d2h_bandwidth_bytes_per_s=cpu.memory_bandwidth_bytes_per_s / 2)
    return replace(base, name=f"{base.name}+cpu-standin", gpu=gpu, link=link,
                   notes=base.notes + ("accelerator is the CPU standing in (tests, no GPU)",))
