"""hwdb/: datasheet and paper-table figures for CPUs, GPUs, links and whole servers, and the
resolution of a hardware name into a :class:`Hardware`.

The YAML is loaded and validated once per folder (``FLEXPLAN_HWDB_DIR`` points at another
folder, e.g. in tests). Every error names the file, the entry and the field.
"""

from __future__ import annotations

import copy
import math
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from flexplan.errors import InvalidInputError, MalformedDataError, UnknownHardwareError, suggest
from flexplan.hardware.spec import DTYPE_BYTES, CPUSpec, GPUSpec, Hardware, LinkSpec

HWDB_DIR_ENV = "FLEXPLAN_HWDB_DIR"
KINDS = ("servers", "cpus", "gpus", "links")
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx512_vp2intersect",
             "amx_bf16", "amx_int8", "amx_tile", "amx_fp16")
ASSUMED_CPU_MEMORY_BYTES_PER_SOCKET = 256 * 2**30
HINT = " (`flexplan hw --list` lists hwdb)"

# Field schemas: name -> kind. "num": positive number, "int": positive integer, "str",
# "strs": list of strings, "isa": list of ISA_FLAGS, "dtypes": {canonical dtype: positive number}.
_COMMON_OPTIONAL = {"field_sources": "map", "notes": "strs"}
_SCHEMA: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "cpus": (
        {"id": "str", "name": "str", "vendor": "str", "microarchitecture": "str",
         "cores_per_socket": "int", "base_frequency_hz": "num", "isa": "isa",
         "memory_channels": "int", "memory_type": "str",
         "memory_bandwidth_bytes_per_s_per_socket": "num",
         "peak_flops_per_s_per_socket": "dtypes", "source": "str"},
        {"match": "strs", "match_exact": "strs", "requires_isa": "isa", "generic": "bool",
         "memory_speed_mt_per_s": "num", "peak_derivation": "str", **_COMMON_OPTIONAL},
    ),
    "gpus": (
        {"id": "str", "name": "str", "nvml_names": "strs", "memory_bytes": "num",
         "memory_bandwidth_bytes_per_s": "num", "peak_flops_per_s": "dtypes",
         "pcie_generation": "int", "pcie_lanes": "int", "source": "str"},
        {"architecture": "str", **_COMMON_OPTIONAL},
    ),
    "links": (
        {"id": "str", "name": "str", "generation": "int", "lanes": "int",
         "h2d_bandwidth_bytes_per_s": "num", "d2h_bandwidth_bytes_per_s": "num", "source": "str"},
        dict(_COMMON_OPTIONAL),
    ),
    "servers": (
        {"id": "str", "name": "str", "cpu": "str", "sockets": "int",
         "cpu_memory_bytes": "num", "source": "str"},
        {"gpu": "str", "link": "str", "cpu_cores": "int", "overrides": "overrides", **_COMMON_OPTIONAL},
    ),
}
_REQUIRED_DTYPES = {"cpus": ("float32", "bfloat16"), "gpus": ("float32", "bfloat16", "float16")}
_SERVER_OVERRIDES = {
    "cpu_peak_flops_per_s": "dtypes", "cpu_memory_bandwidth_bytes_per_s": "num",
    "gpu_memory_bytes": "num", "gpu_peak_flops_per_s": "dtypes",
    "gpu_memory_bandwidth_bytes_per_s": "num", "link_bandwidth_bytes_per_s": "num",
}
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")


# ----------------------------------------------------------------------------- loading


def hwdb_dir() -> Path | Any:
    """The folder holding the YAML: ``$FLEXPLAN_HWDB_DIR``, the installed ``flexplan._hwdb``
    package, or ``hwdb/`` next to the source tree."""
    env = os.environ.get(HWDB_DIR_ENV)
    if env:
        return Path(env)
    try:
        from importlib import resources

        return resources.files("flexplan._hwdb")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "hwdb"


