"""Probes of tens of milliseconds: what state the host memory (and, below, the CPU's compute) is in now.

On some machines (VMs sharing a host, among them) the memory bandwidth flips between states, the
STREAM triad moving by up to ~2x from minute to minute. A calibration records whichever
state it met; this probe tells the states apart, cheaply enough to run before each calibration
step and again whenever the planner plans for ``hardware="local"``.

What it measures: a numpy copy ``a[:] = b`` over two float64 buffers of
:func:`probe_buffer_bytes` each (twice the last-level cache, so the copy streams from DRAM),
split in :func:`probe_threads` slices copied at once by as many Python threads (numpy releases
the GIL while it copies), counted as ``2 x n_bytes`` moved (read b, write a; write-allocate not
counted, as in STREAM), best of :data:`PROBE_REPEATS` runs. The buffers stay allocated in this
module between probes (the first probe touches every page untimed; later ones time no page
faults). Not the STREAM figure of ``stream.py`` (no torch: ``flexplan.plan()`` stays torch-free
and fast); only RATIOS of probe figures (now against calibration time) are used. Where torch is
loaded anyway, a second probe times decode's own GEMV (:func:`measure_gemv_bytes_per_s`, below),
which follows decode more closely.

Why threads: decode's GEMV runs in all of torch's threads, and a state change shows in what
several threads together can draw from memory; one thread alone reads about the same in either
state, so a one-thread copy barely follows decode (``benchmarks/bench_probe_tracking.py`` measures
how well each probe tracks the GEMV). A calibration whose samples came from another thread count
is not compared with this probe (``memory_state``).

``FLEXPLAN_MEMORY_PROBE=0`` turns the plan-time probe off (tests and benchmarks that want fixed
factors); ``flexplan calibrate`` records its samples whatever it says.
"""

from __future__ import annotations

import glob
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np


PROBE_ENV = "FLEXPLAN_MEMORY_PROBE"
PROBE_TTL_S = 5.0  # a probe this recent is reused: a loop of plan() calls does not re-probe each time
PROBE_REPEATS = 3
CONFIRM_BELOW = 0.15  # a reading this much below the calibration's median is measured again ...
CONFIRM_ABOVE = 0.15  # ... and one this much above it, so a one-off fast burst does not rescale a plan
CONFIRM_PAUSE_S = 0.05  # ... after this pause
MIN_BUFFER_BYTES = 16 * 2**20
MAX_BUFFER_BYTES = 128 * 2**20  # two of them stay allocated: 256 MB held (more only on a host with 16+ GB per 128 MB)
MAX_PROBE_THREADS = 16  # slices of at least 1 MB; a state shows in the ratio, not in saturating a big socket

_BUFFERS: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # n_bytes -> (a, b), pages already touched
_LAST: dict[str, tuple[float, float | None, str]] = {}  # probe -> (time.monotonic(), figure or None, why it failed)


