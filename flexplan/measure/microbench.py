"""CPU micro-benchmarks for ``flexplan calibrate`` (torch). Each returns plain data with units
in its key names; none of them derives a factor (that is ``calibration/efficiency.py``).

- GEMV / GEMM: ``tokens`` x k times k x n in the CPU compute dtype, weights cycled through
  distinct copies that together exceed the last-level cache several times, as the weights of
  successive layers do: each call streams its weights from DRAM.
- Decode attention: transformers' ``sdpa_attention_forward`` with one query over a KV cache and
  an all-true mask, as flexplan's executor runs CPU decode attention (PyTorch's unmasked CPU
  SDPA path for grouped-query heads reads a bf16 KV cache ~10x slower), KV cycled the same way.
- Per-op dispatch: a tiny matmul and a tiny SDPA call (their fixed cost).
- Per-layer overhead: a real transformers ``LlamaDecoderLayer`` of hidden size 64 in decode
  shape (one token, a KV cache): the fixed cost of one layer, Python and dispatch included.
- Real layers: transformers ``LlamaDecoderLayer``s of three widths (SmolLM2-, 1B- and TinyLlama-
  sized), in decode shape (batch 1 and 8 over a KV cache) and prefill shape (128 and 512 tokens),
  cycled through copies that exceed the cache as consecutive layers do, with the executor's
  packed weights and its fused decode forward (``cpu_decode.FusedLayer``, float32 blocked
  weights). Fitting their times against layer size separates a fixed per-layer cost from the
  size-proportional part. The executor's whole-stack decode step (``cpu_decode.FusedStack``)
  has less Python per layer than this, so the fixed cost is an upper bound for it.
- Generate step: transformers ``generate()`` on a one-layer toy model: the per-step cost of the
  generation loop outside the layers (logits processing, stopping criteria, cache bookkeeping).
- Thread sweep (Park & Egger 4.1): a prefill GEMM and a decode GEMV at 1..cores threads.
- Routed experts: the executor's CPU expert path (``cpu_experts.
  routed_experts_forward``, blocked float32 where the native kernel builds) on k experts of a
  gated MoE layer, each given the same number of rows, at the rows per expert routing produces
  (1, 2, 4, ...), expert weights cycled from DRAM (``expert_gemv``).
- Split-layer linears: a split-points layer's CPU operators run on the dense weights its
  accelerator copy needs (``split_layer.cpu_operator_linear``), not on the packed layout the GEMV
  and GEMM rows above measure; the two are timed in turn on the MLP shape at every GEMV and GEMM
  row count, and the file keeps both (``split_linear``): the estimator scales the packed kernel's
  factors by their ratio.

Times are the fastest of the timed runs (``time_s``, as STREAM and ``timeit`` report: what the
machine can do; slower runs are interference, e.g. an OpenMP thread descheduled by another
process), after one untimed warm-up; the median is kept as ``time_median_s``.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from flexplan.estimator.terms import c_gemm
from flexplan.executor import cpu_attention, cpu_decode, cpu_experts, cpu_linear, native
from flexplan.executor.cpu_linear import LinearKernel, TiedHeadKernel, pack_batch_hint, pack_module
from flexplan.executor.families import CACHE_KWARG
from flexplan.executor.kv_cache import FlexCache, FlexKVLayer, KVGeometry, kv_bytes
from flexplan.executor.link import HOST_MEMORY, Link
from flexplan.executor.split_layer import cpu_operator_linear, dense_kernel
from flexplan.measure.membw import beyond_llc_bytes, llc_bytes  # noqa: F401  (callers read them here too)
from flexplan.measure.stream import (
    copy_bytes_per_s,
    stream_triad_bytes_per_s,
    torch_threads,  # noqa: F401  (used by callers of this module)
)

# Attention heads of a real model: Llama-3-8B (32 query heads, 8 KV heads, head_dim 128).
ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM = 32, 8, 128
# Weight shapes (k x n) typical of a 7-8B layer at hidden 2048..4096: attention projection and MLP.
WEIGHT_SHAPES = ((2048, 2048), (2048, 5632))
# The GGUF block formats whose kernels calibration times (microbench_blocks.block_gemm, rows
# `cpu_block_gemm`), the most used first: llama.cpp's Q4_K_M files (Q4_K, Q6_K), Q8_0, the
# 32-blocks Q4_0 / Q4_1 (flexplan's shipped SmolLM2 file: Q4_1 layers, a Q8_0 head) and Q5_K_M's
# Q5_K. A format not listed (Q5_0, Q5_1) is priced at the float32 GEMV/GEMM factors.
BLOCK_FORMATS = ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_K")
# the first-use probe's two (three took 3.1 s of a loaded probe run, the kernels' load and self-check's ~1.1 s
# included): Q4_K_M files' main format and the shipped file's layers (its Q8_0 head is then priced at the
# float32 head's factors)
PROBE_BLOCK_FORMATS = ("Q4_K", "Q4_1")


@dataclass(frozen=True)
class Sizes:
    """How much to measure. ``rotate_bytes``: distinct weights/KV cycled per benchmark (0: auto,
    ``rotate_llc_multiple`` x the last-level cache and at least 32 MB times that multiple: cycled
    in order through more than the cache holds, every call streams from DRAM)."""

    gemv_tokens: tuple[int, ...]
    gemm_tokens: tuple[int, ...]
    weight_shapes: tuple[tuple[int, int], ...]
    attn_kv_lens: tuple[int, ...]
    attn_batches: tuple[int, ...]
    attn_heads: tuple[int, int, int] = (ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM)
    attn_layouts: tuple[tuple[int, int, int], ...] = ()  # more (heads, kv_heads, head_dim) layouts to measure
    repeats: int = 5
    budget_s: float = 2.0  # per shape: stop repeating once this much time was spent (>= 3 runs)
    rotate_bytes: int = 0
    rotate_llc_multiple: float = 4.0
    stream_bytes: int = 256 * 2**20
    layer_calls: int = 200
    sweep_prefill_tokens: int = 256
    transfer_bytes: tuple[int, ...] = (2**20, 16 * 2**20, 256 * 2**20, 2**30)  # GPU link sweep
    # (hidden, intermediate, heads, kv_heads, head_dim) of real layers, and (batch, query_len) shapes; two
    # prefill shapes of the same b x s (8 x 128 beside 1 x 1024) give the attention core's own factor
    # (layer_fit.prefill_attention_factor): same GEMMs, 8x the causal pairs; a 32-token prompt pins short
    # prefills (chat turns: extrapolated down from 128 tokens, a short prompt's prefill prices slow)
    layer_widths: tuple[tuple[int, int, int, int, int], ...] = (
        (576, 1536, 9, 3, 64), (1024, 2816, 16, 4, 64), (2048, 5632, 32, 8, 64))
    layer_shapes: tuple[tuple[int, int], ...] = ((1, 1), (8, 1), (1, 128), (1, 512))
    # widths measured at prefill shapes only (the first-use probe: a wide layer sets the level of the
    # prefill compute factor, layer_fit._at_the_widest), (width, (batch, query_len) shapes)
    prefill_only_widths: tuple[tuple[tuple[int, int, int, int, int], tuple[tuple[int, int], ...]], ...] = ()
    layer_kv_len: int = 128
    # decode shapes are measured again over this longer KV cache (None: not): the context cost of
    # a real layer's decode attention (layer_fit.py), which the SDPA micro-benchmark misses
    layer_long_kv_len: int | None = None
    layer_copies: int = 64  # at most this many copies of a real layer (each one built and packed)
    # widths the executor's own decode step is timed at (executor_layers): the first of layer_widths,
    # and with 2 the widest too (what the executor adds grows with the width: ~2-5x from a 576- to a
    # 2048-wide layer, so one width cannot price the other)
    executor_widths: int = 1
    # (hidden, vocab) of LM heads: a tall GEMV that streams differently from a layer's projections
    head_shapes: tuple[tuple[int, int], ...] = ((576, 49152), (2048, 32000))
    head_tokens: tuple[int, ...] = (1, 8)
    # (vocab, batch) of the toy models whose generate() steps are timed, and the steps per run
    generate_shapes: tuple[tuple[int, int], ...] = ((128, 1), (65536, 1), (65536, 4))
    generate_steps: int = 32
    # routed experts: rows per expert, and (hidden, expert intermediate, experts per call) of the layer
    expert_tokens: tuple[int, ...] = (1, 2, 4, 8, 16)
    expert_shape: tuple[int, int, int] = (1024, 512, 4)
    # the block formats whose kernels are timed (cpu_block_gemm), at these rows (None: the float rows' GEMV
    # and GEMM rows) on weight_shapes: full and quick stop a GEMM size short of the float rows (the block
    # GEMMs' rate is flat from 64 rows on, 29-47 GFLOP/s here, and a 2048x5632 GEMM at 1024 rows takes
    # ~0.7 s a call: with it, each format took ~8 s of a quick run), beyond which the factor is held
    block_formats: tuple[str, ...] = BLOCK_FORMATS
    block_tokens: tuple[int, ...] | None = None
    # the measurements (keys of the file's `measurements`) this mode takes; None: all of them
    parts: frozenset[str] | None = None

    def layer_points(self) -> list[tuple[int, int, int]]:
        """(batch, query_len, cached keys before it) of every real-layer measurement of the widths
        of ``layer_widths``."""
        out = [(b, q, self.layer_kv_len if q == 1 else 0) for b, q in self.layer_shapes]
        if self.layer_long_kv_len:
            out += [(b, q, self.layer_long_kv_len) for b, q in self.layer_shapes if q == 1]
        return out

    def layer_plan(self) -> list[tuple[tuple[int, int, int, int, int], list[tuple[int, int, int]]]]:
        """(width, its (batch, query_len, cached keys) points) of every real layer measured."""
        return ([(w, self.layer_points()) for w in self.layer_widths]
                + [(w, [(b, q, 0) for b, q in shapes if q > 1]) for w, shapes in self.prefill_only_widths])

    def block_rows(self) -> tuple[int, ...]:
        """Rows (tokens) of the block kernels' GEMV and GEMM measurements."""
        return self.block_tokens or (*self.gemv_tokens, *self.gemm_tokens)

    def layer_units(self) -> int:
        return sum(len(points) for _, points in self.layer_plan())

    def measures(self, key: str) -> bool:
        return self.parts is None or key in self.parts


