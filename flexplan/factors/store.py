"""Calibration files: which machine they belong to, where they live, atomic write, checked load.

A calibration file is YAML (``format: flexplan-calibration``, ``version: 1``) holding the raw
measurements of ``flexplan calibrate`` (see ``docs/calibration.md``, "Format", for the schema). It
belongs to one machine, identified by a fingerprint: a hash of the CPU model name, its ISA class and
microarchitecture (``/proc/cpuinfo`` cpu family and model), the usable physical core count, the GPU
names and their PCIe generation/width. Files are named
``<short-cpu>-<cores>c-<short-gpu|nogpu>-<hash8>.yaml``.

Directories, in lookup order (writing goes to the first that applies):
``$FLEXPLAN_CALIBRATION_DIR``; the checkout's top-level ``calibration/`` (when flexplan runs from
a source tree); ``$XDG_CACHE_HOME/flexplan/calibration`` (default ``~/.cache/...``); last, read
only, the files of that same ``calibration/`` folder that ship inside the installed package
(``flexplan._calibration``), so a non-editable install on a machine that has one finds it.
``$FLEXPLAN_CALIBRATION_FILE`` names one file explicitly instead of the automatic lookup.

No torch here: ``flexplan hw`` and ``flexplan.plan()`` read calibrations and must stay fast.
Loading is cached per process, keyed by path, mtime and size.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from flexplan.atomic_file import write_text_atomic
from flexplan.errors import CalibrationError
from flexplan.hardware.introspect import introspect, isa_class

FORMAT = "flexplan-calibration"
VERSION = 1
DIR_ENV = "FLEXPLAN_CALIBRATION_DIR"
FILE_ENV = "FLEXPLAN_CALIBRATION_FILE"
RERUN = "re-run `flexplan calibrate` (or `flexplan calibrate --quick`)"

# What a usable file must hold: dotted path -> expected type. Optional parts (attention,
# layer overhead, thread sweep, GPU) are checked when present, in efficiency.py.
REQUIRED = {
    "created_utc": str,
    "fingerprint": str,
    "torch_version": str,
    "machine": dict,
    "machine.cpu_model": str,
    "machine.cores": int,
    "settings": dict,
    "settings.cpu_dtypes": list,
    "settings.cpu_threads": int,
    "measurements": dict,
    "measurements.cpu_gemv": list,
    "measurements.cpu_gemm": list,
}


# ----------------------------------------------------------------------------- machine identity


@dataclass(frozen=True)
class MachineIdentity:
    """What makes calibration numbers transferable: same CPU model, ISA class, microarchitecture
    and usable cores, same GPUs on the same PCIe links. The ISA class matters on its own: VMs of one
    model name ("AMD EPYC") may or may not expose AVX-512, and the CPU kernels (and their speed)
    differ. So does the microarchitecture (``cpu_arch``, "family 25 model 17"): a hypervisor that
    names every EPYC "AMD EPYC" shows a Zen 4 (family 25) and a Zen 5 (family 26) with the same
    flags, and one's factors price the other's prefill far off. "" where the CPU does not
    say (no family in /proc/cpuinfo); "?" for files written before it was recorded (they match no
    machine: re-calibrate)."""

    cpu_model: str
    cores: int
    gpus: tuple[str, ...] = ()
    pcie: tuple[str, ...] = ()  # "gen4x16" per GPU, "unknown" when NVML does not say
    isa: str = "other"  # flexplan.hardware.introspect.isa_class of the CPU's flags
    cpu_arch: str = ""  # cpu_arch(family, model): "family 25 model 17"

    @property
    def fingerprint(self) -> str:
        """16 hex digits of sha256 over the canonical JSON of the identity."""
        canon = json.dumps({"cpu_model": " ".join(self.cpu_model.split()).lower(), "cores": int(self.cores),
                            "isa": self.isa, "cpu_arch": self.cpu_arch,
                            "gpus": [" ".join(g.split()).lower() for g in self.gpus], "pcie": list(self.pcie)},
                           sort_keys=True)
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {"cpu_model": self.cpu_model, "isa": self.isa, "cpu_arch": self.cpu_arch, "cores": self.cores,
                "gpus": list(self.gpus), "pcie": list(self.pcie)}

    def describe(self) -> str:
        gpus = ", ".join(f"{g} ({p})" for g, p in zip(self.gpus, self.pcie)) or "no GPU"
        arch = f", {self.cpu_arch}" if self.cpu_arch else ""
        return f"{self.cpu_model} ({self.isa}{arch}), {self.cores} cores, {gpus}"

    @classmethod
    def from_machine_dict(cls, m: dict) -> "MachineIdentity":
        """The identity a file's ``machine`` section records (files written before the ISA class
        was part of it: derived from their ``cpu_isa`` flags, "?" when they have none; before the
        microarchitecture was: "?")."""

        isa = m.get("isa") or (isa_class(m["cpu_isa"]) if isinstance(m.get("cpu_isa"), list) else "?")
        arch = m.get("cpu_arch", "?")
        return cls(str(m.get("cpu_model", "?")), int(m.get("cores", 0) or 0), tuple(m.get("gpus") or ()),
                   tuple(m.get("pcie") or ()), str(isa), str(arch) if arch is not None else "?")

    def differences(self, other: "MachineIdentity") -> list[str]:
        """What tells ``self`` from ``other``: 'ISA avx512_bf16 vs avx2', 'cores 4 vs 2', ..."""
        out = []
        for what, a, b in (("CPU model", self.cpu_model, other.cpu_model), ("ISA", self.isa, other.isa),
                           ("microarchitecture", _arch_text(self.cpu_arch), _arch_text(other.cpu_arch)),
                           ("cores", self.cores, other.cores), ("GPUs", list(self.gpus), list(other.gpus)),
                           ("PCIe", list(self.pcie), list(other.pcie))):
            if a != b:
                out.append(f"{what} {a or 'none'} vs {b or 'none'}")
        return out


def _arch_text(arch: str) -> str:
    return "not recorded (a file from before it was)" if arch == "?" else arch or "unknown"


def cpu_arch(family: int | None, model: int | None) -> str:
    """The identity's microarchitecture: "family 25 model 17" (/proc/cpuinfo), "" when unknown."""
    return f"family {family} model {model}" if family is not None and model is not None else ""


