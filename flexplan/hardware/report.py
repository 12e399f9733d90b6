"""Text for ``flexplan hw`` (what this or a named machine is) and ``flexplan hw --list``
(what hwdb knows). SI units throughout: GB = 1e9 bytes, TFLOPS = 1e12 FLOP/s."""

from __future__ import annotations

from flexplan.hardware import hwdb
from flexplan.hardware.introspect import LocalMachine, introspect, local_hardware
from flexplan.hardware.spec import Hardware

_ISA_SHOWN = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile", "amx_fp16")


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _flops(peak: dict[str, float]) -> str:
    order = [d for d in ("bfloat16", "float16", "float32") if d in peak]
    return ", ".join(f"{d} {_tflops(peak[d])}" for d in order)


def _tflops(v: float) -> str:
    return f"{v / 1e12:.1f} TFLOPS" if v >= 1e12 else f"{v / 1e9:.1f} GFLOPS"


def format_hw(hw_or_local: Hardware | LocalMachine, calibration_line: str | None = None,
              machine: LocalMachine | None = None, hw: Hardware | None = None) -> str:
    """What ``flexplan hw`` prints. A :class:`LocalMachine` (or the Hardware named "local") also
    shows the raw facts: usable cores, NUMA nodes, available memory, PCIe current link; ``hw``
    is then the Hardware built from it (default: ``local_hardware(machine=...)``).

    ``calibration_line``: the "calibration in use: ..." line (None: the line says none is)."""
    if isinstance(hw_or_local, LocalMachine):
        machine = hw_or_local
        hw = hw or local_hardware(machine=hw_or_local)
    else:
        hw = hw_or_local
        if machine is None and hw.name == "local":
            machine = introspect()
    c = hw.cpu
    lines = [f"hardware: {hw.name}"]
    cpu_id = f"hwdb {c.hwdb_id}" if c.hwdb_id else "not in hwdb"
    lines.append(f"CPU     {c.name}  [{cpu_id}]")
    if machine is not None:
        f = machine.cpu
        lines.append(f"        sockets {c.sockets}, usable physical cores {c.cores} (machine: {f.physical_cores} "
                     f"physical, {f.logical_cpus} logical; {f.usable_logical_cpus} logical in this process's "
                     f"affinity), NUMA nodes {f.numa_nodes}")
        mem = f"        memory {_gb(machine.memory_total_bytes)} total, {_gb(machine.memory_available_bytes)} available"
        if machine.cgroup_memory_limit_bytes:
            mem += f", cgroup limit {_gb(machine.cgroup_memory_limit_bytes)}"
        lines.append(mem + f"; planning with {_gb(c.memory_bytes)}")
    else:
        lines.append(f"        sockets {c.sockets}, cores {c.cores}, memory {_gb(c.memory_bytes)}")
    isa = [x for x in _ISA_SHOWN if x in c.isa]
    amx = "AMX" if "amx_bf16" in c.isa else "no AMX"
    lines.append(f"        ISA: {' '.join(isa) or 'none of avx2/avx512/amx'} ({amx})")
    lines.append(f"        peak {_flops(c.peak_flops_per_s)}; memory bandwidth {c.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s")
    lines.append(f"        compute dtype: {c.compute_dtype}")
    if hw.gpu is None:
        why = next((n for n in hw.notes if n.startswith("no GPU: ") or n.endswith("(no_gpu)")), None)
        lines.append("GPU     none" + (f": {why.removeprefix('no GPU: ')}" if why else ""))
    else:
        g = hw.gpu
        lines.append(f"GPU     {g.name}  [{'hwdb ' + g.hwdb_id if g.hwdb_id else 'not in hwdb'}]")
        facts = machine.gpus[machine.gpu_selected] if machine and machine.gpu_selected is not None else None
        if facts is not None:
            lines.append(f"        memory {_gb(facts.memory_total_bytes)} total, {_gb(facts.memory_free_bytes)} free; "
                         f"PCIe max gen {facts.pcie_max_generation} x{facts.pcie_max_width}, current gen "
                         f"{facts.pcie_current_generation} x{facts.pcie_current_width} (lower at idle is normal)")
            if len(machine.gpus) > 1:
                others = ", ".join(f"{x.index}: {x.name}" for x in machine.gpus if x.index != facts.index)
                lines.append(f"        other GPUs: {others}")
        else:
            lines.append(f"        memory {_gb(g.memory_bytes)}")
        lines.append(f"        peak {_flops(g.peak_flops_per_s)}; memory bandwidth {g.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s")
    if hw.link is not None:
        lk = hw.link
        lines.append(f"Link    {lk.name}  [{'hwdb ' + lk.hwdb_id if lk.hwdb_id else 'derived'}]: "
                     f"{lk.h2d_bandwidth_bytes_per_s / 1e9:.2f} GB/s host-to-device, "
                     f"{lk.d2h_bandwidth_bytes_per_s / 1e9:.2f} GB/s device-to-host")
    # calibration: filled in by the CLI (flexplan/cli.py) with "calibration in use: ..."
    lines.append(calibration_line or "calibration: none in use (datasheet figures)")
    if hw.notes:
        lines.append("notes (assumptions and fallbacks):")
        lines.extend(f"  - {n}" for n in hw.notes)
    return "\n".join(lines)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*headers).rstrip(), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r).rstrip() for r in rows]