MODES = {
    "full": Sizes(gemv_tokens=(1, 2, 4, 8, 16), gemm_tokens=(64, 256, 1024, 4096), weight_shapes=WEIGHT_SHAPES,
                  attn_kv_lens=(128, 512, 2048, 8192), attn_batches=(1, 8), repeats=7, budget_s=4.0,
                  attn_layouts=((32, 32, 128), (16, 1, 64)), sweep_prefill_tokens=1024,
                  layer_shapes=((1, 1), (4, 1), (8, 1), (1, 32), (1, 128), (8, 128), (1, 512), (4, 512), (8, 512),
                                (1, 1024)),
                  layer_long_kv_len=1024, executor_widths=2, block_tokens=(1, 2, 4, 8, 16, 64, 256, 1024)),
    # quick: every decode batch `flexplan validate` runs (1, 4, 8) measured as in full, fewer prefill
    # shapes and less time per shape; the fit's physical constraints (efficiency.py) keep the
    # points it lacks from bending the curve (docs/calibration.md, "What `--quick` and `--probe` measure").
    # Weights cycle through 2x the last-level cache (full: 4x): still beyond the cache, so each call
    # streams from memory, in about a quarter less time and no worse over the validate grid; at 4x a
    # big-L3 host's real layers alone take minutes
    "quick": Sizes(gemv_tokens=(1, 4, 8, 16), gemm_tokens=(64, 256, 1024), weight_shapes=WEIGHT_SHAPES,
                   attn_kv_lens=(128, 512, 2048, 8192), attn_batches=(1, 8), repeats=7, budget_s=1.0,
                   rotate_llc_multiple=2.0,
                   stream_bytes=128 * 2**20, layer_calls=100, transfer_bytes=(2**20, 16 * 2**20, 256 * 2**20),
                   expert_tokens=(1, 2, 4, 8),
                   layer_shapes=((1, 1), (4, 1), (8, 1), (1, 32), (1, 128), (8, 128), (1, 512), (4, 512), (8, 512),
                                 (1, 1024)),
                   layer_long_kv_len=1024, block_tokens=(1, 4, 8, 16, 64, 256)),
    # for tests: seconds, not minutes; the numbers mean little
    "tiny": Sizes(gemv_tokens=(1, 4), gemm_tokens=(16, 64), weight_shapes=((256, 512),), attn_kv_lens=(64, 256),
                  attn_batches=(1, 2), attn_heads=(4, 2, 32), attn_layouts=((4, 1, 32),), repeats=3, budget_s=0.2, rotate_bytes=4 * 2**20,
                  stream_bytes=4 * 2**20, layer_calls=10, sweep_prefill_tokens=16,
                  transfer_bytes=(2**16, 2**20), layer_widths=((64, 128, 4, 2, 16), (128, 256, 4, 2, 32)),
                  layer_shapes=((1, 1), (1, 16)), layer_kv_len=16, layer_long_kv_len=64, head_shapes=((64, 1024),), head_tokens=(1, 2),
                  expert_tokens=(1, 4), expert_shape=(128, 64, 2), block_formats=BLOCK_FORMATS[:2]),
    # first use (flexplan/measure/first_use.py): seconds (target: a few). STREAM, op dispatch, on one
    # 1B-class projection (2048 x 2048) the GEMV at the decode batches validate runs (1, 4, 8)
    # and prefill GEMMs at 32, 128 and 512 tokens (one GEMM at 256 alone left prefill at 32 and
    # 4096 tokens to interpolation: up to 34% off full files of synthetic machines), one
    # decode-attention point, one real SmolLM2-sized layer in decode (batch 1, 8) and prefill (128
    # and 512 tokens, where GEMMs are measured: the real layer's compute factor at 512 prices a long
    # prefill, which the isolated GEMM prices short) shape: the per-layer overhead grows with
    # prefill tokens (about linearly; the tiny layer's fixed cost alone prices a small model's TTFT
    # short),
    # the per-step overhead; with a GPU, pinned copies each way and the GPU's GEMV/GEMM at the one
    # projection, its memory copy and its per-layer overhead, and the CPU's GEMV and GEMM slowed by
    # host-to-device copies streaming beside them (what split-points and splitgen overlap; without it
    # they would be priced as if the copies cost the CPU nothing) (a few seconds). What it lacks falls back in
    # efficiency.py: the overhead of other layer sizes to this one's, the LM head to the GEMV
    # factors, the thread sweep to all cores. Weights cycle through
    # 2x the last-level cache (not 4x) and 4 layer copies: in order, each call still misses (a
    # cache that holds 4 SmolLM2-sized layers, ~60 MB, would make the decode overhead come out low).
    # A 2048 x 5632 layer at 128 and 512 prefill tokens sets the prefill factor's level (a small
    # layer's width alone prices a 1B-class model's prefill far off; this costs ~1-2 s more).
    "probe": Sizes(gemv_tokens=(1, 4, 8), gemm_tokens=(32, 128, 512), weight_shapes=((2048, 2048),),
                   attn_kv_lens=(1024,),
                   attn_batches=(1,), repeats=3, budget_s=0.25, stream_bytes=64 * 2**20, layer_calls=20,
                   transfer_bytes=(16 * 2**20, 128 * 2**20), generate_shapes=((65536, 1), (65536, 4)),
                   generate_steps=8, layer_widths=((576, 1536, 9, 3, 64),),
                   prefill_only_widths=(((2048, 5632, 32, 8, 64), ((1, 128), (1, 512))),),
                   layer_shapes=((1, 1), (8, 1), (1, 32), (1, 128), (8, 128), (1, 512), (1, 1024)),
                   layer_kv_len=32, layer_long_kv_len=512, rotate_llc_multiple=2.0, layer_copies=4,
                   block_formats=PROBE_BLOCK_FORMATS, block_tokens=(1, 8, 128),
                   parts=frozenset({"cpu_stream", "cpu_op_dispatch", "cpu_gemv", "cpu_gemm", "cpu_attention",
                                    "cpu_block_gemm",
                                    "cpu_layers", "cpu_stack_overhead", "cpu_layer_overhead", "cpu_generate_step", "h2d", "d2h",
                                    "gpu_gemv", "gpu_gemm", "gpu_memory", "gpu_layer_overhead", "cpu_under_copy"})),
}