@lru_cache(maxsize=1)
def local_identity() -> MachineIdentity:
    """This machine's identity from :func:`flexplan.hardware.introspect.introspect` (cached)."""

    m = introspect()
    pcie = tuple(f"gen{g.pcie_max_generation}x{g.pcie_max_width}" if g.pcie_max_generation and g.pcie_max_width
                 else "unknown" for g in m.gpus)
    return MachineIdentity(cpu_model=m.cpu.model_name, cores=int(m.cpu.usable_physical_cores),
                           gpus=tuple(g.name for g in m.gpus), pcie=pcie, isa=isa_class(m.cpu.isa),
                           cpu_arch=cpu_arch(m.cpu.cpu_family, m.cpu.cpu_model))


_DROP_WORDS = {"intel", "amd", "cpu", "processor", "nvidia", "geforce", "tesla", "with", "radeon", "graphics",
               "core", "gen", "generation"}


def _short(name: str, max_words: int) -> str:
    """'Intel(R) Xeon(R) Gold 6454S' -> 'xeon-gold-6454s'; 'AMD EPYC 7763 64-Core Processor' -> 'epyc-7763';
    'NVIDIA H100 80GB HBM3' -> 'h100-80gb'."""
    s = re.sub(r"\((r|tm)\)", " ", name.lower())
    s = re.sub(r"@.*$", " ", s)  # "@ 2.60GHz"
    s = re.sub(r"\b\d+-core\b|\b\d+(st|nd|rd|th)\b", " ", s)
    words = [w for w in re.split(r"[^a-z0-9]+", s) if w and w not in _DROP_WORDS]
    return "-".join(words[:max_words]) or "unknown"