def load() -> dict[str, dict[str, dict]]:
    """All entries, ``{kind: {id: entry}}``, validated; cached per folder (shared: do not mutate)."""
    return _load(str(hwdb_dir()))


@lru_cache(maxsize=4)
def _load(folder: str) -> dict[str, dict[str, dict]]:
    base = hwdb_dir() if str(hwdb_dir()) == folder else Path(folder)
    db = {kind: _load_kind(base, kind) for kind in KINDS}
    _check_references(db)
    return db


def _load_kind(base, kind: str) -> dict[str, dict]:
    fname = f"{kind}.yaml"
    where = f"hwdb {fname}"
    path = base / fname
    try:
        text = path.read_text()
    except (FileNotFoundError, OSError) as e:
        raise MalformedDataError(f"{where}: cannot read {path}: {e}") from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        doc = yaml.load(text, Loader=loader)
    except yaml.YAMLError as e:
        raise MalformedDataError(f"{where}: YAML syntax error: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(kind), list):
        raise MalformedDataError(f"{where}: expected a top-level '{kind}:' list of entries")
    out: dict[str, dict] = {}
    for i, raw in enumerate(doc[kind]):
        entry = _validate_entry(raw, kind, f"{where}: entry #{i + 1}")
        if entry["id"] in out:
            raise MalformedDataError(f"{where}: entry {entry['id']!r}: duplicate id")
        out[entry["id"]] = entry
    return out


def _validate_entry(raw: Any, kind: str, where: str) -> dict:
    if not isinstance(raw, dict):
        raise MalformedDataError(f"{where}: expected a mapping of fields, got {type(raw).__name__}")
    required, optional = _SCHEMA[kind]
    if isinstance(raw.get("id"), str):
        where = where.split(": entry")[0] + f": entry {raw['id']!r}"
    entry = {}
    for field in required:
        if field not in raw or raw[field] is None:
            raise MalformedDataError(f"{where}: missing field {field!r}")
    for field, value in raw.items():
        ftype = required.get(field) or optional.get(field)
        if ftype is None:
            known = sorted({*required, *optional})
            raise MalformedDataError(f"{where}: unknown field {field!r}." + suggest(str(field), known))
        entry[field] = _check_value(value, ftype, f"{where}: field {field!r}")
    if not _ID_RE.match(entry["id"]):
        raise MalformedDataError(f"{where}: field 'id': {entry['id']!r} must be lower-case kebab-case (a-z, 0-9, -)")
    for dt in _REQUIRED_DTYPES.get(kind, ()):
        key = "peak_flops_per_s_per_socket" if kind == "cpus" else "peak_flops_per_s"
        if dt not in entry[key]:
            raise MalformedDataError(f"{where}: field {key!r}: missing dtype {dt!r}")
    if kind == "cpus" and not (entry.get("match") or entry.get("match_exact")):
        raise MalformedDataError(f"{where}: missing field 'match' (or 'match_exact')")
    if kind == "gpus":
        entry["memory_bytes"] = int(entry["memory_bytes"])
    if kind == "servers":
        entry["cpu_memory_bytes"] = int(entry["cpu_memory_bytes"])
        if entry.get("gpu") and not entry.get("link"):
            raise MalformedDataError(f"{where}: missing field 'link' (a server with a GPU needs one)")
    return entry


def _check_value(value: Any, ftype: str, where: str) -> Any:
    if ftype == "num":
        return _positive(value, where)
    if ftype == "int":
        num = _positive(value, where)
        if num != int(num):
            raise MalformedDataError(f"{where}: expected a whole number, got {value!r}")
        return int(num)
    if ftype == "str":
        if not isinstance(value, str) or not value.strip():
            raise MalformedDataError(f"{where}: expected a non-empty string, got {value!r}")
        return value.strip()
    if ftype == "bool":
        if not isinstance(value, bool):
            raise MalformedDataError(f"{where}: expected true or false, got {value!r}")
        return value
    if ftype in ("strs", "isa"):
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise MalformedDataError(f"{where}: expected a list of strings, got {value!r}")
        if ftype == "isa":
            bad = [v for v in value if v not in ISA_FLAGS]
            if bad:
                raise MalformedDataError(f"{where}: unknown ISA flag {bad[0]!r}; known: {', '.join(ISA_FLAGS)}")
        return list(value)
    if ftype == "map":
        if not isinstance(value, dict):
            raise MalformedDataError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if ftype == "dtypes":
        if not isinstance(value, dict) or not value:
            raise MalformedDataError(f"{where}: expected a mapping dtype -> FLOP/s, got {value!r}")
        bad = [k for k in value if k not in DTYPE_BYTES]
        if bad:
            raise MalformedDataError(f"{where}: unknown dtype {bad[0]!r}; use {', '.join(DTYPE_BYTES)}")
        return {k: _positive(v, f"{where}[{k}]") for k, v in value.items()}
    if ftype == "overrides":
        if not isinstance(value, dict):
            raise MalformedDataError(f"{where}: expected a mapping, got {value!r}")
        out = {}
        for k, v in value.items():
            if k not in _SERVER_OVERRIDES:
                raise MalformedDataError(f"{where}: unknown override {k!r}." + suggest(str(k), _SERVER_OVERRIDES))
            out[k] = _check_value(v, _SERVER_OVERRIDES[k], f"{where}[{k}]")
        return out
    raise AssertionError(ftype)


def _positive(value: Any, where: str) -> float:
    """A positive finite number; YAML 1.1 reads ``80e9`` as a string, so numeric strings count."""
    if isinstance(value, bool):
        raise MalformedDataError(f"{where}: expected a positive number, got {value!r}")
    try:
        num = float(value)
    except (TypeError, ValueError):
        raise MalformedDataError(f"{where}: expected a positive number, got {value!r}") from None
    if not math.isfinite(num) or num <= 0:
        raise MalformedDataError(f"{where}: expected a positive number, got {value!r}")
    return num


def _check_references(db: dict[str, dict[str, dict]]) -> None:
    for sid, s in db["servers"].items():
        for field, kind in (("cpu", "cpus"), ("gpu", "gpus"), ("link", "links")):
            ref = s.get(field)
            if ref is not None and ref not in db[kind]:
                raise MalformedDataError(
                    f"hwdb servers.yaml: entry {sid!r}: field {field!r}: unknown {kind[:-1]} id {ref!r}."
                    + suggest(ref, db[kind]))


# ----------------------------------------------------------------------------- lookups


def list_entries() -> dict[str, list[dict]]:
    """``{kind: [entry, ...]}`` for ``flexplan hw --list``; each entry has at least id and name."""
    return {kind: [copy.deepcopy(e) for e in entries.values()] for kind, entries in load().items()}


def match_cpu(model_name: str, flags: frozenset[str] | set[str] | None = None) -> dict | None:
    """The cpus.yaml entry for a /proc/cpuinfo "model name": an exact ``match_exact`` name or the
    longest ``match`` substring (case-insensitive); ``requires_isa`` must be within ``flags``
    when given. Ties go to the entry requiring more ISA flags. None when nothing matches."""
    name = " ".join(str(model_name).split()).lower()
    best, best_key = None, (0, -1)
    for entry in load()["cpus"].values():
        needs = set(entry.get("requires_isa", ()))
        if needs and (flags is None or not needs <= set(flags)):
            continue
        score = max([len(m) for m in entry.get("match", ()) if m.lower() in name]
                    + [len(m) + 1000 for m in entry.get("match_exact", ()) if m.lower() == name]
                    + [0])
        if score and (score, len(needs)) > best_key:
            best, best_key = entry, (score, len(needs))
    return copy.deepcopy(best) if best else None


def match_gpu(nvml_name: str) -> dict | None:
    """The gpus.yaml entry whose ``nvml_names`` holds this nvmlDeviceGetName() string (exact,
    case- and space-insensitive; no substring matching: "NVIDIA A10" is not an A100)."""
    name = " ".join(str(nvml_name).split()).lower()
    for entry in load()["gpus"].values():
        if any(" ".join(n.split()).lower() == name for n in entry["nvml_names"]):
            return copy.deepcopy(entry)
    return None


def pcie_link(generation: int, lanes: int) -> tuple[LinkSpec, tuple[str, ...]]:
    """The links.yaml link for a PCIe generation and width, or one derived from the PCI-SIG rate
    (with a note saying so) when hwdb has no such entry."""
    for entry in load()["links"].values():
        if entry["generation"] == generation and entry["lanes"] == lanes:
            return link_spec(entry), ()
    per_lane = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}.get(generation)
    if per_lane is None:
        per_lane = 1.969e9
        note = f"PCIe generation {generation} unknown: link bandwidth assumed PCIe 4.0 rate x{lanes}"
    else:
        note = f"PCIe {generation}.0 x{lanes} not in hwdb: bandwidth derived from the PCI-SIG rate ({per_lane * lanes / 1e9:.2f} GB/s per direction)"
    bw = per_lane * lanes
    return LinkSpec(f"PCIe {generation}.0 x{lanes}", bw, bw, None), (note,)


