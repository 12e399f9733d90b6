"""Helpers shared by the benchmark scripts: machine description, timing, JSON results,
and the random-weight Llama (flexplan.synthetic) that the CPU and load-memory benchmarks use.

Every result file is ``benchmarks/results/<name>.json`` with a ``machine`` block (CPU model,
cores, threads, memory, torch/transformers versions, date) next to the figures, so a number
is never read without the machine it came from.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as `python benchmarks/x.py` from a checkout
    sys.path.insert(0, str(REPO_ROOT))


# ---- machine -------------------------------------------------------------------------
def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_isa() -> list[str]:
    """The vector extensions /proc/cpuinfo lists (the same VM name has come with AVX-512 and without)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []
    return sorted(x for x in flags if x.startswith(("avx", "amx")) or x in ("fma", "f16c"))


def machine_description() -> dict[str, Any]:
    """What the figures were measured on."""
    import torch
    import transformers

    try:
        mem_total_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem_total_bytes = None
    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        usable_cpus = os.cpu_count()
    return {
        "cpu_model": cpu_model_name(),
        "cpu_isa": _cpu_isa(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable_cpus,
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": mem_total_bytes,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` plus the machine description to ``benchmarks/results/<name>.json``."""
    data = {"benchmark": name, "machine": machine_description(), **payload}
    return write_json(RESULTS_DIR / f"{name}.json", data)


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """``data`` as JSON at ``path``, written to a temporary name and renamed: never half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    tmp.replace(path)
    return path


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and obj != obj:
        return None
    return repr(obj)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt_s(x: float | None) -> str:
    """Seconds with a unit that keeps 3 significant digits."""
    if x is None or x != x:
        return "n/a"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


# ---- the ~1 GB random-weight Llama -------------------------------------------------------
# TinyLlama widths with 8 layers: 491.8M params, 1.97 GB fp32 (flexplan/synthetic.py); decode
# reads the layers and the LM head each step, 1.71 GB. Created once in the flexplan cache.
def random_llama_dir() -> Path:
    from flexplan.synthetic import random_llama_dir as make

    return make()


def dir_size_bytes(folder: Path, suffix: str = ".safetensors") -> int:
    return sum(p.stat().st_size for p in Path(folder).glob(f"*{suffix}"))


LLAMA_CPP_ENV = "LLAMA_CPP_BIN"  # the folder of llama.cpp's built tools (llama-bench, llama-server, llama-quantize)
LLAMA_CPP_HOW = ("build them from the source the llama-cpp-python sdist vendors: `pip download --no-binary :all: "
                 "--no-deps llama-cpp-python`, unpack, `cmake -B build -DLLAMA_CURL=OFF vendor/llama.cpp && cmake "
                 "--build build --target llama-bench llama-server llama-quantize`, then set $LLAMA_CPP_BIN to build/bin")


def llama_cpp_tool(name: str) -> Path | None:
    """llama.cpp's ``name`` (llama-bench, llama-server, llama-quantize): in $LLAMA_CPP_BIN, else on
    the PATH; None where neither has it (LLAMA_CPP_HOW says how to build it)."""
    import shutil

    folder = os.environ.get(LLAMA_CPP_ENV)
    if folder:
        path = Path(folder).expanduser() / name
        return path if path.exists() else None
    found = shutil.which(name)
    return Path(found) if found else None


def triad_gbs(digits: int = 1) -> float:
    """A STREAM triad sample now (GB/s, 3 x 128 MiB arrays, best of 3): the memory state beside a figure."""
    from flexplan.measure.stream import stream_triad_bytes_per_s

    return round(stream_triad_bytes_per_s(128 * 2**20, repeats=3) / 1e9, digits)


def use_threads(threads: int):
    """This process's torch and OpenMP kernels on ``threads`` threads (OMP_NUM_THREADS unless the
    caller set it: the native kernels read it when they start); returns torch."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    torch.set_num_threads(threads)
    return torch