def file_name(identity: MachineIdentity) -> str:
    """``<short-cpu>-<cores>c-<short-gpu|nogpu>-<hash8>.yaml``."""
    if identity.gpus:
        first = _short(identity.gpus[0], 2)
        gpu = first if len(identity.gpus) == 1 else f"{len(identity.gpus)}x{first}"
    else:
        gpu = "nogpu"
    return f"{_short(identity.cpu_model, 3)}-{identity.cores}c-{gpu}-{identity.fingerprint[:8]}.yaml"


# ----------------------------------------------------------------------------- directories


def source_checkout_dir() -> Path | None:
    """The checkout's top-level ``calibration/`` when flexplan runs from a source tree."""

    d = Path(__file__).resolve().parents[2] / "calibration"
    return d if d.is_dir() else None


def user_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flexplan" / "calibration"


def shipped_dir() -> Path | None:
    """The calibration files installed with the package (the repository's ``calibration/``)."""
    try:
        import flexplan._calibration as shipped
    except ImportError:
        return None
    return Path(shipped.__file__).resolve().parent


def calibration_dirs() -> list[Path]:
    """Where calibration files are looked up, in order (the shipped folder last: never written)."""
    dirs = []
    if os.environ.get(DIR_ENV):
        dirs.append(Path(os.environ[DIR_ENV]).expanduser())
    checkout = source_checkout_dir()
    if checkout is not None:
        dirs.append(checkout)
    dirs.append(user_cache_dir())
    shipped = shipped_dir()
    if shipped is not None:  # in a source checkout it is the checkout's folder: dropped as a repeat
        dirs.append(shipped)
    return list(dict.fromkeys(dirs))


def write_dir() -> Path:
    """Where ``flexplan calibrate`` writes: the first of :func:`calibration_dirs`."""
    return calibration_dirs()[0]


def display_path(path: Path) -> str:
    """A short way to show a calibration file: relative to the checkout or cwd, else ~/..."""
    path = Path(path).resolve()
    for base in [d.parent for d in [source_checkout_dir()] if d is not None] + [Path.cwd()]:
        try:
            return str(path.relative_to(base.resolve()))
        except ValueError:
            pass
    try:
        return "~/" + str(path.relative_to(Path.home().resolve()))
    except ValueError:
        return str(path)


# ----------------------------------------------------------------------------- writing