# ----------------------------------------------------------------------------- helpers


def stream_array_bytes(sizes: Sizes) -> int:
    """Each STREAM array: the mode's size, and at least four times the LLC (STREAM's own rule)."""
    if sizes.rotate_bytes:  # tests' tiny mode: the size as given
        return sizes.stream_bytes
    return beyond_llc_bytes(4, sizes.stream_bytes, sizes.stream_bytes)


def rotate_bytes(sizes: Sizes) -> int:
    m = sizes.rotate_llc_multiple
    return sizes.rotate_bytes or int(max(m * llc_bytes(), m * 32 * 2**20))


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def dtype_bytes(name: str) -> int:
    return torch_dtype(name).itemsize


_state_probes: dict[str, Callable[[], float]] = {}  # set by `flexplan calibrate` (:func:`probing_state`)
# A row's "before" readings reuse the last row's "after" ones when those finished at most this long
# ago (the next shape's set-up between them): a state lasts seconds to minutes, and the three
# probes (copy, GEMV, compute burst) cost tens of ms a reading: taken twice per row they would add
# about a quarter to the first-use probe's time.
PROBE_REUSE_S = 0.25
_last_reading: dict = {"at": -math.inf, "values": {}}


@contextlib.contextmanager
def probing_state(probes: "Callable[[], float] | dict[str, Callable[[], float]]"):
    """Within: every :func:`time_call` samples ``probes`` (host memory probes, bytes/s: one
    callable, recorded as ``probe_bytes_per_s``, or ``{row field: callable}``) just before and
    just after its runs, and returns the geometric mean of each as that field: the memory state
    its row was measured in, which memory_state.normalised prefers to the sample taken before the
    whole step (a step of real layers lasts tens of seconds, and the memory state can flip within
    one)."""
    global _state_probes
    before = _state_probes
    _state_probes = dict(probes) if isinstance(probes, dict) else {"probe_bytes_per_s": probes}
    _last_reading.update(at=-math.inf, values={})
    try:
        yield
    finally:
        _state_probes = before
        _last_reading.update(at=-math.inf, values={})