# ----------------------------------------------------------------------------- building specs


def cpu_spec(entry: dict, sockets: int, *, cores: int | None = None, memory_bytes: int,
             peak_flops_per_s: dict[str, float] | None = None,
             memory_bandwidth_bytes_per_s: float | None = None,
             isa: frozenset[str] | None = None, name: str | None = None) -> CPUSpec:
    """Whole-machine CPU figures from a per-socket cpus.yaml entry: per-socket x sockets, FLOP/s
    scaled to ``cores`` when fewer (or more) than sockets x cores_per_socket."""
    full = entry["cores_per_socket"] * sockets
    cores = cores or full
    peak = {dt: v * sockets * cores / full for dt, v in entry["peak_flops_per_s_per_socket"].items()}
    peak.update(peak_flops_per_s or {})
    bw = memory_bandwidth_bytes_per_s or entry["memory_bandwidth_bytes_per_s_per_socket"] * sockets
    return CPUSpec(name=name or entry["name"], sockets=sockets, cores=cores, peak_flops_per_s=peak,
                   memory_bandwidth_bytes_per_s=bw, memory_bytes=int(memory_bytes),
                   isa=frozenset(entry["isa"]) if isa is None else isa, hwdb_id=entry["id"])


def gpu_spec(entry: dict, *, memory_bytes: int | None = None, name: str | None = None,
             peak_flops_per_s: dict[str, float] | None = None,
             memory_bandwidth_bytes_per_s: float | None = None) -> GPUSpec:
    peak = dict(entry["peak_flops_per_s"])
    peak.update(peak_flops_per_s or {})
    return GPUSpec(name=name or entry["name"], memory_bytes=int(memory_bytes or entry["memory_bytes"]),
                   memory_bandwidth_bytes_per_s=memory_bandwidth_bytes_per_s or entry["memory_bandwidth_bytes_per_s"],
                   peak_flops_per_s=peak, hwdb_id=entry["id"])


