"""hwdb data, the name resolver, local introspection (with a mocked NVML) and the hw report."""

from __future__ import annotations

import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from flexplan.errors import InvalidInputError, MalformedDataError, UnknownHardwareError
from flexplan.hardware import get_hardware, hwdb, introspect
from flexplan.hardware.introspect import (CPUFacts, LocalMachine, flop_per_cycle_per_core, isa_flags,
                                          local_hardware, parse_cpuinfo, parse_cpulist, parse_meminfo)
from flexplan.hardware.report import format_hw, format_list

HWDB_SRC = Path(__file__).resolve().parents[1] / "hwdb"


@pytest.fixture(autouse=True)
def _fresh_introspection(monkeypatch):
    monkeypatch.delenv(hwdb.HWDB_DIR_ENV, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    introspect.introspect.cache_clear()
    yield
    introspect.introspect.cache_clear()


# ----------------------------------------------------------------------------- hwdb data


def test_every_entry_loads_and_names_a_source():
    db = hwdb.load()
    for kind in hwdb.KINDS:
        assert db[kind], kind
        for eid, e in db[kind].items():
            assert e["id"] == eid and e["name"]
            assert len(e["source"]) > 10, f"{kind} {eid} has no source"


def test_counts_and_required_parts():
    db = hwdb.load()
    assert len(db["gpus"]) >= 12
    assert len(db["cpus"]) >= 10
    assert {lk["generation"] for lk in db["links"].values()} >= {3, 4, 5}
    for gid in ("t4", "a10", "a10g", "l4", "l40s", "a100-pcie-40gb", "a100-sxm-80gb", "h100-pcie-80gb",
                "h100-sxm-80gb", "h200-sxm-141gb", "rtx-3090", "rtx-4090"):
        assert gid in db["gpus"]
    for cid in ("xeon-8352y", "xeon-8380", "xeon-6454s", "xeon-8480plus", "xeon-8592plus", "xeon-6980p",
                "epyc-7742", "epyc-7763", "epyc-9654", "xeon-8462yplus", "epyc-7r32", "xeon-8259cl",
                "xeon-6342", "xeon-6130", "amd-epyc-generic-avx2"):
        assert cid in db["cpus"]
    for lid in ("pcie3-x16", "pcie4-x16", "pcie5-x16", "pcie3-x8", "pcie4-x8", "pcie5-x8"):
        assert lid in db["links"]
    assert {"flexinfer-server1", "flexinfer-server2", "neo-testbed-g5-4xlarge", "neo-testbed-g4dn-4xlarge",
            "neo-testbed-hgx-h100", "apex-testbed-a10", "apex-testbed-t4"} <= set(db["servers"])


def test_cpu_peaks_follow_the_isa_rule():
    """peak per socket = cores x base Hz x FLOP/cycle/core for that ISA (cpus.yaml header)."""
    for cid, c in hwdb.load()["cpus"].items():
        fpc, _ = flop_per_cycle_per_core(c["isa"], vendor=c["vendor"], microarchitecture=c["microarchitecture"])
        for dt in ("float32", "bfloat16"):
            expect = c["cores_per_socket"] * c["base_frequency_hz"] * fpc[dt]
            assert c["peak_flops_per_s_per_socket"][dt] == pytest.approx(expect, rel=1e-9), (cid, dt)


def test_cpu_memory_bandwidth_is_channels_x_speed_x_8_bytes():
    for cid, c in hwdb.load()["cpus"].items():
        expect = c["memory_channels"] * c["memory_speed_mt_per_s"] * 1e6 * 8
        assert c["memory_bandwidth_bytes_per_s_per_socket"] == pytest.approx(expect, rel=1e-9), cid


def test_hand_checked_peaks():
    cpus = hwdb.load()["cpus"]
    # Ice Lake 8352Y: 32 cores x 2.2 GHz x 64 (2 AVX-512 FMA x 16 lanes x 2) = 4.5056 TFLOPS
    assert cpus["xeon-8352y"]["peak_flops_per_s_per_socket"] == {"float32": 4.5056e12, "bfloat16": 4.5056e12}
    # Sapphire Rapids 6454S: AMX 32 x 2.2 GHz x 1024 = 72.09 TFLOPS; x2 sockets ~ Table 3's 144.2
    assert 2 * cpus["xeon-6454s"]["peak_flops_per_s_per_socket"]["bfloat16"] == pytest.approx(144.2e12, rel=1e-3)
    # Zen 3 7763: 64 x 2.45 GHz x 32 = 5.0176 TFLOPS fp32, bf16 a hundredth of it
    assert cpus["epyc-7763"]["peak_flops_per_s_per_socket"]["bfloat16"] == pytest.approx(50.176e9)
    assert hwdb.load()["gpus"]["h100-sxm-80gb"]["peak_flops_per_s"]["bfloat16"] == 989.4e12  # 1979 sparse / 2


def test_flexinfer_servers_equal_table3():
    s1 = hwdb.resolve("flexinfer-server1")
    assert (s1.cpu.hwdb_id, s1.cpu.sockets, s1.cpu.cores) == ("xeon-8352y", 2, 64)
    assert s1.cpu.peak_flops_per_s["bfloat16"] == 9.0e12 and s1.cpu.peak_flops_per_s["float32"] == 9.0e12
    assert s1.cpu.memory_bytes == 256 * 10**9
    assert s1.cpu.memory_bandwidth_bytes_per_s == 311.8e9
    assert s1.gpu.hwdb_id.startswith("a100-") and s1.gpu.hwdb_id.endswith("-40gb")
    assert s1.gpu.peak_flops_per_s["bfloat16"] == 312e12
    assert s1.gpu.memory_bytes == 40 * 10**9
    assert s1.gpu.memory_bandwidth_bytes_per_s == 1299.9e9
    assert s1.link.h2d_bandwidth_bytes_per_s == s1.link.d2h_bandwidth_bytes_per_s == 32e9
    assert s1.link.name == "PCIe 4.0 x16"

    s2 = hwdb.resolve("flexinfer-server2")
    assert (s2.cpu.hwdb_id, s2.cpu.sockets, s2.cpu.cores) == ("xeon-6454s", 2, 64)
    assert s2.cpu.peak_flops_per_s["bfloat16"] == 144.2e12
    assert s2.cpu.memory_bytes == 512 * 10**9
    assert s2.cpu.memory_bandwidth_bytes_per_s == 407.8e9
    assert s2.gpu.hwdb_id == "h100-pcie-80gb"
    assert s2.gpu.peak_flops_per_s["bfloat16"] == 756e12
    assert s2.gpu.memory_bytes == 80 * 10**9
    assert s2.gpu.memory_bandwidth_bytes_per_s == 1754.4e9
    assert s2.link.h2d_bandwidth_bytes_per_s == s2.link.d2h_bandwidth_bytes_per_s == 64e9
    assert s2.link.name == "PCIe 5.0 x16"
    assert all(s.has_gpu and "Table 3" in hwdb.load()["servers"][s.name]["source"] for s in (s1, s2))


def test_compute_dtype_by_isa():
    assert hwdb.resolve("xeon-6454sx2").cpu.compute_dtype == "bfloat16"  # AMX
    assert hwdb.resolve("xeon-8480plus").cpu.compute_dtype == "bfloat16"
    # Ice Lake: bf16 peak == fp32 peak (bf16 storage, fp32 compute) -> bfloat16, as intended
    assert hwdb.resolve("xeon-8352y").cpu.compute_dtype == "bfloat16"
    assert hwdb.resolve("epyc-7763").cpu.compute_dtype == "float32"  # AVX2 only
    assert hwdb.resolve("epyc-7742").cpu.compute_dtype == "float32"
    assert hwdb.resolve("amd-epyc-generic-avx2").cpu.compute_dtype == "float32"
    assert hwdb.resolve("epyc-9654").cpu.compute_dtype == "bfloat16"  # AVX512_BF16


# ----------------------------------------------------------------------------- resolve


def test_resolve_server_is_case_insensitive_and_get_hardware_delegates():
    assert hwdb.resolve("FlexInfer-Server2") == get_hardware("flexinfer-server2")


def test_resolve_composition():
    hw = hwdb.resolve("xeon-6454sx2+h100-pcie-80gb+pcie5-x16")
    assert (hw.cpu.hwdb_id, hw.cpu.sockets, hw.cpu.cores) == ("xeon-6454s", 2, 64)
    assert hw.cpu.peak_flops_per_s["bfloat16"] == pytest.approx(2 * 72.0896e12)
    assert hw.cpu.memory_bandwidth_bytes_per_s == pytest.approx(2 * 307.2e9)
    assert hw.cpu.memory_bytes == 2 * 256 * 2**30
    assert any("256 GiB per socket" in n for n in hw.notes)
    assert hw.gpu.hwdb_id == "h100-pcie-80gb" and hw.link.hwdb_id == "pcie5-x16"
    assert hw.link.h2d_bandwidth_bytes_per_s == 63e9


def test_resolve_composition_link_defaults_to_gpu_pcie_and_order_is_free():
    hw = hwdb.resolve("T4+Xeon-6130x2")
    assert hw.link.hwdb_id == "pcie3-x16"
    assert hw.name == "xeon-6130x2+t4+pcie3-x16"
    assert hwdb.resolve("xeon-8352yx2+a100-pcie-40gb").link.hwdb_id == "pcie4-x16"


def test_resolve_bare_cpu_is_cpu_only():
    hw = hwdb.resolve("epyc-9654")
    assert not hw.has_gpu and hw.gpu is None and hw.link is None
    assert (hw.cpu.sockets, hw.cpu.cores) == (1, 96)


def test_unknown_name_suggests_close_names():
    with pytest.raises(UnknownHardwareError) as e:
        hwdb.resolve("flexinfer-server3")
    assert "Did you mean" in str(e.value) and "flexinfer-server" in str(e.value)
    assert "flexplan hw --list" in str(e.value)
    with pytest.raises(UnknownHardwareError) as e:
        hwdb.resolve("xeon-6454sx2+h100-pcie-80g")
    assert "h100-pcie-80g" in str(e.value) and "h100-pcie-80gb" in str(e.value)
    with pytest.raises(UnknownHardwareError):
        hwdb.resolve("h100-pcie-80gb+pcie5-x16")  # no CPU


def test_overrides():
    base = hwdb.resolve("flexinfer-server2")
    hw = hwdb.resolve("flexinfer-server2", gpu_memory_bytes=24 * 10**9, cpu_memory_bytes=64 * 10**9, cpu_cores=16)
    assert hw.gpu.memory_bytes == 24 * 10**9 and hw.cpu.memory_bytes == 64 * 10**9
    assert hw.cpu.cores == 16
    assert hw.cpu.peak_flops_per_s["bfloat16"] == pytest.approx(base.cpu.peak_flops_per_s["bfloat16"] / 4)
    assert sum("overridden" in n for n in hw.notes) == 3
    cpu_only = hwdb.resolve("flexinfer-server1", no_gpu=True)
    assert cpu_only.gpu is None and not cpu_only.has_gpu
    assert hwdb.resolve("flexinfer-server1", gpu_memory_bytes=None) == hwdb.resolve("flexinfer-server1")
    composed = hwdb.resolve("epyc-7763x2", cpu_memory_bytes=10**12)
    assert not any("256 GiB" in n for n in composed.notes)
    with pytest.raises(InvalidInputError):
        hwdb.resolve("flexinfer-server1", gpu_memory_bytes=-1)
    with pytest.raises(InvalidInputError):
        hwdb.resolve("flexinfer-server1", gpu_mem=1)
    with pytest.raises(InvalidInputError):
        hwdb.resolve("epyc-7763", gpu_memory_bytes=10**9)


def test_match_cpu_and_gpu():
    assert hwdb.match_cpu("Intel(R) Xeon(R) Platinum 8352Y CPU @ 2.20GHz")["id"] == "xeon-8352y"
    assert hwdb.match_cpu("Intel(R) Xeon(R) Platinum 8480+")["id"] == "xeon-8480plus"
    assert hwdb.match_cpu("AMD EPYC 7763 64-Core Processor")["id"] == "epyc-7763"
    assert hwdb.match_cpu("AMD EPYC", {"avx2"})["id"] == "amd-epyc-generic-avx2"
    assert hwdb.match_cpu("AMD EPYC", {"avx2", "avx512f", "avx512_bf16"})["id"] == "amd-epyc-generic-zen4"
    # Zen 5 shows AVX512_VP2INTERSECT, which Zen 4 lacks: its full 512-bit datapath doubles the peak
    zen5 = hwdb.match_cpu("AMD EPYC", {"avx2", "avx512f", "avx512_bf16", "avx512_vp2intersect"})
    assert zen5["id"] == "amd-epyc-generic-zen5"
    assert hwdb.match_cpu("AMD EPYC 7B13", {"avx2"}) is None  # generic entries match the SKU-less name only
    assert hwdb.match_cpu("Fancy CPU 9000") is None
    assert hwdb.match_gpu("NVIDIA A10")["id"] == "a10"  # not an A100
    assert hwdb.match_gpu("nvidia a100-sxm4-80gb")["id"] == "a100-sxm-80gb"
    assert hwdb.match_gpu("Tesla T4")["id"] == "t4"
    assert hwdb.match_gpu("NVIDIA H100 80GB HBM3")["id"] == "h100-sxm-80gb"
    assert hwdb.match_gpu("NVIDIA B200") is None


def test_pcie_link_lookup_and_derivation():
    link, notes = hwdb.pcie_link(5, 16)
    assert link.hwdb_id == "pcie5-x16" and notes == ()
    link, notes = hwdb.pcie_link(4, 2)
    assert link.hwdb_id is None and link.h2d_bandwidth_bytes_per_s == pytest.approx(2 * 1.969e9)
    assert "not in hwdb" in notes[0]


def test_list_entries():
    entries = hwdb.list_entries()
    assert set(entries) == set(hwdb.KINDS)
    assert all("id" in e and "name" in e for kind in entries.values() for e in kind)


# ----------------------------------------------------------------------------- malformed hwdb


def _hwdb_copy(tmp_path, monkeypatch, fname, edit):
    for f in HWDB_SRC.glob("*.yaml"):
        shutil.copy(f, tmp_path / f.name)
    p = tmp_path / fname
    p.write_text(edit(p.read_text()))
    monkeypatch.setenv(hwdb.HWDB_DIR_ENV, str(tmp_path))


def test_malformed_yaml_syntax(tmp_path, monkeypatch):
    _hwdb_copy(tmp_path, monkeypatch, "gpus.yaml", lambda t: t.replace("  - id: t4\n", "  - id: t4\n   oops: [\n", 1))
    with pytest.raises(MalformedDataError, match=r"gpus\.yaml: YAML syntax error"):
        hwdb.load()


def test_malformed_missing_field(tmp_path, monkeypatch):
    _hwdb_copy(tmp_path, monkeypatch, "gpus.yaml",
               lambda t: t.replace("    memory_bandwidth_bytes_per_s: 320e9\n", "", 1))
    with pytest.raises(MalformedDataError) as e:
        hwdb.load()
    assert "gpus.yaml" in str(e.value) and "'t4'" in str(e.value) and "memory_bandwidth_bytes_per_s" in str(e.value)


def test_malformed_negative_number(tmp_path, monkeypatch):
    _hwdb_copy(tmp_path, monkeypatch, "cpus.yaml",
               lambda t: t.replace("cores_per_socket: 32", "cores_per_socket: -32", 1))
    with pytest.raises(MalformedDataError) as e:
        hwdb.resolve("flexinfer-server2")
    assert "cpus.yaml" in str(e.value) and "cores_per_socket" in str(e.value) and "positive" in str(e.value)


def test_malformed_unknown_reference_and_field(tmp_path, monkeypatch):
    _hwdb_copy(tmp_path, monkeypatch, "servers.yaml", lambda t: t.replace("gpu: h100-pcie-80gb", "gpu: h100-pcie-81gb", 1))
    with pytest.raises(MalformedDataError) as e:
        hwdb.load()
    assert "servers.yaml" in str(e.value) and "'gpu'" in str(e.value) and "h100-pcie-80gb" in str(e.value)
    sub = tmp_path / "b"
    sub.mkdir()
    _hwdb_copy(sub, monkeypatch, "links.yaml", lambda t: t.replace("    lanes: 16\n", "    lanes: 16\n    lane: 16\n", 1))
    with pytest.raises(MalformedDataError, match=r"links\.yaml: entry 'pcie3-x16': unknown field 'lane'"):
        hwdb.load()


# ----------------------------------------------------------------------------- parsers

FAKE_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 106
model name\t: Intel(R) Xeon(R) Platinum 8352Y CPU @ 2.20GHz
cpu MHz\t\t: 2200.000
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8352Y CPU @ 2.20GHz
cpu MHz\t\t: 3400.000
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni

processor\t: 2
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8352Y CPU @ 2.20GHz
cpu MHz\t\t: 2200.000
physical id\t: 1
core id\t\t: 0
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni
"""


def test_parse_fake_cpuinfo_meminfo_cpulist():
    info = parse_cpuinfo(FAKE_CPUINFO)
    assert info["model_name"] == "Intel(R) Xeon(R) Platinum 8352Y CPU @ 2.20GHz"
    assert (info["vendor_id"], info["cpu_family"], info["cpu_model"]) == ("GenuineIntel", 6, 106)
    assert info["processors"] == {0: ("0", "0"), 1: ("0", "0"), 2: ("1", "0")}
    assert len({p for p, _ in info["processors"].values()}) == 2  # sockets
    assert len(set(info["processors"].values())) == 2  # physical cores (0 and 1 are hyperthreads)
    assert info["mhz"] == 3400.0
    assert isa_flags(info["flags"]) == {"avx2", "avx512f", "avx512_vnni"}
    assert parse_meminfo("MemTotal:  1024 kB\nMemFree:  10 kB\nMemAvailable:   512 kB\n") == (1024 * 1024, 512 * 1024)
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}


def test_flop_rule():
    assert flop_per_cycle_per_core({"avx2"}, vendor="AuthenticAMD", cpu_family=25)[0] == {"float32": 32, "bfloat16": 0.32}
    assert flop_per_cycle_per_core({"avx2", "avx512f"}, vendor="GenuineIntel")[0] == {"float32": 64, "bfloat16": 64}
    assert flop_per_cycle_per_core({"avx2", "avx512f", "amx_bf16"}, vendor="intel")[0]["bfloat16"] == 1024
    zen4 = flop_per_cycle_per_core({"avx2", "avx512f", "avx512_bf16"}, vendor="AuthenticAMD", cpu_family=25)[0]
    assert zen4 == {"float32": 32, "bfloat16": 64}


# ----------------------------------------------------------------------------- this machine


def test_introspection_of_this_machine():
    m = introspect.introspect()
    assert m.cpu.usable_physical_cores >= 1 and m.cpu.sockets >= 1 and m.cpu.numa_nodes >= 1
    assert m.memory_total_bytes > 0 and 0 < m.memory_available_bytes <= m.memory_total_bytes
    if sys.platform == "linux" and Path("/proc/cpuinfo").read_text().count("avx2"):
        assert "avx2" in m.cpu.isa
    hw = local_hardware()
    assert hw.name == "local" and hw.cpu.cores == m.cpu.usable_physical_cores
    assert hw.cpu.memory_bytes > 0 and hw.cpu.peak_flops_per_s["float32"] > 0
    if not m.gpus:  # this dev machine: no GPU, and the notes say why
        assert hw.gpu is None and any(n.startswith("no GPU") for n in hw.notes)
    assert get_hardware("local", no_gpu=True).gpu is None


def test_introspect_module_does_not_import_torch():
    code = ("import sys; import flexplan.hardware.introspect as i, flexplan.hardware.report as r; "
            "i.local_hardware(); assert 'torch' not in sys.modules, 'torch imported'")
    root = str(Path(__file__).resolve().parents[1])
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root,
                   env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"})


def _facts(model, isa, usable, *, sockets=1, physical=None, vendor="GenuineIntel", family=6, ghz=3.0):
    return CPUFacts(model_name=model, vendor_id=vendor, cpu_family=family, cpu_model=1, isa=frozenset(isa),
                    logical_cpus=2 * (physical or usable), usable_logical_cpus=2 * usable, sockets=sockets,
                    physical_cores=physical or usable, usable_physical_cores=usable, numa_nodes=sockets,
                    max_frequency_hz=ghz * 1e9, frequency_source="test")


def test_local_hardware_matches_hwdb_cpu_and_scales_to_usable_cores():
    spr = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile"}
    m = LocalMachine(cpu=_facts("Intel(R) Xeon(R) Gold 6454S", spr, 16, sockets=2, physical=64),
                     memory_total_bytes=512 * 10**9, memory_available_bytes=500 * 10**9)
    hw = local_hardware(machine=m)
    assert hw.cpu.hwdb_id == "xeon-6454s" and hw.cpu.cores == 16 and hw.cpu.sockets == 2
    assert hw.cpu.peak_flops_per_s["bfloat16"] == pytest.approx(16 * 2.2e9 * 1024)
    assert hw.cpu.memory_bandwidth_bytes_per_s == pytest.approx(2 * 307.2e9)
    assert hw.cpu.memory_bytes == 512 * 10**9 and hw.cpu.compute_dtype == "bfloat16"
    assert any("16 of 64 cores" in n for n in hw.notes)


def test_local_hardware_unknown_cpu_derives_peak_from_isa():
    m = LocalMachine(cpu=_facts("Fancy CPU 9000", {"avx2"}, 4, vendor="AuthenticAMD", family=25, ghz=3.0),
                     memory_total_bytes=32 * 10**9, memory_available_bytes=30 * 10**9,
                     cgroup_memory_limit_bytes=8 * 10**9)
    hw = local_hardware(machine=m)
    assert hw.cpu.hwdb_id is None
    assert hw.cpu.peak_flops_per_s["float32"] == pytest.approx(4 * 3e9 * 32)
    assert hw.cpu.peak_flops_per_s["bfloat16"] == pytest.approx(4 * 3e9 * 32 / 100)
    assert hw.cpu.compute_dtype == "float32" and hw.cpu.memory_bandwidth_bytes_per_s == 40e9
    assert hw.cpu.memory_bytes == 8 * 10**9  # the cgroup limit
    note = next(n for n in hw.notes if "not in hwdb" in n)
    assert "AVX2" in note and "4 cores" in note and "3.00 GHz" in note and "assumed 40 GB/s" in note


# ----------------------------------------------------------------------------- mocked NVML


class _FakeNVMLError(Exception):
    pass


def _fake_pynvml(devices, *, init_error=None):
    """A pynvml stand-in; devices: list of (name, total_bytes, max_gen, max_width)."""
    mod = types.ModuleType("pynvml")
    mod.NVMLError = _FakeNVMLError

    def init():
        if init_error:
            raise _FakeNVMLError(init_error)

    mod.nvmlInit = init
    mod.nvmlShutdown = lambda: None
    mod.nvmlSystemGetDriverVersion = lambda: "550.54.15"
    mod.nvmlDeviceGetCount = lambda: len(devices)
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetName = lambda h: devices[h][0]
    mod.nvmlDeviceGetUUID = lambda h: f"GPU-{h:04d}"
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=devices[h][1], free=devices[h][1] - 2**30, used=2**30)
    mod.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: devices[h][2]
    mod.nvmlDeviceGetMaxPcieLinkWidth = lambda h: devices[h][3]
    mod.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 1  # idle power saving
    mod.nvmlDeviceGetCurrPcieLinkWidth = lambda h: devices[h][3]

    def cc(h):
        raise _FakeNVMLError("Not Supported")

    mod.nvmlDeviceGetCudaComputeCapability = cc
    return mod


def test_mocked_nvml_h100_sxm_on_pcie5(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([("NVIDIA H100 80GB HBM3", 85520809984, 5, 16)]))
    hw = local_hardware()
    assert hw.has_gpu and hw.gpu.hwdb_id == "h100-sxm-80gb" and hw.link.hwdb_id == "pcie5-x16"
    assert hw.gpu.memory_bytes == 85520809984  # NVML's exact total, not the datasheet's 80e9
    assert hw.gpu.peak_flops_per_s["bfloat16"] == 989.4e12
    assert hw.link.h2d_bandwidth_bytes_per_s == 63e9
    text = format_hw(hw, calibration_line="calibration in use: test")
    assert "h100-sxm-80gb" in text and "PCIe max gen 5 x16" in text and "calibration in use: test" in text


def test_mocked_nvml_unknown_gpu_and_visible_devices(monkeypatch):
    devices = [("NVIDIA A10", 24 * 2**30, 4, 16), ("NVIDIA Future GPU", 96 * 2**30, 6, 16)]
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(devices))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    hw = local_hardware()
    assert hw.gpu.hwdb_id is None and hw.gpu.memory_bytes == 96 * 2**30
    assert hw.gpu.memory_bandwidth_bytes_per_s == 320e9
    assert any("not in hwdb" in n and "NVML" in n for n in hw.notes)
    assert any("2 GPUs found" in n for n in hw.notes)
    assert hw.link.hwdb_id is None and hw.link.h2d_bandwidth_bytes_per_s == pytest.approx(16 * 7.563e9)
    introspect.introspect.cache_clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_hardware().gpu is None


def test_nvml_failure_means_no_gpu_with_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([], init_error="Driver Not Loaded"))
    hw = local_hardware()
    assert hw.gpu is None and "no GPU: NVML unavailable (Driver Not Loaded)" in hw.notes
    assert "none: NVML unavailable" in format_hw(hw)


# ----------------------------------------------------------------------------- report


def test_format_hw_and_list():
    text = format_hw(hwdb.resolve("flexinfer-server1"))
    for s in ("xeon-8352y", "a100-pcie-40gb", "pcie4-x16", "compute dtype: bfloat16", "calibration:", "32.00 GB/s"):
        assert s in text
    local = format_hw(introspect.introspect())
    assert "usable physical cores" in local and "NUMA nodes" in local and "available" in local
    listing = format_list()
    for kind in hwdb.list_entries().values():
        for e in kind:
            assert e["id"] in listing
