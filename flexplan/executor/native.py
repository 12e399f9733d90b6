"""flexplan's native CPU GEMV (``native_gemv.c``): compiled on first use, cached, checked, optional.

The C source ships inside the package. The first process that needs it compiles it with the
system C compiler (``$CC``, else ``cc``/``gcc``) for this CPU (``-O3 -march=native -fopenmp``,
under a second) into the user cache (``<cache>/native/``), keyed by a hash of the source, the
compiler's version and the CPU's flags; the library is written under a temporary name and renamed,
so a crash never leaves a half-written one. It is loaded with ctypes (no torch headers, no build
step at ``pip install``) and checked against ``F.linear`` before first use.

When anything fails (no compiler, no OpenMP, not Linux/x86, a failed check, or
``FLEXPLAN_NATIVE=0``), :func:`status` says why and the CPU executor falls back to oneDNN's packed
weights: the native kernel is an accelerator, never a requirement.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native_gemv.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
DISABLE_ENV = "FLEXPLAN_NATIVE"


class NativeGemv:
    """The loaded library: ``gemv(P, x, y, bias, out, in, batch)`` on blocked float32 weights."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        lib.flexplan_gemv_isa.restype = ctypes.c_char_p
        lib.flexplan_gemv_block.restype = ctypes.c_int
        self.isa = lib.flexplan_gemv_isa().decode()
        self.block = int(lib.flexplan_gemv_block())
        self._gemv = lib.flexplan_blocked_gemv_f32
        self._gemv.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        self._gemv.restype = None
        self._lib = lib  # keeps the library loaded

    def gemv(self, blocked: torch.Tensor, x2d: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x2d @ W.T (+ bias)`` for ``blocked`` = W as [out/64, in, 64]; x2d [batch, in] float32,
        contiguous. Returns a new [batch, out] float32 tensor."""
        n_blocks, k, block = blocked.shape
        out = n_blocks * block
        y = torch.empty(x2d.shape[0], out, dtype=torch.float32)
        self._gemv(blocked.data_ptr(), x2d.data_ptr(), y.data_ptr(), None if bias is None else bias.data_ptr(),
                   out, k, x2d.shape[0])
        return y


def _cache_root() -> Path:
    from flexplan.smollm import cache_dir

    return cache_dir() / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    return None


def _compile(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(r.stderr or r.stdout).strip()[-400:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _self_check(native: NativeGemv) -> None:
    """The kernel against F.linear in float64 on odd sizes, with and without bias and batch rows
    past one group; raises if it is off."""
    g = torch.Generator().manual_seed(0)
    for out, k, batch, with_bias in ((128, 37, 1, True), (64, 300, 6, False), (192, 64, 3, True)):
        w = torch.randn(out, k, generator=g)
        x = torch.randn(batch, k, generator=g)
        b = torch.randn(out, generator=g) if with_bias else None
        blocked = w.view(out // native.block, native.block, k).transpose(1, 2).contiguous()
        y = native.gemv(blocked, x, b).double()
        ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        err = float((y - ref).abs().max() / ref.abs().max())
        if not err < 1e-5:
            raise RuntimeError(f"self-check failed: relative error {err:.2e} at out={out} in={k} batch={batch}")


@functools.lru_cache(maxsize=None)
def status() -> tuple[NativeGemv | None, str]:
    """(the checked native GEMV or None, a one-line reason)."""
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None, f"disabled by {DISABLE_ENV}=0"
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"native GEMV is built for Linux x86-64 only (this is {platform.system()} {platform.machine()})"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc)"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + _cpu_flags().encode()
                             + " ".join(CFLAGS).encode()).hexdigest()[:16]
        target = _cache_root() / f"gemv-{key}.so"
        if not target.exists():
            _compile(cc, target)
        native = NativeGemv(ctypes.CDLL(str(target)), target)
        _self_check(native)
    except Exception as e:  # noqa: BLE001 - any failure means: no native kernel, with the reason
        return None, f"native GEMV unavailable: {type(e).__name__}: {e}"
    return native, f"native GEMV ({native.isa}) from {target}"


def available() -> bool:
    return status()[0] is not None