def link_spec(entry: dict, bandwidth_bytes_per_s: float | None = None) -> LinkSpec:
    return LinkSpec(entry["name"], bandwidth_bytes_per_s or entry["h2d_bandwidth_bytes_per_s"],
                    bandwidth_bytes_per_s or entry["d2h_bandwidth_bytes_per_s"], entry["id"])


# ----------------------------------------------------------------------------- resolve


def is_local_name(name: str) -> bool:
    """Whether ``name`` asks for this machine (introspected) rather than an hwdb entry."""
    return " ".join(str(name).split()).lower() in ("", "local")


def resolve(name: str, **overrides) -> Hardware:
    """A server id, a composition ``CPU[xS]+GPU[+LINK]`` (parts in any order, link defaulting to
    the GPU's PCIe generation and width) or a bare CPU id (CPU-only). Case-insensitive.
    ``overrides``: gpu_memory_bytes, cpu_memory_bytes, cpu_cores, no_gpu=True. The local machine
    ("local") is introspect.local_hardware's: ``flexplan.hardware.get_hardware`` picks."""
    opts = check_overrides(overrides)
    key = " ".join(str(name).split()).lower()
    db = load()
    if key in db["servers"]:
        hw = _server_hardware(db, db["servers"][key])
    else:
        hw = _composition_hardware(db, key, str(name))
    return apply_overrides(hw, **opts)