def _probe_now(reuse_s: float = 0.0) -> dict[str, float]:
    """{row field: figure} of each probe that read a positive, finite figure now; the last
    reading instead when it finished at most ``reuse_s`` seconds ago."""
    if reuse_s > 0 and time.perf_counter() - _last_reading["at"] <= reuse_s:
        return dict(_last_reading["values"])
    out = {}
    for key, probe in _state_probes.items():
        try:
            x = float(probe())
        except (MemoryError, OSError, RuntimeError, ValueError, ZeroDivisionError):
            continue
        if math.isfinite(x) and x > 0:
            out[key] = x
    _last_reading.update(at=time.perf_counter(), values=dict(out))
    return out


def probed(r: dict) -> dict:
    """The probe fields (``probe_bytes_per_s``, ``gemv_probe_bytes_per_s``, ``probe_flops_per_s``)
    of a :func:`time_call` result, for its row ({} when none)."""
    return {k: _sig(v) for k, v in r.items() if k.endswith(("probe_bytes_per_s", "probe_flops_per_s")) and v}


def time_call(fn: Callable[[], object], repeats: int, budget_s: float, sync: Callable[[], None] | None = None,
              inner: int = 1) -> dict[str, float]:
    """Fastest (``time_s``) and median seconds per call of ``fn`` (``inner`` calls per timed run,
    ``sync`` after them, e.g. torch.cuda.synchronize), after one untimed warm-up run. Stops after
    ``repeats`` runs, or earlier (never before 3) once ``budget_s`` is spent. Within
    :func:`probing_state`, also the memory state around the runs (``probe_bytes_per_s`` and the
    other probes' fields; the readings before them may be the last call's after its runs,
    :data:`PROBE_REUSE_S`)."""
    state_before = _probe_now(PROBE_REUSE_S) if _state_probes else {}

    def run():
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        if sync:
            sync()
        return (time.perf_counter() - t0) / inner

    run()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max(1, repeats):
        times.append(run())
        if len(times) >= 3 and time.perf_counter() - start > budget_s:
            break
    out = {"time_s": min(times), "time_median_s": statistics.median(times), "runs": len(times)}
    state_after = _probe_now() if state_before else {}
    for key in state_before.keys() & state_after.keys():
        out[key] = math.sqrt(state_before[key] * state_after[key])
    return out


def _sig(x: float) -> float:
    """Six significant digits (readable YAML)."""
    return float(f"{x:.6g}")


def copies_for(one_bytes: int, total_bytes: int, cap: int = 256) -> int:
    """How many distinct copies of ``one_bytes`` to cycle so that the whole exceeds ``total_bytes``."""
    return max(1, min(cap, math.ceil(total_bytes / max(1, one_bytes))))