def format_list() -> str:
    """What ``flexplan hw --list`` prints: servers, CPUs, GPUs and links in hwdb with key figures."""
    db = hwdb.list_entries()
    out = ["hwdb (GB = 1e9 bytes; CPU figures per socket at base frequency; GPU FLOPS dense)", "", "servers:"]
    out += _table(["id", "cpu", "gpu", "link", "cpu memory"],
                  [[s["id"], f"{s['cpu']} x{s['sockets']}" + (f" ({s['cpu_cores']} cores)" if s.get("cpu_cores") else ""),
                    s.get("gpu", "-"), s.get("link", "-"), _gb(s["cpu_memory_bytes"])] for s in db["servers"]])
    out += ["", "cpus:"]
    out += _table(["id", "name", "cores", "GHz", "ISA", "mem GB/s", "fp32 TFLOPS", "bf16 TFLOPS"],
                  [[c["id"], c["name"], str(c["cores_per_socket"]), f"{c['base_frequency_hz'] / 1e9:.2f}",
                    _isa_short(c["isa"]), f"{c['memory_bandwidth_bytes_per_s_per_socket'] / 1e9:.1f}",
                    f"{c['peak_flops_per_s_per_socket']['float32'] / 1e12:.3g}",
                    f"{c['peak_flops_per_s_per_socket']['bfloat16'] / 1e12:.3g}"] for c in db["cpus"]])
    out += ["", "gpus:"]
    out += _table(["id", "name", "memory", "GB/s", "bf16 TFLOPS", "fp16 TFLOPS", "fp32 TFLOPS", "PCIe"],
                  [[g["id"], g["name"], _gb(g["memory_bytes"]), f"{g['memory_bandwidth_bytes_per_s'] / 1e9:.0f}",
                    f"{g['peak_flops_per_s']['bfloat16'] / 1e12:.1f}", f"{g['peak_flops_per_s']['float16'] / 1e12:.1f}",
                    f"{g['peak_flops_per_s']['float32'] / 1e12:.1f}", f"{g['pcie_generation']}.0 x{g['pcie_lanes']}"]
                   for g in db["gpus"]])
    out += ["", "links:"]
    out += _table(["id", "name", "H2D GB/s", "D2H GB/s"],
                  [[lk["id"], lk["name"], f"{lk['h2d_bandwidth_bytes_per_s'] / 1e9:.2f}",
                    f"{lk['d2h_bandwidth_bytes_per_s'] / 1e9:.2f}"] for lk in db["links"]])
    out += ["", "compose: CPU[xSOCKETS]+GPU[+LINK], e.g. xeon-6454sx2+h100-pcie-80gb+pcie5-x16; a bare CPU id is a CPU-only machine"]
    return "\n".join(out)


def _isa_short(isa: list[str]) -> str:
    if "amx_bf16" in isa:
        return "AMX"
    if "avx512_bf16" in isa:
        return "AVX512-BF16"
    if "avx512f" in isa:
        return "AVX512"
    return "AVX2" if "avx2" in isa else "-"