def plain(x: Any) -> Any:
    """``x`` with every value made a plain YAML type (numpy scalars, str subclasses, tuples)."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if x is None or type(x) in (bool, int, float, str):
        return x
    if isinstance(x, bool):
        return bool(x)
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float) or hasattr(x, "item"):
        return x.item() if hasattr(x, "item") else float(x)
    return str(x)


def write_atomic(doc: dict, path: Path) -> Path:
    """Dump ``doc`` as YAML to ``path`` atomically (``flexplan.atomic_file``): a crash leaves
    either the old file or the new one, never half of one."""
    import yaml

    return write_text_atomic(path, yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=120))


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Calibration:
    """A loaded, checked calibration file."""

    path: Path
    doc: dict
    created: dt.datetime

    @property
    def fingerprint(self) -> str:
        return self.doc["fingerprint"]

    @property
    def measurements(self) -> dict:
        return self.doc["measurements"]

    def age_s(self, now: dt.datetime | None = None) -> float:
        now = now or dt.datetime.now(dt.timezone.utc)
        return max(0.0, (now - self.created).total_seconds())

    def describe(self) -> str:
        """'calibration/epyc-2c-nogpu-1a2b3c4d.yaml, 2 h old'."""
        return f"{display_path(self.path)}, {format_age(self.age_s())} old"


def format_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def _fail(path: Path, what: str) -> CalibrationError:
    return CalibrationError(f"calibration file {display_path(path)}: {what}; {RERUN}")


def _get(doc: dict, dotted: str) -> Any:
    cur: Any = doc
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(dotted)
        cur = cur[part]
    return cur


def load_calibration(path: str | Path) -> Calibration:
    """Read and check one file (cached per path + mtime + size). Raises CalibrationError for a
    missing, unreadable, corrupt, truncated, foreign-format or wrong-version file."""
    path = Path(path).expanduser()
    try:
        st = path.stat()
    except OSError as e:
        raise _fail(path, f"cannot be read ({e.strerror or e})") from None
    return _load_cached(str(path.resolve()), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=32)
def _load_cached(path_str: str, mtime_ns: int, size: int) -> Calibration:
    import yaml

    path = Path(path_str)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(path, f"cannot be read ({e})") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise _fail(path, f"is not valid YAML{at} (corrupt or truncated)") from None
    if not isinstance(doc, dict):
        raise _fail(path, "is not a flexplan calibration file (not a YAML mapping; empty or truncated?)")
    if doc.get("format") != FORMAT:
        raise _fail(path, f"is not a flexplan calibration file (format {doc.get('format')!r}, expected {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise _fail(path, f"has version {doc.get('version')!r}; this flexplan reads version {VERSION}")
    for dotted, typ in REQUIRED.items():
        try:
            value = _get(doc, dotted)
        except KeyError:
            raise _fail(path, f"lacks `{dotted}` (truncated or hand-edited?)") from None
        if not isinstance(value, typ) or isinstance(value, bool):
            raise _fail(path, f"`{dotted}` should be a {typ.__name__}, found {type(value).__name__}")
    if doc.get("complete") is not True:
        raise _fail(path, "is incomplete (no `complete: true` at its end: truncated?)")
    try:
        created = dt.datetime.fromisoformat(doc["created_utc"].replace("Z", "+00:00"))
    except ValueError:
        raise _fail(path, f"`created_utc` {doc['created_utc']!r} is not an ISO timestamp") from None
    if created.tzinfo is None:
        created = created.replace(tzinfo=dt.timezone.utc)
    return Calibration(path=path, doc=doc, created=created)


def check_belongs_here(cal: Calibration, identity: MachineIdentity | None = None) -> None:
    """Raise CalibrationError when ``cal`` was measured on another machine."""
    identity = identity or local_identity()
    if cal.fingerprint != identity.fingerprint:
        m = cal.doc.get("machine", {})
        theirs = MachineIdentity.from_machine_dict(m if isinstance(m, dict) else {})
        diff = theirs.differences(identity)
        why = f" (differs in {'; '.join(diff)})" if diff else ""
        raise CalibrationError(
            f"calibration file {display_path(cal.path)} was measured on another machine ({theirs.describe()}; "
            f"fingerprint {cal.fingerprint}), this one is {identity.describe()} (fingerprint {identity.fingerprint})"
            f"{why}; {RERUN} on this machine")


def find_calibration(identity: MachineIdentity | None = None) -> Calibration | None:
    """The calibration of this machine: ``$FLEXPLAN_CALIBRATION_FILE`` when set (must be this
    machine's), else the newest file named with this machine's fingerprint in
    :func:`calibration_dirs`. A file so named that is corrupt or foreign raises; None when there
    is none."""
    identity = identity or local_identity()
    explicit = os.environ.get(FILE_ENV)
    if explicit:
        cal = load_calibration(explicit)
        check_belongs_here(cal, identity)
        return cal
    suffix = f"-{identity.fingerprint[:8]}.yaml"
    found: list[Calibration] = []
    for d in calibration_dirs():
        try:
            names = sorted(p for p in d.iterdir() if p.name.endswith(suffix) and not p.name.startswith("."))
        except OSError:
            continue
        for p in names:
            cal = load_calibration(p)
            check_belongs_here(cal, identity)
            found.append(cal)
    return max(found, key=lambda c: c.created) if found else None