class Cycle:
    """Round-robin over distinct tensors."""

    def __init__(self, items):
        self.items, self.i = list(items), 0

    def next(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


# ----------------------------------------------------------------------------- benchmarks


def stream(sizes: Sizes, threads: int) -> dict[str, float]:
    """STREAM triad and copy (flexplan/measure/stream.py)."""

    n = stream_array_bytes(sizes)
    return {"triad_bytes_per_s": _sig(stream_triad_bytes_per_s(n, threads=threads)),
            "copy_bytes_per_s": _sig(copy_bytes_per_s(n, threads=threads)), "array_bytes": int(n)}


def op_dispatch(sizes: Sizes, dtype: str, device: str = "cpu", sync=None) -> dict[str, float]:
    """Fixed cost of one small op call: a 1 x 64 x 64 matmul and a 1-query SDPA over 1 key."""
    import torch
    import torch.nn.functional as F

    dt = torch_dtype(dtype)
    a, w = torch.ones(1, 64, dtype=dt, device=device), torch.ones(64, 64, dtype=dt, device=device)
    q, kv = torch.ones(1, 4, 1, 16, dtype=dt, device=device), torch.ones(1, 2, 1, 16, dtype=dt, device=device)
    with torch.inference_mode():
        inner = max(1, sizes.layer_calls // 10)
        lin = time_call(lambda: F.linear(a, w), sizes.repeats, sizes.budget_s / 2, sync, inner)
        sdpa = time_call(lambda: F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True), sizes.repeats,
                         sizes.budget_s / 2, sync, inner)
    return {"linear_call_s": _sig(lin["time_s"]), "sdpa_call_s": _sig(sdpa["time_s"])}


def gemm(tokens: tuple[int, ...], sizes: Sizes, dtype: str, device: str = "cpu", sync=None,
         tick: Callable[[], None] | None = None, total_bytes: int | None = None, inner: int = 1,
         linear=None) -> list[dict]:
    """One row per (tokens, k, n): ``time_s`` per call, achieved ``flops_per_s`` and the
    ``weight_bytes_per_s`` the weights streamed at. ``inner`` calls per timed run (GPU: kernels
    queue back to back, one synchronize per run). ``linear``: the kernel (default: the executor's
    for a linear layer on ``device``; on the CPU oneDNN-packed or blocked weights)."""
    import torch


    dt, nbytes = torch_dtype(dtype), dtype_bytes(dtype)
    total_bytes = total_bytes or rotate_bytes(sizes)
    linear = linear or LinearKernel(device=device)
    rows = []
    with torch.inference_mode():
        for k, n in sizes.weight_shapes:
            count = copies_for(k * n * nbytes, total_bytes)
            by_hint: dict = {}
            timed: dict[int, dict] = {}
            for t in tokens:
                hint = pack_batch_hint(t)
                if hint not in by_hint:  # weights as the executor holds them for this batch
                    by_hint.clear()
                    by_hint[hint] = Cycle(linear.prepare(torch.full((n, k), 0.01, dtype=dt, device=device), t)
                                          for _ in range(count))
                ws = by_hint[hint]
                x = torch.full((t, k), 0.5, dtype=dt, device=device)
                timed[t] = time_call(lambda: linear(x, ws.next()), sizes.repeats, sizes.budget_s, sync, inner)
                if tick:
                    tick()
            for t in rechecks(timed):  # once more, after the others; the typical run of the two kept
                ws = Cycle(linear.prepare(torch.full((n, k), 0.01, dtype=dt, device=device), t) for _ in range(count))
                x = torch.full((t, k), 0.5, dtype=dt, device=device)
                again = time_call(lambda: linear(x, ws.next()), sizes.repeats, sizes.budget_s, sync, inner)
                timed[t] = dict(min(timed[t], again, key=lambda r: r["time_median_s"]), rechecked=True)
                del ws
            for t, r in timed.items():
                rows.append({"dtype": dtype, "tokens": t, "k": k, "n": n, "dtype_bytes": nbytes, "kernel": linear.name,
                             **probed(r), "time_s": _sig(r["time_s"]),
                             "time_median_s": _sig(r["time_median_s"]), "runs": r["runs"],
                             "flops_per_s": _sig(c_gemm(t, k, n) / r["time_s"]),
                             "weight_bytes_per_s": _sig(k * n * nbytes / r["time_s"]),
                             **({"rechecked": True} if r.get("rechecked") else {})})
            del by_hint
    return rows


def rechecks(timed: dict[int, dict]):
    """Yield each suspect point (:func:`suspect_points`) once, looking again after each re-timing
    (a point judged against a disturbed neighbour is judged again once that one is re-timed)."""
    while todo := [t for t in suspect_points(timed) if not timed[t].get("rechecked")]:
        yield todo[0]


NOISY_SPREAD = 1.25  # a point whose median run is this far above its fastest met interference


def suspect_points(timed: dict[int, dict]) -> list[int]:
    """Token counts of one weight shape whose typical (median) time looks disturbed: its runs spread
    (median over NOISY_SPREAD x the fastest), or it took longer than a larger token count, or longer
    per token than a smaller one (which chunks would match). Kept, one disturbed short-GEMM point
    (slower at 32 tokens than at 128) would make every short prompt's prefill predict several
    times slow."""
    ts = sorted(timed)
    med = {t: timed[t]["time_median_s"] for t in ts}
    out = []
    for t in ts:
        spread = med[t] > NOISY_SPREAD * timed[t]["time_s"]
        slower_than_more = any(med[t] > med[u] for u in ts if u > t)
        slower_per_token = any(med[t] / t > NOISY_SPREAD * med[u] / u for u in ts if u < t)
        if spread or slower_than_more or slower_per_token:
            out.append(t)
    return out


class _SDPAModule:
    """What transformers' sdpa_attention_forward reads from an attention module."""

    is_causal = False
    training = False

    def __init__(self, groups: int):
        self.num_key_value_groups = groups


def attention(sizes: Sizes, dtype: str, device: str = "cpu", sync=None,
              tick: Callable[[], None] | None = None) -> list[dict]:
    """Decode attention: one query per sequence over ``kv_len`` cached keys, with the kernel the
    executor runs it with (``kernel``): on the CPU :func:`cpu_decode_attention_call` (flexplan's
    native kernel in float32 where it builds, transformers' SDPA with a mask otherwise, over the
    KV cache's own strided buffers); on a GPU transformers' SDPA. Achieved
    ``kv_bytes_per_s`` (K and V read once). (Timed with another kernel than the executor's, the
    factor would price the cpu-attention policy's CPU term for a kernel that does not run, several
    times off.)"""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dt, nbytes = torch_dtype(dtype), dtype_bytes(dtype)
    rows = []
    with torch.inference_mode():
        for (heads, kv_heads, hd), b in ((layout, b) for layout in dict.fromkeys((sizes.attn_heads, *sizes.attn_layouts))
                                         for b in sizes.attn_batches):
            q = torch.full((b, heads, 1, hd), 0.1, dtype=dt, device=device)
            for L in sizes.attn_kv_lens:
                one = 2 * b * kv_heads * L * hd * nbytes
                if device == "cpu":
                    call, kernel = cpu_decode_attention_call(heads, kv_heads, hd, b, L, dt, rotate_bytes(sizes))
                else:
                    kernel = "transformers"
                    kvs = Cycle([(torch.full((b, kv_heads, L, hd), 0.1, dtype=dt, device=device),
                                  torch.full((b, kv_heads, L, hd), 0.2, dtype=dt, device=device))
                                 for _ in range(copies_for(one, rotate_bytes(sizes)))])
                    module = _SDPAModule(heads // kv_heads)

                    def call():  # transformers' SDPA
                        k, v = kvs.next()
                        return sdpa_attention_forward(module, q, k, v, None, scaling=hd ** -0.5)

                r = time_call(call, sizes.repeats, sizes.budget_s, sync)
                rows.append({"dtype": dtype, "batch": b, "kv_len": L, "heads": heads, "kv_heads": kv_heads, "head_dim": hd,
                             "dtype_bytes": nbytes, "kernel": kernel, **probed(r), "time_s": _sig(r["time_s"]),
                             "time_median_s": _sig(r["time_median_s"]), "runs": r["runs"],
                             "kv_bytes_per_s": _sig(one / r["time_s"])})
                del call
                if tick:
                    tick()
    return rows


def cpu_decode_attention_call(heads: int, kv_heads: int, head_dim: int, batch: int, kv_len: int, dt,
                              total_bytes: int) -> tuple[Callable[[], object], str]:
    """(one call, its kernel) of CPU decode attention as the executor runs it beside a host KV
    cache: one query per sequence over ``kv_len`` keys held in the cache's own ``(tokens, batch,
    heads, dim)`` buffers read through strided views (as ``FlexKVLayer`` hands them), with
    flexplan's native kernel where it builds ("native": float32 or bfloat16 caches, q taken to
    float32 and the output back, as the executor's ``cpu_decode.native_decode_attention`` does),
    else transformers' SDPA with an all-true mask ("transformers"); each call reads the next of as many caches as exceed
    ``total_bytes``, as a decode step reads each layer's KV from memory once (one reused buffer
    stayed in the last-level cache below ~16 MB and ran 2x fast). Calibration and ``validate
    --cpu-attention`` time this same call."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward


    ops = native.decode_status()[0] if dt in native.ATTENTION_KV_DTYPES else None
    one = 2 * batch * kv_heads * kv_len * head_dim * torch.empty(0, dtype=dt).element_size()
    kvs = Cycle([(torch.full((kv_len, batch, kv_heads, head_dim), 0.1, dtype=dt).permute(1, 2, 0, 3),
                  torch.full((kv_len, batch, kv_heads, head_dim), 0.2, dtype=dt).permute(1, 2, 0, 3))
                 for _ in range(copies_for(one, total_bytes))])
    scale = head_dim ** -0.5
    if ops is not None:
        q3 = torch.full((batch, heads, head_dim), 0.1, dtype=dt)  # one query per sequence, contiguous

        def native_call():
            return ops.decode_attention(q3.to(torch.float32), *kvs.next(), None, scale).to(dt)
        return native_call, "native"
    q = torch.full((batch, heads, 1, head_dim), 0.1, dtype=dt)
    mask = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool)
    module = _SDPAModule(heads // kv_heads)

    def sdpa_call():
        return sdpa_attention_forward(module, q, *kvs.next(), mask, scaling=scale)
    return sdpa_call, "transformers"


def layer_overhead(sizes: Sizes, dtype: str, device: str = "cpu", sync=None, inner: int = 1,
                   stack: int = 1, fixed_kv: bool = False) -> dict[str, float]:
    """One decode step of a tiny (hidden 64) transformers LlamaDecoderLayer with a KV cache:
    the fixed per-layer cost (its arithmetic is negligible). With ``stack`` > 1, a step runs
    that many such layers in turn (each its own cache) and the time is per layer. With
    ``fixed_kv`` every step attends the same 17 keys (the cache cropped back after it), not one
    more than the step before: on a GPU torch's SDPA may take cuDNN's kernel for this layer,
    which builds a plan for each KV length it has not seen (tens of ms each)."""
    import torch

    step = tiny_decode_step(dtype, device, stack, fixed_kv)
    with torch.inference_mode():
        r = time_call(step, max(3, sizes.layer_calls // inner), 2 * sizes.budget_s, sync, inner)
    return {"time_s": _sig(r["time_s"] / stack), "time_median_s": _sig(r["time_median_s"] / stack), "runs": r["runs"],
            "stack": stack, "fixed_kv": fixed_kv, "hidden_size": 64,
            "layer": "transformers LlamaDecoderLayer (sdpa), decode step with DynamicCache"}


def tiny_decode_step(dtype: str, device: str = "cpu", stack: int = 1, fixed_kv: bool = False) -> Callable[[], None]:
    """A decode step through ``stack`` tiny (hidden 64) LlamaDecoderLayers, each with its own cache
    holding a 16-token prompt, packed as the executor packs CPU layers (:func:`layer_overhead`);
    call it within ``torch.inference_mode()``."""
    import torch
    from transformers.cache_utils import DynamicCache
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding


    cfg = _llama_config(64, 128, 4, 2, 16)
    dt = torch_dtype(dtype)
    layers = [LlamaDecoderLayer(cfg, 0).to(device=device, dtype=dt).eval() for _ in range(stack)]
    kernel = LinearKernel(device=device)
    if kernel.packed:  # as the executor computes CPU layers
        for layer in layers:
            pack_module(layer, pack_batch_hint(1), kernel.name)
    rotary = LlamaRotaryEmbedding(cfg).to(device)
    caches = [DynamicCache(config=cfg) for _ in layers]
    with torch.inference_mode():
        prompt = torch.full((1, 16, 64), 0.1, dtype=dt, device=device)
        pos = torch.arange(16, device=device)[None]
        pe = rotary(prompt, pos)
        for layer, cache in zip(layers, caches):
            layer(prompt, position_ids=pos, position_embeddings=pe, **{CACHE_KWARG: cache}, use_cache=True)
        x = torch.full((1, 1, 64), 0.1, dtype=dt, device=device)
        p = torch.tensor([[16]], device=device)
        pe = rotary(x, p)

    def step():
        for layer, cache in zip(layers, caches):
            layer(x, position_ids=p, position_embeddings=pe, **{CACHE_KWARG: cache}, use_cache=True)
            if fixed_kv:
                cache.crop(-1)  # back to the 16 keys of the prompt

    return step


def _llama_config(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, layers: int = 1, vocab: int = 128):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=layers, vocab_size=vocab)
    cfg._attn_implementation = "sdpa"
    return cfg


def head_gemv(sizes: Sizes, dtype: str, tick: Callable[[], None] | None = None) -> list[dict]:
    """The LM head's GEMV (hidden x vocab) at decode batch sizes, weights streamed from DRAM; and
    where a tied head runs another kernel (``cpu_linear.TiedHeadKernel``), that one too, in rows
    marked ``tied``."""
    heads = replace(sizes, weight_shapes=sizes.head_shapes)
    rows = gemm(sizes.head_tokens, heads, dtype, tick=tick)
    tied = replace(heads, weight_shapes=tied_head_shapes(sizes, dtype))
    if tied.weight_shapes:
        rows += [dict(r, tied=True) for r in gemm(sizes.head_tokens, tied, dtype, tick=tick, linear=TiedHeadKernel())]
    return rows


def tied_head_shapes(sizes: Sizes, dtype: str) -> tuple[tuple[int, int], ...]:
    """The head shapes whose tied head runs another kernel than an untied one in ``dtype``."""
    import torch


    return tuple((k, n) for k, n in sizes.head_shapes
                 if TiedHeadKernel.differs(torch.empty((n, k), dtype=torch_dtype(dtype), device="meta")))


# A prefill of at least this many tokens (batch x query length) cycles at most PREFILL_COPIES of a
# real layer's copies: each weight byte then feeds 512+ FLOPs and the weight read is a small part
# of the layer, while timed runs through every copy (up to 64 on a host with a big L3) would take
# most of the real-layer step. One copy, not four: the validate grid's prefill predictions come
# out no worse, and `--quick` takes 10-20% less time.
PREFILL_FEW_COPIES_TOKENS = 512
PREFILL_COPIES = 1


def layers(sizes: Sizes, dtype: str, tick: Callable[[], None] | None = None) -> list[dict]:
    """Seconds per real decoder layer for each width and (batch, query_len) shape: decode steps
    read a KV cache of ``layer_kv_len`` tokens; prefill writes a fresh one."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding


    dt = torch_dtype(dtype)
    kernel = LinearKernel()
    rows = []
    for (hidden, inter, heads, kv_heads, head_dim), points in sizes.layer_plan():
        cfg = _llama_config(hidden, inter, heads, kv_heads, head_dim)
        one = LlamaDecoderLayer(cfg, 0).to(dt)
        params = sum(p.numel() for p in one.parameters())
        n_copies = copies_for(params * dtype_bytes(dtype), rotate_bytes(sizes), cap=sizes.layer_copies)
        copies = [one] + [LlamaDecoderLayer(cfg, 0).to(dt) for _ in range(n_copies - 1)]
        for layer in copies:
            layer.eval()
        rotary = LlamaRotaryEmbedding(cfg)
        for batch, q_len, past in points:
            cycled = copies if past or batch * q_len < PREFILL_FEW_COPIES_TOKENS else copies[:PREFILL_COPIES]
            native_attention, routed = [], []
            if kernel.packed:  # weights as the executor holds them for a plan of this batch
                for layer in cycled:
                    pack_module(layer, pack_batch_hint(batch), kernel.name)
                native_attention = cpu_decode.install(cycled, [])[2]  # and its fused decode forwards (where they apply)
                # the attention calls the fused float32 forward does not take (a bfloat16 cache) as the
                # executor routes them: the native kernel (executor.runner.attend_beside_kv)
                routed = cpu_attention.install({k: cycled[k] for k in native_attention},
                                               cpu_decode.native_attention_handler, lambda k: False)
            # a decode step the native ops do not attend gets the executor's all-true mask: transformers'
            # SDPA without one takes PyTorch's unmasked CPU path, which reads a bf16 GQA cache several
            # times slower: timed that way, decode would be priced for a path the executor does not take
            mask = (torch.ones(batch, 1, q_len, past + q_len, dtype=torch.bool)
                    if past and q_len == 1 and not (native_attention and dt == torch.float32) else None)
            with torch.inference_mode():
                # the executor's cache (token-major, preallocated: the native decode attention reads a
                # sequence-major DynamicCache up to 2x faster at batch 4-8, so timing one would price
                # the executor's decode fast)
                caches = [_executor_cache(batch, past + q_len, kv_heads, head_dim, dt) for _ in cycled]
                for cache in caches if past else ():  # a KV cache of `past` tokens, as a prompt leaves it
                    # (its values do not change the time; running the prompt through every copy took
                    # more than the timed steps on a many-core host: 64 copies of a batch-8 1024-token prompt)
                    cache.update(*(torch.randn(batch, kv_heads, past, head_dim, dtype=dt) for _ in "kv"), 0)
                x = torch.randn(batch, q_len, hidden, dtype=dt)
                pos = torch.arange(past, past + q_len)[None]
                pe = rotary(x, pos)

                def run_all():
                    for layer, cache in zip(cycled, caches):
                        layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe, **{CACHE_KWARG: cache},
                              use_cache=True)
                        cache.crop(-q_len)  # back to the same KV length for the next run (prefill: empty)

                r = time_call(run_all, max(3, sizes.repeats), sizes.budget_s)
            cpu_attention.uninstall(routed)
            rows.append({"dtype": dtype, "kernel": kernel.name, "hidden": hidden, "intermediate": inter, "heads": heads,
                         "kv_heads": kv_heads,
                         "head_dim": head_dim, "batch": batch, "query_len": q_len, "kv_len": past + q_len,
                         "params": params, "copies": len(cycled), **probed(r), "time_s": _sig(r["time_s"] / len(cycled)),
                         "time_median_s": _sig(r["time_median_s"] / len(cycled)), "runs": r["runs"]})
            if tick:
                tick()
        del copies
    return rows


def _executor_cache(batch: int, capacity: int, kv_heads: int, head_dim: int, dtype):
    """A one-layer KV cache of ``capacity`` tokens in host memory, as the executor holds one
    (``executor.kv_cache``: [capacity, batch, kv heads, d] buffers, written in place)."""
    import torch


    geometry = KVGeometry(kv_heads, head_dim, kv_heads, head_dim)
    raw = torch.empty(kv_bytes(batch, capacity, geometry, dtype), dtype=torch.uint8)
    return FlexCache([FlexKVLayer(0, {HOST_MEMORY: (raw, dtype)}, geometry, batch, capacity, HOST_MEMORY, Link("cpu"))])


def generate_step(sizes: Sizes, dtype: str) -> list[dict]:
    """Per-step seconds of transformers generate() on one-layer toy Llamas (hidden 16) with a small
    and a real-sized vocabulary, at batch 1 and 4: the loop's own cost, which grows with batch x
    vocab (logits upcast, processors, argmax, stopping criteria), plus a negligible layer and head."""
    import torch
    from transformers import LlamaForCausalLM

    rows = []
    for vocab, batch in sizes.generate_shapes:
        model = LlamaForCausalLM(_llama_config(16, 32, 2, 1, 8, vocab=vocab)).to(torch_dtype(dtype)).eval()
        ids = torch.ones(batch, 16, dtype=torch.long)

        def gen(n, model=model, ids=ids):
            return lambda: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                          min_new_tokens=n, do_sample=False, pad_token_id=0)

        steps = sizes.generate_steps
        short = time_call(gen(1), max(3, min(5, sizes.repeats)), sizes.budget_s)
        long = time_call(gen(steps + 1), max(3, min(5, sizes.repeats)), 2 * sizes.budget_s)
        rows.append({"dtype": dtype, "vocab": vocab, "batch": batch, "layers": 1, "hidden_size": 16, "steps": steps,
                     "time_s": _sig(max(long["time_s"] - short["time_s"], 0.0) / steps),
                     "time_median_s": _sig(max(long["time_median_s"] - short["time_median_s"], 0.0) / steps)})
    return rows