def check_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Validated overrides (None values dropped); InvalidInputError names a bad one."""
    known = ("gpu_memory_bytes", "cpu_memory_bytes", "cpu_cores", "no_gpu")
    out = {}
    for k, v in overrides.items():
        if k not in known:
            raise InvalidInputError(f"unknown hardware override {k!r}; use {', '.join(known)}")
        if v is None:
            continue
        if k == "no_gpu":
            if not isinstance(v, bool):
                raise InvalidInputError(f"no_gpu must be True or False, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v <= 0:
            raise InvalidInputError(f"{k} must be a positive whole number, got {v!r}")
        else:
            v = int(v)
        out[k] = v
    return out


def apply_overrides(hw: Hardware, *, gpu_memory_bytes: int | None = None, cpu_memory_bytes: int | None = None,
                    cpu_cores: int | None = None, no_gpu: bool = False) -> Hardware:
    """The caller's overrides on a resolved Hardware, each said in the notes."""
    cpu, gpu, link, notes = hw.cpu, hw.gpu, hw.link, list(hw.notes)
    if cpu_cores is not None and cpu_cores != cpu.cores:
        scale = cpu_cores / cpu.cores
        cpu = _replace(cpu, cores=cpu_cores, peak_flops_per_s={k: v * scale for k, v in cpu.peak_flops_per_s.items()})
        notes.append(f"CPU cores overridden to {cpu_cores} by the caller; CPU peak FLOP/s scaled accordingly")
    if cpu_memory_bytes is not None:
        cpu = _replace(cpu, memory_bytes=cpu_memory_bytes)
        notes = [n for n in notes if not n.startswith("CPU memory size unknown")]
        notes.append(f"CPU memory overridden to {cpu_memory_bytes / 1e9:.1f} GB by the caller")
    if no_gpu:
        if gpu is not None:
            notes.append(f"GPU {gpu.name} ignored (no_gpu)")
        gpu, link = None, None
    elif gpu_memory_bytes is not None:
        if gpu is None:
            raise InvalidInputError(f"gpu_memory_bytes given but hardware {hw.name!r} has no GPU")
        gpu = _replace(gpu, memory_bytes=gpu_memory_bytes)
        notes.append(f"GPU memory overridden to {gpu_memory_bytes / 1e9:.1f} GB by the caller")
    return Hardware(hw.name, cpu, gpu, link, tuple(dict.fromkeys(notes)))


def _replace(obj, **changes):
    from dataclasses import replace

    return replace(obj, **changes)