def llc_bytes() -> int:
    """Size of the last-level cache (one instance), from sysfs; 32 MiB when unknown."""
    best = 0
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            size = open(f"{d}/size").read().strip().upper()
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1], 1)
            best = max(best, int(size.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best or 32 * 2**20


def beyond_llc_bytes(llc_multiple: float, floor_bytes: int, cap_bytes: int) -> int:
    """A buffer ``llc_multiple`` times the last-level cache, at least ``floor_bytes``, at most
    ``cap_bytes`` or 1/64 of the host's memory if that is more. A fixed cap would measure the cache
    on big-LLC hosts (some report a few hundred MB of LLC), not the memory."""
    try:
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        host = 0
    return int(min(max(llc_multiple * llc_bytes(), floor_bytes), max(cap_bytes, host // 64)))


def probe_enabled() -> bool:
    """False when ``$FLEXPLAN_MEMORY_PROBE`` is 0, false, no or off."""
    return os.environ.get(PROBE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def probe_buffer_bytes() -> int:
    """Each of the probe's two buffers: twice the last-level cache, at least 16 MB, at most 128 MB
    or 1/64 of the host's memory (microbench.beyond_llc_bytes)."""

    return beyond_llc_bytes(2, MIN_BUFFER_BYTES, MAX_BUFFER_BYTES)


def probe_threads() -> int:
    """Threads the memory probe copies in: the CPUs this process may run on (at most
    :data:`MAX_PROBE_THREADS`), as decode's kernels use them."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(int(n), MAX_PROBE_THREADS))


def describe_probe() -> str:
    """What the probe measures, for the calibration file and for humans."""
    n = probe_threads()
    return (f"numpy copy of {probe_buffer_bytes() / 2**20:.0f} MB in {n} thread{'s' if n > 1 else ''}, "
            f"best of {PROBE_REPEATS}, 2 x bytes counted")


def _buffers(n_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    bufs = _BUFFERS.get(n_bytes)
    if bufs is None:
        n = max(1, n_bytes // 8)
        bufs = (np.zeros(n), np.ones(n))  # zeros() maps lazily: the untimed first copy touches its pages
        np.copyto(bufs[0], bufs[1])
        _BUFFERS.clear()  # one size at a time
        _BUFFERS[n_bytes] = bufs
    return bufs


_POOL: dict[int, ThreadPoolExecutor] = {}  # threads -> a pool kept for later probes


def _copy_in_threads(a: np.ndarray, b: np.ndarray, threads: int):
    """A function copying ``b`` into ``a`` in ``threads`` slices at once (one thread: a plain copy)."""
    if threads <= 1:
        return lambda: np.copyto(a, b)
    pool = _POOL.get(threads)
    if pool is None:
        pool = _POOL[threads] = ThreadPoolExecutor(threads, thread_name_prefix="flexplan-membw")
    edges = np.linspace(0, a.size, threads + 1).astype(int)
    spans = list(zip(edges[:-1], edges[1:]))

    def one(span):
        np.copyto(a[span[0]:span[1]], b[span[0]:span[1]])

    return lambda: list(pool.map(one, spans))


def measure_copy_bytes_per_s(n_bytes: int | None = None, repeats: int = PROBE_REPEATS,
                             threads: int | None = None) -> float:
    """One probe, uncached: bytes/s of the best of ``repeats`` copies of ``n_bytes`` (default
    :func:`probe_buffer_bytes`) in ``threads`` slices (default :func:`probe_threads`), counting
    ``2 x n_bytes`` per copy."""
    a, b = _buffers(int(n_bytes or probe_buffer_bytes()))
    copy = _copy_in_threads(a, b, int(threads or probe_threads()))
    copy()  # untimed: the pool's threads started, every slice's pages mapped in their thread
    best_s = float("inf")
    for _ in range(max(1, int(repeats))):
        t0 = time.perf_counter()
        copy()
        best_s = min(best_s, time.perf_counter() - t0)
    return 2.0 * a.nbytes / best_s


_HELD: list[bool] = []  # non-empty within held_probes()


@contextmanager
def held_probes():
    """Within it, a probe's figure, once measured, is reused whatever its age (``flexplan
    validate`` prices a grid point at the state probed right before its timed runs, however long
    they took, as a plan made just before them would be)."""
    _HELD.append(True)
    try:
        yield
    finally:
        _HELD.pop()


def _cached(kind: str, measure, unit: str, max_age_s: float) -> float:
    """The figure of probe ``kind`` now: one at most ``max_age_s`` old is reused (0: probe afresh;
    any age within :func:`held_probes`). Raises RuntimeError (with the reason) when the probe
    failed; a failure is remembered for as long as a figure would be."""
    now = time.monotonic()
    last = _LAST.get(kind)
    if last is None or (now - last[0] > max_age_s and not _HELD):
        try:
            rate = measure()
            last = (time.monotonic(), rate, "") if rate > 0 and np.isfinite(rate) else \
                (time.monotonic(), None, f"measured {rate!r} {unit}")
        except (MemoryError, OSError, ValueError, ZeroDivisionError) as e:
            last = (time.monotonic(), None, f"{type(e).__name__}: {e}")
        _LAST[kind] = last
    if last[1] is None:
        raise RuntimeError(last[2])
    return last[1]


def confirmed(measure, reference: float | None = None) -> float:
    """``measure()``, measured once more after a short pause when it reads slower than
    ``reference`` by more than :data:`CONFIRM_BELOW` (or always, without a reference), keeping the
    faster reading: a state lasts minutes, a neighbour's burst milliseconds, and one slow reading
    alone can scale a whole plan by several times. A reading faster than
    ``reference`` by more than :data:`CONFIRM_ABOVE` is measured once more too, keeping the reading
    nearer the reference: a new state must show twice (a one-off fast reading, such as a process's
    first, does not mean decode will run faster)."""
    first = measure()
    if reference is not None and reference * (1 - CONFIRM_BELOW) <= first <= reference * (1 + CONFIRM_ABOVE):
        return first
    time.sleep(CONFIRM_PAUSE_S)
    second = measure()
    if reference is not None and first > reference * (1 + CONFIRM_ABOVE):
        return min(first, max(second, reference))
    return max(first, second)


def probe_bytes_per_s(max_age_s: float = PROBE_TTL_S, reference: float | None = None) -> float:
    """The memory probe's figure now (cached for ``max_age_s``; RuntimeError when it failed);
    with the calibration's ``reference``, a slow reading is confirmed (:func:`confirmed`)."""
    return _cached("memory", lambda: confirmed(measure_copy_bytes_per_s, reference), "bytes/s", max_age_s)


# ---- the GEMV probe: what decode itself does ------------------------------------------------
# The copy above tracks decode's bandwidth only loosely: a copy is not the kernel decode runs, and
# in a noisy state the executor's own GEMV follows the next decode GEMVs markedly better
# (``benchmarks/bench_probe_tracking.py`` compares them). So where torch is loaded (calibration,
# ``flexplan.load``, ``run``, ``validate``), the plan-time state is read by that kernel over weights
# that stream from memory; a torch-free ``plan()`` keeps the copy.
GEMV_PROBE_ROWS = 4096  # fp32 weights of GEMV_PROBE_ROWS x in, in sized to gemv_probe_bytes()
GEMV_PROBE_REPEATS = 3
_GEMV: dict[str, object] = {}  # "kernel", "weight", "x", "bytes": the probe's weights, kept (gemv_probe_bytes())


def gemv_probe_usable() -> bool:
    """Whether the GEMV probe can run without importing torch (a ``plan()`` in a process that has
    not loaded it stays torch-free and uses the copy)."""
    return "torch" in sys.modules


def gemv_probe_threads() -> int:
    """Threads the GEMV probe (and decode's kernels) run in: torch's intra-op threads now."""
    import torch

    return int(torch.get_num_threads())


def describe_gemv_probe() -> str:
    return (f"flexplan's CPU GEMV (cpu_linear.LinearKernel), float32 {GEMV_PROBE_ROWS} x "
            f"{_gemv_in_features()} weights, batch 1, torch's threads, best of {GEMV_PROBE_REPEATS}")


def gemv_probe_bytes() -> int:
    """The GEMV probe's weights: four times the last-level cache, at least 32 MB, at most 256 MB or
    1/64 of the host's memory (at twice the cache, part of them stays cached between repeats and
    the probe reads faster than decode ever streams; a fixed cap would leave it inside a big LLC)."""

    return beyond_llc_bytes(4, 2 * MIN_BUFFER_BYTES, 2 * MAX_BUFFER_BYTES)


def _gemv_in_features() -> int:
    return max(64, gemv_probe_bytes() // (4 * GEMV_PROBE_ROWS) // 64 * 64)


def measure_gemv_bytes_per_s(repeats: int = GEMV_PROBE_REPEATS) -> float:
    """One GEMV probe, uncached: weight bytes/s of the best of ``repeats`` batch-1 products by the
    executor's CPU linear kernel (one untimed first) over float32 weights of
    :func:`gemv_probe_bytes`, kept between probes. Imports torch."""
    import torch


    if not _GEMV:
        # torch (and so the executor's kernel) only where the caller loaded it: a numpy-only probe stays torch-free
        from flexplan.executor.cpu_linear import LinearKernel

        kernel = LinearKernel(device="cpu")
        in_f = _gemv_in_features()
        _GEMV.update(kernel=kernel, weight=kernel.prepare(torch.full((GEMV_PROBE_ROWS, in_f), 1e-3), 1),
                     x=torch.full((1, in_f), 0.5), bytes=4 * GEMV_PROBE_ROWS * in_f)
    kernel, w, x = _GEMV["kernel"], _GEMV["weight"], _GEMV["x"]
    with torch.inference_mode():
        kernel(x, w)
        best_s = float("inf")
        for _ in range(max(1, int(repeats))):
            t0 = time.perf_counter()
            kernel(x, w)
            best_s = min(best_s, time.perf_counter() - t0)
    return float(_GEMV["bytes"]) / best_s


def probe_gemv_bytes_per_s(max_age_s: float = PROBE_TTL_S, reference: float | None = None) -> float:
    """The GEMV probe's figure now, as :func:`probe_bytes_per_s`'s."""
    return _cached("gemv", lambda: confirmed(measure_gemv_bytes_per_s, reference), "bytes/s", max_age_s)


def forget_probe() -> None:
    """Drop the remembered figures (the next probes measure afresh)."""
    _LAST.clear()


# ---- the compute probe: the CPU's arithmetic speed of now --------------------------------------
# A machine's compute speed can move too, apart from its memory bandwidth (on a shared VM the same
# GEMM can run ~1.4x apart an hour later while the memory probes agree). A short
# float32 matrix product tells the compute states apart as the copy tells the memory states.
COMPUTE_PROBE_N = 512  # numpy's: an n x n by n x n float32 product, 268 MFLOP, ~2 ms at 140 GFLOP/s
COMPUTE_PROBE_REPEATS = 5
# torch's: a burst of small prefill-shaped products (rows x in by in x out, float32), timed whole.
# Not a best-of-5 512^3 product: best of 5 keeps the run a stalled thread spared, so it misses the
# states that slow a prefill's many small multi-threaded ops, which a burst timed whole sees
# (``benchmarks/bench_compute_probe_tracking.py`` compares them against a prefill)
COMPUTE_BURST = (48, 576, 1536, 32)  # rows, in, out, products: 2.7 GFLOP, ~17 ms at 160 GFLOP/s
_COMPUTE_BUFFERS: dict[str, tuple] = {}  # "numpy" | "torch" -> buffers, kept between probes
# Where torch is loaded the product is torch's, in torch's threads: numpy's OpenBLAS leaves its
# own threads spinning for ~0.1-0.15 s after a product, and on a machine of few cores a torch GEMM
# run in that window competes with them for the cores and takes several times as long. A
# torch-free ``plan()`` keeps numpy (nothing of torch's runs after it).


def compute_probe_kind() -> str:
    """Which product the compute probe times now: "torch burst, N threads" where torch is loaded,
    else "numpy". Figures of different kinds are not compared (memory_state)."""
    if gemv_probe_usable():
        import torch

        return f"torch burst, {int(torch.get_num_threads())} threads"
    return "numpy"


def describe_compute_probe() -> str:
    kind = compute_probe_kind()
    if kind == "numpy":
        n = COMPUTE_PROBE_N
        return f"float32 {n} x {n} x {n} product (numpy matmul, all threads), best of {COMPUTE_PROBE_REPEATS}"
    rows, k, n, count = COMPUTE_BURST
    return (f"{count} float32 {rows} x {k} x {n} products timed whole (torch.nn.functional.linear in "
            f"{kind.split(', ', 1)[1]})")


def measure_matmul_flops_per_s(repeats: int = COMPUTE_PROBE_REPEATS) -> float:
    """One compute probe, uncached, in FLOP/s: where torch is loaded (:func:`compute_probe_kind`)
    a burst of :data:`COMPUTE_BURST` small products timed whole (one product untimed first), else
    the best of ``repeats`` numpy float32 n x n products (one untimed first)."""
    if compute_probe_kind() != "numpy":
        return _measure_burst_flops_per_s()
    n = COMPUTE_PROBE_N
    if "numpy" not in _COMPUTE_BUFFERS:
        rng = np.random.default_rng(0)
        _COMPUTE_BUFFERS["numpy"] = (rng.random((n, n), dtype=np.float32), rng.random((n, n), dtype=np.float32),
                                     np.empty((n, n), dtype=np.float32))
    a, b, out = _COMPUTE_BUFFERS["numpy"]
    np.matmul(a, b, out=out)
    best_s = float("inf")
    for _ in range(max(1, int(repeats))):
        t0 = time.perf_counter()
        np.matmul(a, b, out=out)
        best_s = min(best_s, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best_s


def _measure_burst_flops_per_s() -> float:
    torch = sys.modules["torch"]  # loaded: compute_probe_kind
    rows, k, n, count = COMPUTE_BURST
    if "torch" not in _COMPUTE_BUFFERS:
        g = torch.Generator().manual_seed(0)
        _COMPUTE_BUFFERS["torch"] = (torch.rand(rows, k, generator=g), torch.rand(n, k, generator=g) - 0.5)
    x, w = _COMPUTE_BUFFERS["torch"]
    linear = torch.nn.functional.linear
    with torch.inference_mode():
        linear(x, w)
        t0 = time.perf_counter()
        for _ in range(count):
            linear(x, w)
        elapsed_s = time.perf_counter() - t0
    return 2.0 * rows * k * n * count / elapsed_s


def probe_flops_per_s(max_age_s: float = PROBE_TTL_S, reference: float | None = None) -> float:
    """The compute probe's figure now, as :func:`probe_bytes_per_s`'s."""
    return _cached(f"compute ({compute_probe_kind()})", lambda: confirmed(measure_matmul_flops_per_s, reference),
                   "FLOP/s", max_age_s)
