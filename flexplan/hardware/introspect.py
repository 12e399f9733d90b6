"""What this machine is: CPU, memory and GPUs read from /proc, /sys and NVML, matched to hwdb.

Fast on purpose (``flexplan hw`` under a second): no torch here, py-cpuinfo only when /proc
cannot be read. The parsers take text so they can be tested on made-up files. Every number
that is assumed rather than known is said in ``Hardware.notes``.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache

from flexplan.hardware import hwdb
from flexplan.hardware.spec import CPUSpec, GPUSpec, Hardware

# Unknown CPU: memory bandwidth assumed 2 channels x 20 GB/s (a DDR4-2500-class desktop; servers
# have far more, so this errs low). Unknown GPU: T4-class figures, the smallest tensor-core
# data-center GPU in hwdb.
ASSUMED_MEMORY_CHANNELS = 2
ASSUMED_BYTES_PER_S_PER_CHANNEL = 20e9
ASSUMED_FREQUENCY_HZ = 2.0e9
ASSUMED_GPU = {"memory_bandwidth_bytes_per_s": 320e9, "float32": 8.1e12, "float16": 65e12}
BF16_WITHOUT_HARDWARE_SLOWDOWN = 100.0


@dataclass(frozen=True)
class CPUFacts:
    model_name: str
    vendor_id: str
    cpu_family: int | None
    cpu_model: int | None
    isa: frozenset[str]  # the hwdb.ISA_FLAGS this CPU shows
    logical_cpus: int  # online logical CPUs
    usable_logical_cpus: int  # in this process's affinity mask
    sockets: int
    physical_cores: int  # all sockets
    usable_physical_cores: int  # distinct (package, core) pairs in the affinity mask, cgroup quota applied
    numa_nodes: int
    max_frequency_hz: float | None
    frequency_source: str
    cpu_quota_cores: float | None = None  # cgroup CPU quota, when one is set


@dataclass(frozen=True)
class GPUFacts:
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    memory_free_bytes: int
    pcie_max_generation: int | None  # what this GPU in this slot can reach
    pcie_max_width: int | None
    pcie_current_generation: int | None  # often lower at idle (power saving)
    pcie_current_width: int | None
    compute_capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class LocalMachine:
    cpu: CPUFacts
    memory_total_bytes: int
    memory_available_bytes: int
    cgroup_memory_limit_bytes: int | None = None
    gpus: tuple[GPUFacts, ...] = ()
    gpu_selected: int | None = None  # index into gpus of the GPU flexplan plans for
    driver_version: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


# ----------------------------------------------------------------------------- parsers (text in)


def parse_cpuinfo(text: str) -> dict:
    """/proc/cpuinfo -> model_name, vendor_id, cpu_family, cpu_model, flags, mhz (max over
    processors) and processors: {processor: (physical id, core id)}."""
    out = {"model_name": "", "vendor_id": "", "cpu_family": None, "cpu_model": None,
           "flags": frozenset(), "mhz": None, "processors": {}}
    for block in re.split(r"\n\s*\n", text.strip()):
        kv = {}
        for line in block.splitlines():
            if ":" in line:
                k, _, v = line.partition(":")
                kv[k.strip().lower()] = v.strip()
        if "processor" not in kv:
            continue
        out["model_name"] = out["model_name"] or kv.get("model name", "")
        out["vendor_id"] = out["vendor_id"] or kv.get("vendor_id", "")
        if out["cpu_family"] is None and kv.get("cpu family", "").isdigit():
            out["cpu_family"] = int(kv["cpu family"])
        if out["cpu_model"] is None and kv.get("model", "").isdigit():
            out["cpu_model"] = int(kv["model"])
        if not out["flags"]:
            out["flags"] = frozenset((kv.get("flags") or kv.get("features") or "").split())
        try:
            mhz = float(kv.get("cpu mhz", ""))
            out["mhz"] = max(out["mhz"] or 0.0, mhz)
        except ValueError:
            pass
        if kv["processor"].isdigit():
            out["processors"][int(kv["processor"])] = (kv.get("physical id", "0"), kv.get("core id", kv["processor"]))
    return out


def parse_meminfo(text: str) -> tuple[int, int]:
    """/proc/meminfo -> (MemTotal, MemAvailable) in bytes (MemFree when MemAvailable is absent)."""
    vals = {}
    for line in text.splitlines():
        m = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if m:
            vals[m.group(1)] = int(m.group(2)) * 1024
    total = vals.get("MemTotal", 0)
    return total, vals.get("MemAvailable", vals.get("MemFree", 0))


def isa_flags(flags) -> frozenset[str]:
    """The cpuinfo flags flexplan cares about (hwdb.ISA_FLAGS)."""
    return frozenset(f for f in flags if f in hwdb.ISA_FLAGS)


# The instruction-set classes that decide which CPU kernels run (oneDNN's AMX, AVX-512 BF16,
# AVX-512 and AVX2 paths), most capable first: the first whose flags a CPU shows is its class.
ISA_CLASSES = (("amx", ("amx_bf16",)), ("avx512_bf16", ("avx512_bf16",)), ("avx512", ("avx512f",)),
               ("avx2", ("avx2",)))


def isa_class(isa) -> str:
    """One token for the CPU kernels this ISA gets: "amx", "avx512_bf16", "avx512", "avx2" or
    "other". Two machines of one model name with different classes (a VM whose hypervisor hides
    AVX-512) run different kernels at different speeds."""
    isa = set(isa)
    return next((name for name, needs in ISA_CLASSES if isa.issuperset(needs)), "other")


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-")
            out.update(range(int(a), int(b) + 1))
        elif part.strip():
            out.add(int(part))
    return out


def flop_per_cycle_per_core(isa, *, vendor: str, microarchitecture: str | None = None,
                            cpu_family: int | None = None, cpu_model: int | None = None) -> tuple[dict[str, float], str]:
    """Dense GEMM FLOP/cycle/core per dtype on this ISA, and how it was reached (see cpus.yaml):
    fp32 = FMA units x lanes x 2; bf16 = 1024 with AMX, 2 x fp32 with AVX512_BF16, = fp32 with
    other AVX-512 (fp32 compute on bf16 storage), fp32 / 100 with neither."""
    isa, vendor, arch = set(isa), vendor.lower(), (microarchitecture or "").lower()
    amd = "amd" in vendor
    if amd and (arch in ("zen", "zen+") or (cpu_family == 23 and (cpu_model or 0) < 0x30)):
        fp32, how = 16.0, "Zen 1 (2 x 128-bit FMA)"
    elif amd and "avx512f" in isa and (arch == "zen5" or (cpu_family or 0) >= 26):
        fp32, how = 64.0, "AVX-512, Zen 5 (2 x 512-bit FMA)"
    elif amd and "avx2" in isa:
        fp32, how = 32.0, "AVX2/AVX-512 on Zen 2-4 (2 x 256-bit FMA)"
    elif "avx512f" in isa:
        fp32, how = 64.0, "AVX-512 (2 FMA units assumed)"
    elif "avx2" in isa:
        fp32, how = 32.0, "AVX2 (2 FMA x 8 lanes)"
    else:
        fp32, how = 16.0, "no AVX2 (SSE/NEON-class, assumed 16)"
    if "amx_bf16" in isa:
        bf16, bhow = 1024.0, "bf16 via AMX 1024"
    elif "avx512_bf16" in isa:
        bf16, bhow = 2 * fp32, "bf16 via AVX512_BF16 2x fp32"
    elif "avx512f" in isa:
        bf16, bhow = fp32, "bf16 = fp32 (AVX-512 conversion)"
    else:
        bf16, bhow = fp32 / BF16_WITHOUT_HARDWARE_SLOWDOWN, "bf16 = fp32/100 (no native bf16)"
    return {"float32": fp32, "bfloat16": bf16}, f"{how}, {fp32:g} FLOP/cycle/core fp32; {bhow}"


# ----------------------------------------------------------------------------- reading this machine


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cpu_facts() -> tuple[CPUFacts, list[str]]:
    notes: list[str] = []
    info = parse_cpuinfo(_read("/proc/cpuinfo") or "")
    if not info["processors"]:
        info.update(_py_cpuinfo_fallback(notes))
    try:
        affinity = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = set(range(os.cpu_count() or 1))
    online = parse_cpulist(_read("/sys/devices/system/cpu/online") or "") or set(info["processors"]) or affinity
    topo = {}
    for cpu in online:
        pkg = _read(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id")
        core = _read(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id")
        if pkg is not None and core is not None:
            topo[cpu] = (pkg.strip(), core.strip())
    if not topo:
        topo = {c: pc for c, pc in info["processors"].items() if c in online}
    if topo:
        sockets = len({p for p, _ in topo.values()})
        physical = len(set(topo.values()))
        usable = len({topo[c] for c in affinity if c in topo}) or len(affinity)
    else:
        sockets, physical, usable = 1, len(online), len(affinity)
        notes.append("CPU topology unreadable: every logical CPU counted as a physical core")
    quota = _cgroup_cpu_quota()
    if quota is not None and quota < usable:
        notes.append(f"cgroup CPU quota allows {quota:g} CPUs: usable cores limited to {max(1, int(quota))}")
        usable = max(1, int(quota))
    nodes = len(glob.glob("/sys/devices/system/node/node[0-9]*")) or 1
    freq, fsrc = None, "unknown"
    khz = _read("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    if khz and khz.strip().isdigit():
        freq, fsrc = int(khz) * 1e3, "cpufreq cpuinfo_max_freq"
    elif info["mhz"]:
        freq, fsrc = info["mhz"] * 1e6, "/proc/cpuinfo cpu MHz"
    facts = CPUFacts(model_name=info["model_name"] or "unknown CPU", vendor_id=info["vendor_id"],
                     cpu_family=info["cpu_family"], cpu_model=info["cpu_model"], isa=isa_flags(info["flags"]),
                     logical_cpus=len(online), usable_logical_cpus=len(affinity), sockets=max(1, sockets),
                     physical_cores=max(1, physical), usable_physical_cores=max(1, usable), numa_nodes=nodes,
                     max_frequency_hz=freq, frequency_source=fsrc, cpu_quota_cores=quota)
    return facts, notes


def _py_cpuinfo_fallback(notes: list[str]) -> dict:
    """py-cpuinfo (optional, slow) when /proc/cpuinfo is unreadable."""
    try:
        import cpuinfo  # type: ignore[import-not-found]

        d = cpuinfo.get_cpu_info()
    except Exception as e:  # noqa: BLE001 - optional dependency, any failure means "unknown"
        notes.append(f"/proc/cpuinfo unreadable and py-cpuinfo unavailable ({type(e).__name__}): CPU model unknown")
        return {}
    notes.append("/proc/cpuinfo unreadable: CPU facts from py-cpuinfo")
    hz = (d.get("hz_advertised") or [0])[0] or (d.get("hz_actual") or [0])[0]
    return {"model_name": d.get("brand_raw", ""), "vendor_id": d.get("vendor_id_raw", ""),
            "cpu_family": d.get("family"), "cpu_model": d.get("model"),
            "flags": frozenset(d.get("flags", ())), "mhz": hz / 1e6 if hz else None}


def _cgroup_cpu_quota() -> float | None:
    text = _read("/sys/fs/cgroup/cpu.max")  # cgroup v2: "max 100000" or "200000 100000"
    if text:
        quota, _, period = text.strip().partition(" ")
        if quota != "max" and period:
            return int(quota) / int(period)
        return None
    quota, period = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if quota and period and int(quota) > 0:
        return int(quota) / int(period)
    return None


def _cgroup_memory_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = (_read(path) or "").strip()
        if text.isdigit() and int(text) < 2**60:
            return int(text)
    return None


def _gpu_facts() -> tuple[tuple[GPUFacts, ...], str | None, list[str]]:
    """All NVML devices; any NVML or import failure means no GPU, with the reason in a note."""
    try:
        import pynvml
    except ImportError as e:
        return (), None, [f"no GPU: pynvml not importable ({e})"]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return (), None, [f"no GPU: NVML unavailable ({e})"]
    try:
        driver = _s(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(GPUFacts(
                index=i, name=_s(pynvml.nvmlDeviceGetName(h)), uuid=_try(lambda: _s(pynvml.nvmlDeviceGetUUID(h))) or "",
                memory_total_bytes=int(mem.total), memory_free_bytes=int(mem.free),
                pcie_max_generation=_try(lambda: pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)),
                pcie_max_width=_try(lambda: pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)),
                pcie_current_generation=_try(lambda: pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),
                pcie_current_width=_try(lambda: pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)),
                compute_capability=_try(lambda: tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h)))))
    except pynvml.NVMLError as e:
        return (), None, [f"no GPU: NVML query failed ({e})"]
    finally:
        _try(pynvml.nvmlShutdown)
    return tuple(gpus), driver, ([] if gpus else ["no GPU: NVML reports 0 devices"])


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _try(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - an optional NVML query (not supported on this GPU)
        return None


def _select_gpu(gpus: tuple[GPUFacts, ...], visible: str | None) -> tuple[int | None, list[str]]:
    """Which GPU flexplan plans for: the first one CUDA_VISIBLE_DEVICES shows (NVML ignores it)."""
    if not gpus:
        return None, []
    pick = 0
    if visible is not None:
        first = visible.split(",")[0].strip()
        if first in ("", "-1", "NoDevFiles"):
            return None, [f"no GPU: CUDA_VISIBLE_DEVICES={visible!r} hides all {len(gpus)} GPUs"]
        if first.isdigit():
            pick = int(first)
        elif first.startswith("GPU-"):
            pick = next((g.index for g in gpus if g.uuid.startswith(first)), 0)
        if pick >= len(gpus):
            return None, [f"no GPU: CUDA_VISIBLE_DEVICES={visible!r} names a GPU NVML does not list"]
    notes = []
    if len(gpus) > 1:
        notes.append(f"{len(gpus)} GPUs found; flexplan plans for one: GPU {pick} ({gpus[pick].name})")
    return pick, notes


@lru_cache(maxsize=1)
def introspect() -> LocalMachine:
    """This machine's raw facts (cached per process; ``introspect.cache_clear()`` re-reads)."""
    cpu, notes = _cpu_facts()
    total, available = parse_meminfo(_read("/proc/meminfo") or "")
    if not total:
        total = available = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        notes.append("/proc/meminfo unreadable: memory from sysconf")
    gpus, driver, gpu_notes = _gpu_facts()
    selected, sel_notes = _select_gpu(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return LocalMachine(cpu=cpu, memory_total_bytes=total, memory_available_bytes=available,
                        cgroup_memory_limit_bytes=_cgroup_memory_limit(), gpus=gpus, gpu_selected=selected,
                        driver_version=driver, notes=tuple(notes + gpu_notes + sel_notes))


# ----------------------------------------------------------------------------- Hardware for this machine


def local_hardware(gpu_memory_bytes: int | None = None, cpu_memory_bytes: int | None = None,
                   cpu_cores: int | None = None, no_gpu: bool = False,
                   machine: LocalMachine | None = None) -> Hardware:
    """This machine as a :class:`Hardware`: facts matched to hwdb, honest fallbacks (each said in
    the notes) where hwdb does not know a part. ``machine`` replaces introspection (tests)."""
    m = machine or introspect()
    notes = list(m.notes)
    cpu = _local_cpu(m, notes)
    gpu = link = None
    if m.gpu_selected is not None:
        gpu, link = _local_gpu(m.gpus[m.gpu_selected], notes)
    hw = Hardware("local", cpu, gpu, link, tuple(dict.fromkeys(notes)))
    return hwdb.apply_overrides(hw, gpu_memory_bytes=gpu_memory_bytes, cpu_memory_bytes=cpu_memory_bytes,
                                cpu_cores=cpu_cores, no_gpu=no_gpu)


def _local_cpu(m: LocalMachine, notes: list[str]) -> CPUSpec:
    c = m.cpu
    memory = m.memory_total_bytes
    if m.cgroup_memory_limit_bytes and m.cgroup_memory_limit_bytes < memory:
        memory = m.cgroup_memory_limit_bytes
        notes.append(f"cgroup memory limit {memory / 1e9:.1f} GB is below the machine's "
                     f"{m.memory_total_bytes / 1e9:.1f} GB: planning with the limit")
    entry = hwdb.match_cpu(c.model_name, c.isa)
    if entry is not None:
        notes.extend(entry.get("notes", ()))
        full = entry["cores_per_socket"] * c.sockets
        if c.usable_physical_cores < full and not entry.get("generic"):
            notes.append(f"this process may use {c.usable_physical_cores} of {full} cores: CPU peak FLOP/s scaled "
                         "to those; memory bandwidth is the full-socket figure, an upper bound")
        missing = set(entry["isa"]) - c.isa
        if missing:
            notes.append(f"CPU matched hwdb {entry['id']!r} but lacks {', '.join(sorted(missing))} here "
                         "(disabled by the hypervisor?); peak figures follow the ISA actually present")
            return _isa_cpu(c, memory, notes, entry=entry)
        return hwdb.cpu_spec(entry, c.sockets, cores=c.usable_physical_cores, memory_bytes=memory,
                             isa=c.isa, name=c.model_name)
    return _isa_cpu(c, memory, notes)


def _isa_cpu(c: CPUFacts, memory: int, notes: list[str], entry: dict | None = None) -> CPUSpec:
    """Peak from ISA x usable cores x frequency; memory bandwidth from hwdb or assumed."""
    fpc, how = flop_per_cycle_per_core(c.isa, vendor=entry["vendor"] if entry else c.vendor_id,
                                       microarchitecture=entry["microarchitecture"] if entry else None,
                                       cpu_family=c.cpu_family, cpu_model=c.cpu_model)
    hz = entry["base_frequency_hz"] if entry else c.max_frequency_hz
    hz_src = "hwdb base frequency" if entry else c.frequency_source
    if hz is None:
        hz, hz_src = ASSUMED_FREQUENCY_HZ, "assumed"
    cores = c.usable_physical_cores
    if entry:
        bw = entry["memory_bandwidth_bytes_per_s_per_socket"] * c.sockets
        bw_note = f"memory bandwidth {bw / 1e9:.1f} GB/s from hwdb"
    else:
        bw = ASSUMED_MEMORY_CHANNELS * ASSUMED_BYTES_PER_S_PER_CHANNEL * c.sockets
        bw_note = (f"memory bandwidth assumed {bw / 1e9:.0f} GB/s ({ASSUMED_MEMORY_CHANNELS} channels x "
                   f"{ASSUMED_BYTES_PER_S_PER_CHANNEL / 1e9:.0f} GB/s per socket)")
    label = f"CPU {c.model_name!r} not in hwdb" if entry is None else f"CPU {c.model_name!r}"
    notes.append(f"{label}: peak FLOP/s derived from ISA ({how}) x {cores} cores x "
                 f"{hz / 1e9:.2f} GHz ({hz_src}); {bw_note}; run calibration for measured figures")
    return CPUSpec(name=c.model_name, sockets=c.sockets, cores=cores,
                   peak_flops_per_s={dt: v * cores * hz for dt, v in fpc.items()},
                   memory_bandwidth_bytes_per_s=bw, memory_bytes=memory, isa=c.isa,
                   hwdb_id=entry["id"] if entry else None)


def _local_gpu(g: GPUFacts, notes: list[str]):
    entry = hwdb.match_gpu(g.name)
    if entry is not None:
        gpu = hwdb.gpu_spec(entry, memory_bytes=g.memory_total_bytes, name=g.name)
        notes.extend(entry.get("notes", ()))
    else:
        cc = g.compute_capability or (0, 0)
        fp16 = ASSUMED_GPU["float16"] if cc >= (7, 0) or cc == (0, 0) else ASSUMED_GPU["float32"]
        bf16 = fp16 if cc >= (8, 0) else ASSUMED_GPU["float32"]
        peak = {"float32": ASSUMED_GPU["float32"], "float16": fp16, "bfloat16": bf16}
        gpu = GPUSpec(name=g.name, memory_bytes=g.memory_total_bytes,
                      memory_bandwidth_bytes_per_s=ASSUMED_GPU["memory_bandwidth_bytes_per_s"],
                      peak_flops_per_s=peak, hwdb_id=None)
        notes.append(f"GPU {g.name!r} not in hwdb: memory {g.memory_total_bytes / 1e9:.1f} GB from NVML; bandwidth "
                     f"and FLOP/s assumed T4-class ({ASSUMED_GPU['memory_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, "
                     f"{bf16 / 1e12:g} TFLOPS bf16, {fp16 / 1e12:g} fp16, {ASSUMED_GPU['float32'] / 1e12:g} fp32); "
                     "run calibration for measured figures")
    if g.pcie_max_generation and g.pcie_max_width:
        link, link_notes = hwdb.pcie_link(g.pcie_max_generation, g.pcie_max_width)
    elif entry is not None:
        link, link_notes = hwdb.pcie_link(entry["pcie_generation"], entry["pcie_lanes"])
        link_notes = (*link_notes, "NVML gave no PCIe link width/generation: link taken from the GPU's hwdb entry")
    else:
        link, link_notes = hwdb.pcie_link(4, 16)
        link_notes = (*link_notes, "NVML gave no PCIe link width/generation: link assumed PCIe 4.0 x16")
    notes.extend(link_notes)
    return gpu, link