def _server_hardware(db: dict, s: dict) -> Hardware:
    ov = s.get("overrides", {})
    cpu_entry = db["cpus"][s["cpu"]]
    cpu = cpu_spec(cpu_entry, s["sockets"], cores=s.get("cpu_cores"), memory_bytes=s["cpu_memory_bytes"],
                   peak_flops_per_s=ov.get("cpu_peak_flops_per_s"),
                   memory_bandwidth_bytes_per_s=ov.get("cpu_memory_bandwidth_bytes_per_s"))
    notes = list(cpu_entry.get("notes", ()))
    if s.get("cpu_cores") and s["cpu_cores"] != cpu_entry["cores_per_socket"] * s["sockets"]:
        notes.append(f"{s['id']}: CPU peak FLOP/s scaled to the {s['cpu_cores']} cores the machine gives "
                     f"(of {cpu_entry['cores_per_socket'] * s['sockets']} on the socket)")
    gpu = link = None
    if s.get("gpu"):
        gpu_entry = db["gpus"][s["gpu"]]
        gpu = gpu_spec(gpu_entry, memory_bytes=ov.get("gpu_memory_bytes"),
                       peak_flops_per_s=ov.get("gpu_peak_flops_per_s"),
                       memory_bandwidth_bytes_per_s=ov.get("gpu_memory_bandwidth_bytes_per_s"))
        link = link_spec(db["links"][s["link"]], ov.get("link_bandwidth_bytes_per_s"))
        notes += gpu_entry.get("notes", [])
    notes += s.get("notes", [])
    return Hardware(s["id"], cpu, gpu, link, tuple(notes))


def _composition_hardware(db: dict, key: str, original: str) -> Hardware:
    cpu = gpu = link = None
    sockets = 1
    for part in [p.strip() for p in key.split("+")]:
        m = re.fullmatch(r"(.+?)x(\d+)", part)
        if part in db["cpus"] or (m and m.group(1) in db["cpus"]):
            kind = "cpu"
        elif part in db["gpus"]:
            kind = "gpu"
        elif part in db["links"]:
            kind = "link"
        else:
            known = [*db["servers"], *db["cpus"], *db["gpus"], *db["links"]]
            what = f"unknown hardware {original!r}" if "+" not in key else f"unknown part {part!r} in hardware {original!r}"
            raise UnknownHardwareError(
                f"{what}: not a server, CPU, GPU or link id in hwdb, nor CPU[xS]+GPU[+LINK] or 'local'."
                + suggest(part, known) + HINT)
        if {"cpu": cpu, "gpu": gpu, "link": link}[kind] is not None:
            raise UnknownHardwareError(f"hardware {original!r} names more than one {kind}; use CPU[xS]+GPU[+LINK]" + HINT)
        if kind == "cpu":
            if part in db["cpus"]:
                cpu = db["cpus"][part]
            else:
                cpu, sockets = db["cpus"][m.group(1)], int(m.group(2))
                if sockets < 1:
                    raise InvalidInputError(f"hardware {original!r}: socket count must be at least 1")
        elif kind == "gpu":
            gpu = db["gpus"][part]
        else:
            link = db["links"][part]
    if cpu is None:
        raise UnknownHardwareError(f"hardware {original!r} names no CPU; use CPU[xS]+GPU[+LINK], e.g. "
                                   f"xeon-6454sx2+h100-pcie-80gb+pcie5-x16" + HINT)
    if link is not None and gpu is None:
        raise UnknownHardwareError(f"hardware {original!r} names a link but no GPU" + HINT)
    notes = list(cpu.get("notes", ()))
    notes.append(f"CPU memory size unknown for a composition: assumed 256 GiB per socket "
                 f"({sockets * 256} GiB); pass cpu_memory_bytes to set it")
    cpu_s = cpu_spec(cpu, sockets, memory_bytes=ASSUMED_CPU_MEMORY_BYTES_PER_SOCKET * sockets)
    gpu_s = link_s = None
    parts = [cpu["id"] + (f"x{sockets}" if sockets > 1 else "")]
    if gpu is not None:
        gpu_s = gpu_spec(gpu)
        notes += gpu.get("notes", [])
        if link is None:
            link_s, link_notes = pcie_link(gpu["pcie_generation"], gpu["pcie_lanes"])
            notes += link_notes
        else:
            link_s = link_spec(link)
        parts += [gpu["id"], link_s.hwdb_id or link_s.name]
    return Hardware("+".join(parts), cpu_s, gpu_s, link_s, tuple(notes))