def thread_counts(cores: int) -> list[int]:
    """1..cores when few; else powers of two, 3/4 and all of the cores."""
    if cores <= 8:
        return list(range(1, cores + 1))
    picks = {1, cores, (3 * cores) // 4, cores // 2} | {2**i for i in range(1, int(math.log2(cores)) + 1)}
    return sorted(c for c in picks if 1 <= c <= cores)


def thread_sweep(sizes: Sizes, dtype: str, cores: int, tick: Callable[[], None] | None = None) -> dict:
    """Prefill GEMM and decode GEMV time at each thread count; the best counts."""
    k, n = sizes.weight_shapes[-1]
    one = replace(sizes, weight_shapes=((k, n),))
    sweep = []
    for threads in thread_counts(cores):
        with torch_threads(threads):
            pre, dec = gemm((sizes.sweep_prefill_tokens, 1), one, dtype)
        sweep.append({"threads": threads, "prefill_time_s": pre["time_s"], "decode_time_s": dec["time_s"]})
        if tick:
            tick()
    return {"prefill": {"tokens": sizes.sweep_prefill_tokens, "k": k, "n": n}, "decode": {"tokens": 1, "k": k, "n": n},
            "sweep": sweep,
            "best_prefill_threads": min(sweep, key=lambda r: r["prefill_time_s"])["threads"],
            "best_decode_threads": min(sweep, key=lambda r: r["decode_time_s"])["threads"]}


def expert_gemv(sizes: Sizes, dtype: str, tick: Callable[[], None] | None = None) -> list[dict]:
    """One row per rows-per-expert t: ``experts`` (k) experts of a gated MoE layer of
    ``sizes.expert_shape``, each computing t rows, through the executor's CPU expert path
    (``routed_experts_forward``; blocked float32 weights where the native kernel builds, as the
    executor holds a float32 CPU's experts), the k experts of each call taken in turn from enough
    experts that they exceed the last-level cache (every call reads its experts from DRAM)."""
    import torch


    hidden, inter, k = sizes.expert_shape
    dt, nbytes = torch_dtype(dtype), dtype_bytes(dtype)
    per_expert = 3 * hidden * inter * nbytes
    num = max(2 * k, k * math.ceil(copies_for(per_expert, rotate_bytes(sizes), cap=4096) / k))
    mod = torch.nn.Module()
    blocked = dt == torch.float32 and cpu_linear.blocking_available()
    for name, shape in (("gate_up_proj", (num, 2 * inter, hidden)), ("down_proj", (num, hidden, inter))):
        w = torch.full(shape, 0.01, dtype=dt)
        if blocked:
            w = cpu_experts.block_experts_into(w, False, torch.empty(w.numel(), dtype=dt))
        mod.register_parameter(name, torch.nn.Parameter(w, requires_grad=False))
    mod.has_gate, mod.is_transposed = True, False
    mod._apply_gate = lambda x: torch.nn.functional.silu(x[..., :inter]) * x[..., inter:]
    groups = Cycle(torch.arange(g * k, (g + 1) * k) for g in range(num // k))
    rows = []
    with torch.inference_mode():
        for t in sizes.expert_tokens:
            x = torch.full((t, hidden), 0.5, dtype=dt)
            w = torch.full((t, k), 1.0 / k, dtype=dt)

            def call():
                cpu_experts.routed_experts_forward(mod, x, groups.next().expand(t, k), w)

            r = time_call(call, sizes.repeats, sizes.budget_s)
            rows.append({"dtype": dtype, "tokens_per_expert": t, "experts": k, "hidden": hidden,
                         "intermediate": inter, "dtype_bytes": nbytes, "blocked": blocked,
                         "time_s": _sig(r["time_s"]), "time_median_s": _sig(r["time_median_s"]), "runs": r["runs"],
                         "weight_bytes_per_s": _sig(k * per_expert / r["time_s"])})
            if tick:
                tick()
    return rows


def split_linear(sizes: Sizes, dtype: str, tick: Callable[[], None] | None = None) -> list[dict]:
    """One row per row count t (the GEMV and GEMM ones): the split executor's CPU linear
    (``split_layer.cpu_operator_linear`` on dense weights; ``split_kernel``) and the executor's
    packed kernel (``kernel``, what ``gemm`` measures) on the last of ``sizes.weight_shapes``, each
    call in turn on weights cycled from DRAM: ``time_s`` the split kernel's fastest run,
    ``reference_time_s`` the packed kernel's, taken in the same minutes (a memory state moves
    both alike)."""
    import torch


    dt, nbytes = torch_dtype(dtype), dtype_bytes(dtype)
    k, n = sizes.weight_shapes[-1]
    count = copies_for(k * n * nbytes, rotate_bytes(sizes))
    linear = LinearKernel()
    dense = Cycle(torch.full((n, k), 0.01, dtype=dt) for _ in range(count))
    split_kernel = "native-dense" if dense_kernel(dt, dense.items[0]) is not None else "F.linear"
    rows, packed, hint = [], None, object()
    with torch.inference_mode():
        for t in sorted(set(sizes.gemv_tokens) | set(sizes.gemm_tokens)):
            if pack_batch_hint(t) != hint:
                hint = pack_batch_hint(t)
                packed = Cycle(linear.prepare(torch.full((n, k), 0.01, dtype=dt), t) for _ in range(count))
            x = torch.full((t, k), 0.5, dtype=dt)
            calls = {"split": lambda: cpu_operator_linear(x, dense.next(), None, dt),
                     "reference": lambda: linear(x, packed.next())}
            times: dict[str, list[float]] = {name: [] for name in calls}
            for fn in calls.values():
                fn()  # warm
            start = time.perf_counter()
            while len(times["split"]) < sizes.repeats and not (
                    len(times["split"]) >= 3 and time.perf_counter() - start > 2 * sizes.budget_s):
                for name, fn in calls.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            rows.append({"dtype": dtype, "tokens": t, "k": k, "n": n, "dtype_bytes": nbytes, "kernel": linear.name,
                         "split_kernel": split_kernel, "time_s": _sig(min(times["split"])),
                         "reference_time_s": _sig(min(times["reference"])), "runs": len(times["split"])})
            if tick:
                tick()
    return rows
