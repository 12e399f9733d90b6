"""``flexplan calibrate [--quick] [--out PATH]``: run the micro-benchmarks, write the file.

The run measures; it derives factors only to show them (and to store them, for humans, under
``derived``); the estimator recomputes them at load time against the Hardware it plans for.
A benchmark that fails is reported and recorded under ``failures``; if the GEMV/GEMM
benchmarks (the ones every factor needs) fail, nothing is written. The file is written
atomically at the end, so an interrupted run leaves the previous calibration untouched.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flexplan.errors import CalibrationError
from flexplan.executor.cpu_linear import default_kernel
from flexplan.executor.host_allocator import keep_freed_memory
from flexplan.factors import memory_state, store
from flexplan.factors.efficiency import BLOCK_PART, from_measurements
from flexplan.factors.store import DIR_ENV, FILE_ENV, calibration_dirs, display_path, file_name, local_identity
from flexplan.hardware import get_hardware
from flexplan.measure import executor_layers, running, state
from flexplan.measure import microbench as mb
from flexplan.measure import microbench_blocks as blocks
from flexplan.measure import microbench_gpu as gb
from flexplan.measure.hostload import cpu_seconds as _cpu_seconds
from flexplan.measure.hostload import other_share as _other_share
from flexplan.version import __version__

ESSENTIAL = ("cpu_gemv", "cpu_gemm")  # in the CPU's compute dtype: without them no factor exists


@dataclass
class Step:
    key: str  # where the result goes in `measurements`
    units: int  # progress-bar ticks this step makes
    run: Callable[[Callable[[], None]], object]  # gets tick(); returns the measurement
    dtype: str | None = None  # per-dtype CPU step (the block kernels': per format): list results are merged,
    # dict results keyed by it

    @property
    def label(self) -> str:
        return f"{self.key}[{self.dtype}]" if self.dtype else self.key


@dataclass
class Result:
    path: Path | None
    doc: dict
    failures: dict[str, str]
    wall_s: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes and repeats (68-71 s on the 2-core Zen 5 VM, 107-109 s on the Zen 4 "
                        "one; the full set 3-5 minutes)")
    p.add_argument("--probe", action="store_true",
                   help="the first-use probe: seconds, not minutes (what the first local plan "
                        "measures when no calibration exists)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: seconds, meaningless numbers
    p.add_argument("--out", default=None, metavar="PATH",
                   help="file or folder to write (default: the calibration folder, a name from this machine's "
                        "fingerprint)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads to measure with (default: usable cores)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar: a line on stderr as each step ends, with its seconds")


def run(args) -> int:
    mode = "tiny" if args.tiny else "probe" if args.probe else "quick" if args.quick else "full"
    res = calibrate(mode=mode, out=args.out, threads=args.threads, progress=not args.no_progress,
                    step_log=(lambda line: print(line, file=sys.stderr, flush=True)) if args.no_progress else None)
    for name, err in res.failures.items():
        print(f"flexplan calibrate: benchmark {name} failed: {err}", file=sys.stderr)
    print(format_summary(res))
    return 1 if res.failures else 0


def _local_hardware():
    return get_hardware("local")


def _steps(mode: str, hw, threads: int, cpu_dtypes: list[str], gpu_dtype: str | None) -> list[Step]:
    s = mb.MODES[mode]
    per_shape = len(s.weight_shapes)
    steps = [Step("cpu_stream", 1, lambda tick: mb.stream(s, threads))]
    for dt in cpu_dtypes:  # the planner weighs the CPU's fast dtype against float32
        steps += [
            Step("cpu_op_dispatch", 1, lambda tick, dt=dt: mb.op_dispatch(s, dt), dt),
            Step("cpu_gemv", len(s.gemv_tokens) * per_shape, lambda tick, dt=dt: mb.gemm(s.gemv_tokens, s, dt, tick=tick), dt),
            Step("cpu_gemm", len(s.gemm_tokens) * per_shape, lambda tick, dt=dt: mb.gemm(s.gemm_tokens, s, dt, tick=tick), dt),
            Step("cpu_attention", len(s.attn_kv_lens) * len(s.attn_batches) * len({s.attn_heads, *s.attn_layouts}),
                 lambda tick, dt=dt: mb.attention(s, dt, tick=tick), dt),
        ]
    # the block kernels a GGUF file's layers run on, per format (float32 activations, quantised per block)
    steps += [Step(BLOCK_PART, len(s.block_rows()) * per_shape, lambda tick, f=f: blocks.block_gemm(s, f, tick=tick), f)
              for f in s.block_formats]
    for dt in cpu_dtypes:
        steps.append(Step("cpu_layers", s.layer_units(),
                          lambda tick, dt=dt: mb.layers(s, dt, tick=tick), dt))
        steps.append(Step("cpu_executor_layers", 2 * len(executor_layers.executor_widths(s)),
                          lambda tick, dt=dt: executor_layers.executor_layers(s, dt, tick=tick), dt))
        steps.append(Step("cpu_stack_overhead", len(executor_layers.STACK_BATCHES),
                          lambda tick, dt=dt: executor_layers.stack_overhead(s, dt, tick=tick), dt))
        steps.append(Step("cpu_head_gemv", (len(s.head_shapes) + len(mb.tied_head_shapes(s, dt))) * len(s.head_tokens),
                          lambda tick, dt=dt: mb.head_gemv(s, dt, tick=tick), dt))
        steps.append(Step("cpu_experts", len(s.expert_tokens), lambda tick, dt=dt: mb.expert_gemv(s, dt, tick=tick), dt))
        steps.append(Step("cpu_split_linear", len(set(s.gemv_tokens) | set(s.gemm_tokens)),
                          lambda tick, dt=dt: mb.split_linear(s, dt, tick=tick), dt))
    steps += [
        Step("cpu_layer_overhead", 1, lambda tick: mb.layer_overhead(s, cpu_dtypes[0])),
        Step("cpu_generate_step", 1, lambda tick: mb.generate_step(s, cpu_dtypes[0])),
        Step("cpu_threads", len(mb.thread_counts(hw.cpu.cores)),
             lambda tick: mb.thread_sweep(s, cpu_dtypes[0], hw.cpu.cores, tick=tick)),
    ]
    if gpu_dtype is not None:
        steps += [
            Step("gpu_gemv", len(s.gemv_tokens) * per_shape, lambda tick: gb.gemm(s.gemv_tokens, s, gpu_dtype, tick=tick)),
            Step("gpu_gemm", len(s.gemm_tokens) * per_shape, lambda tick: gb.gemm(s.gemm_tokens, s, gpu_dtype, tick=tick)),
            Step("gpu_memory", 1, lambda tick: gb.memory(s)),
            Step("gpu_layer_overhead", 1, lambda tick: gb.layer_overhead(s, gpu_dtype)),
            Step("h2d", len(s.transfer_bytes), lambda tick: gb.link(s, "h2d", tick=tick)),
            Step("d2h", len(s.transfer_bytes), lambda tick: gb.link(s, "d2h", tick=tick)),
            Step("cpu_under_copy", 1, lambda tick: gb.cpu_under_copy(s, cpu_dtypes[0])),
        ]
    return [step for step in steps if s.measures(step.key)]


def _store(measurements: dict, step: Step, result) -> None:
    if step.dtype is None:
        measurements[step.key] = result
    elif isinstance(result, list):
        measurements.setdefault(step.key, []).extend(result)
    else:
        measurements.setdefault(step.key, {})[step.dtype] = result


def _gpu_dtype(hw) -> tuple[str | None, str | None]:
    """(dtype to measure the GPU in, why the GPU is skipped)."""
    import torch

    if not torch.cuda.is_available():
        return None, None if hw.gpu is None else "torch sees no CUDA device (CPU-only torch build?)"
    if hw.gpu is None:
        return None, "torch sees a CUDA device but the local Hardware has none (CUDA_VISIBLE_DEVICES?)"
    return ("bfloat16" if torch.cuda.is_bf16_supported() else "float16"), None


def calibrate(mode: str = "quick", out: str | Path | None = None, threads: int | None = None, progress: bool = True,
              hw=None, step_log: Callable[[str], None] | None = None) -> Result:
    """Run the benchmarks of ``mode`` ("full", "quick", "probe", "tiny") and write the calibration file
    (atomically). Raises CalibrationError, writing nothing, when the essential benchmarks fail.
    ``step_log`` gets a line as each step ends (its seconds, or its failure): a run cut short by
    a time limit still says where its time went."""
    from tqdm import tqdm


    t_start = time.perf_counter()
    busy_start = _cpu_seconds()
    hw = hw or _local_hardware()
    identity = store.local_identity()
    cpu_dtypes = list(dict.fromkeys([hw.cpu.compute_dtype, "float32"]))
    threads = int(threads or hw.cpu.cores)
    path = _target(out, identity)
    _check_writable(path)
    gpu_dtype, gpu_skip = _gpu_dtype(hw)
    steps = _steps(mode, hw, threads, cpu_dtypes, gpu_dtype)
    measurements: dict[str, object] = {}
    failures: dict[str, str] = {}
    step_wall_s: dict[str, float] = {}  # where a calibration's time goes, step by step (recorded in the file)
    memory = state.new_record()  # the host memory state before each step (memory_state.py)
    allocator = keep_freed_memory()  # as the executor runs: freed activations kept, not faulted in afresh
    with running.measuring(), mb.torch_threads(threads), \
            tqdm(total=sum(s.units for s in steps), disable=not progress, unit="shape", desc="calibrate",
                 leave=False) as bar:
        for step in steps:
            bar.set_postfix_str(step.label)
            state.record_sample(memory, step.label)
            done = [0]
            t_step = time.perf_counter()

            def tick(bar=bar, done=done):
                done[0] += 1
                bar.update(1)

            # the rows memory_state.normalised brings to one state carry the state each was timed in
            probing = (mb.probing_state(_row_probes(step.key, memory))
                       if step.key in (*memory_state.ROW_PARTS, BLOCK_PART) else contextlib.nullcontext())
            try:
                with probing:
                    _store(measurements, step, step.run(tick))
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - any benchmark failure is reported, the run goes on
                failures[step.label] = f"{type(e).__name__}: {e}"
            bar.update(step.units - done[0])
            step_wall_s[step.label] = round(time.perf_counter() - t_step, 2)
            if step_log:
                failed = f" (failed: {failures[step.label]})" if step.label in failures else ""
                step_log(f"calibrate: {step.label} {step_wall_s[step.label]:.1f} s{failed}")
        state.record_sample(memory, memory_state.END)
        measurements["memory_state"] = memory
    missing = [f"{n}[{cpu_dtypes[0]}]" for n in ESSENTIAL if f"{n}[{cpu_dtypes[0]}]" in failures]
    if missing:
        raise CalibrationError("calibration failed, nothing written: " + "; ".join(f"{n}: {failures[n]}" for n in missing))


    settings = {"cpu_dtypes": cpu_dtypes, "cpu_threads": threads, "gpu_dtype": gpu_dtype,
                "rotate_bytes": mb.rotate_bytes(mb.MODES[mode]), "cpu_linear_kernel": default_kernel(),
                "host_allocator": allocator}
    doc = calibration_doc(mode, measurements, settings, hw, identity, failures=failures,
                          skipped={"gpu": gpu_skip} if gpu_skip else {}, gpu_measured=gb_name() if gpu_dtype else None,
                          step_wall_s=step_wall_s)
    doc["duration_s"] = round(time.perf_counter() - t_start, 1)
    doc["other_processes_cpu_share"] = _other_share(busy_start, _cpu_seconds(), doc["duration_s"], hw.cpu.cores)
    try:
        store.write_atomic(store.plain(doc), path)
    except OSError as e:
        raise CalibrationError(f"could not write {path}: {e.strerror or e}; nothing written "
                               f"(choose another place with --out or ${store.DIR_ENV})") from None
    return Result(path, doc, failures, time.perf_counter() - t_start)


def _row_probes(key: str, memory: dict) -> dict:
    """The probes taken around each row of step ``key``: the block kernels' rows take the memory
    probes only (memory_state normalises them by those; a compute probe reading costs as much as
    a short block row, so taking it beside each would double the step in the first-use probe)."""
    probes = state.row_probes(memory)
    if key == BLOCK_PART:
        probes.pop(memory_state.ROW_PROBES["compute"], None)
    return probes


def calibration_doc(mode: str, measurements: dict, settings: dict, hw, identity, failures: dict | None = None,
                    skipped: dict | None = None, gpu_measured: str | None = None,
                    step_wall_s: dict | None = None) -> dict:
    """The calibration file's content for ``measurements`` taken on ``hw`` (``identity``) with
    ``settings``; ``derived`` filled in. Raises CalibrationError when they give no factors."""
    import torch


    now = dt.datetime.now(dt.timezone.utc)
    doc = {
        "format": store.FORMAT,
        "version": store.VERSION,
        "created_utc": now.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "mode": mode,
        "fingerprint": identity.fingerprint,
        "machine": {**identity.to_dict(), "hardware": hw.name, "cpu_hwdb_id": hw.cpu.hwdb_id,
                    "cpu_isa": sorted(hw.cpu.isa), "llc_bytes": mb.llc_bytes(), "gpu_measured": gpu_measured},
        "torch_version": str(torch.__version__),
        "software": _software(),
        "settings": settings,
        "duration_s": 0.0,
        "step_wall_s": dict(step_wall_s or {}),  # seconds per benchmark step, in the order run
        "other_processes_cpu_share": None,  # of all cores' time during the run: > 0.1 means noisy figures
        "failures": dict(failures or {}),
        "skipped": dict(skipped or {}),
        "measurements": measurements,
        "derived": None,
        "complete": True,  # last key: a file cut short anywhere lacks it
    }
    doc["derived"] = _derived(doc, hw)
    return doc


def gb_name() -> str:
    return gb.device_name()


def _software() -> dict[str, str]:
    out = {"python": platform.python_version(), "flexplan": __version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


def _derived(doc: dict, hw) -> dict:
    """The factors these measurements give against ``hw``'s peak figures (informational: the
    estimator recomputes them at load time against the Hardware it plans for)."""

    try:
        eff = from_measurements(doc["measurements"], doc["settings"], hw, source="this run")
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CalibrationError(f"calibration failed, nothing written: the measurements give no factors "
                               f"({type(e).__name__}: {e})") from None
    against = {"hardware": hw.name,
               "cpu_peak_flops_per_s": {dt: float(hw.cpu.peak_flops_per_s[dt]) for dt in doc["settings"]["cpu_dtypes"]},
               "cpu_memory_bandwidth_bytes_per_s": float(hw.cpu.memory_bandwidth_bytes_per_s)}
    if hw.gpu is not None:
        against["gpu_memory_bandwidth_bytes_per_s"] = float(hw.gpu.memory_bandwidth_bytes_per_s)
    if hw.link is not None:
        against["link_h2d_bandwidth_bytes_per_s"] = float(hw.link.h2d_bandwidth_bytes_per_s)
    return {"against": against, **eff.describe_factors()}


def _check_writable(path: Path) -> None:
    """Fail before minutes of benchmarks, not after."""

    import tempfile

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=path.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CalibrationError(f"cannot write to {path.parent} ({e.strerror or e}); choose another place with "
                               f"--out or ${DIR_ENV}") from None


def _target(out: str | Path | None, identity) -> Path:
    if out is None:
        return store.write_dir() / store.file_name(identity)
    p = Path(out).expanduser()
    return p / store.file_name(identity) if p.is_dir() or str(out).endswith(("/", "\\")) else p


def format_summary(res: Result) -> str:
    """What the run measured and the factors it gives, in a few lines."""

    m, d, st = res.doc["measurements"], res.doc["derived"], res.doc["settings"]
    lines = [f"wrote {display_path(res.path)} ({res.doc['mode']} run, {res.wall_s:.0f} s, "
             f"{st['cpu_threads']} threads, CPU in {' and '.join(st['cpu_dtypes'])})"]
    if "cpu_stream" in m:
        lines.append(f"  STREAM triad {m['cpu_stream']['triad_bytes_per_s'] / 1e9:.1f} GB/s, "
                     f"copy {m['cpu_stream']['copy_bytes_per_s'] / 1e9:.1f} GB/s")
    rec = m.get("memory_state") or {}
    for key, name in (("probe_bytes_per_s", "memory probe (copy)"), ("gemv_probe_bytes_per_s", "memory probe (decode GEMV)")):
        if rec.get(key):
            import statistics

            xs = rec[key]
            used = key == memory_state.ROW_PROBES[memory_state.row_probe_kind(m)]
            lines.append(f"  {name} before each step {min(xs) / 1e9:.1f}..{max(xs) / 1e9:.1f} GB/s, median "
                         f"{statistics.median(xs) / 1e9:.1f}" + (" (memory-bound times normalised to the median)"
                                                                 if used else ""))
    for dt in st["cpu_dtypes"]:
        gemv = [r for r in m.get("cpu_gemv", []) if r["dtype"] == dt]
        gemm = [r for r in m.get("cpu_gemm", []) if r["dtype"] == dt]
        attn = [r for r in m.get("cpu_attention", []) if r["dtype"] == dt]
        for k, n in dict.fromkeys((r["k"], r["n"]) for r in gemv + gemm):
            lines.append(f"  {dt} {k}x{n}: GEMV weight GB/s by tokens " + ", ".join(
                f"{r['tokens']}:{r['weight_bytes_per_s'] / 1e9:.1f}" for r in gemv if (r["k"], r["n"]) == (k, n))
                + "; GEMM GFLOP/s " + ", ".join(
                f"{r['tokens']}:{r['flops_per_s'] / 1e9:.0f}" for r in gemm if (r["k"], r["n"]) == (k, n)))
        for layout in dict.fromkeys((r["heads"], r["kv_heads"], r["head_dim"]) for r in attn):
            lines.append(f"  {dt}: decode attention ({layout[0]} heads, {layout[1]} KV heads of {layout[2]}) KV GB/s "
                         "by (batch, kv_len) " + ", ".join(
                             f"({r['batch']},{r['kv_len']}):{r['kv_bytes_per_s'] / 1e9:.1f}" for r in attn
                             if (r["heads"], r["kv_heads"], r["head_dim"]) == layout))
        heads = [r for r in m.get("cpu_head_gemv", []) if r["dtype"] == dt]
        for k, n in dict.fromkeys((r["k"], r["n"]) for r in heads):
            kinds = []
            for tied in (False, True):
                rows = [r for r in heads if (r["k"], r["n"]) == (k, n) and bool(r.get("tied")) == tied]
                if rows:
                    kinds.append(("tied " if tied else "untied ") + ", ".join(
                        f"{r['tokens']}:{r['weight_bytes_per_s'] / 1e9:.1f}" for r in rows))
            lines.append(f"  {dt} LM head {k}x{n}: weight GB/s by tokens " + "; ".join(kinds))
        experts = [r for r in m.get("cpu_experts", []) if r["dtype"] == dt]
        if experts:
            r0 = experts[0]
            lines.append(f"  {dt}: routed experts ({r0['experts']} of {r0['hidden']}x{r0['intermediate']}, executor's path) "
                         "weight GB/s by rows per expert " + ", ".join(
                             f"{r['tokens_per_expert']}:{r['weight_bytes_per_s'] / 1e9:.1f}" for r in experts))
        for r in (r for r in m.get("cpu_executor_layers", []) if r["dtype"] == dt):
            alone = f"{r['layer_time_s'] * 1e3:.3f} ms" if r.get("layer_time_s") else "cpu_layers"
            lines.append(f"  {dt}: decode layer of hidden {r['hidden']} run by the executor "
                         f"{r['time_s'] * 1e3:.3f} ms (the layer alone: {alone})")
        stack = [r for r in m.get("cpu_stack_overhead", []) if r["dtype"] == dt]
        if stack:
            lines.append(f"  {dt}: decode step run by the native stack " + ("" if all(r["native_stack"] for r in stack)
                                                                           else "(not run here) ") + "; ".join(
                f"batch {r['batch']}: {r['layer_s'] * 1e6:.0f} us a layer, {r['step_s'] * 1e3:.2f} ms a step" for r in stack))
        split = [r for r in m.get("cpu_split_linear", []) if r["dtype"] == dt]
        if split:
            lines.append(f"  {dt}: split layers' CPU linear ({split[0]['split_kernel']} on dense weights) time over "
                         f"{split[0]['kernel']}'s by tokens " + ", ".join(
                             f"{r['tokens']}:{r['time_s'] / r['reference_time_s']:.2f}" for r in split))
    block_rows = m.get(BLOCK_PART) or []
    for f, k, n in dict.fromkeys((r["format"], r["k"], r["n"]) for r in block_rows):
        rows = [r for r in block_rows if (r["format"], r["k"], r["n"]) == (f, k, n)]
        lines.append(f"  {f} blocks {k}x{n} ({rows[0]['kernel']}): weight GB/s by tokens " + ", ".join(
            f"{r['tokens']}:{r['weight_bytes_per_s'] / 1e9:.1f}" for r in rows) + "; GFLOP/s " + ", ".join(
            f"{r['tokens']}:{r['flops_per_s'] / 1e9:.0f}" for r in rows))
    if m.get("cpu_layer_overhead"):
        lines.append(f"  per-layer overhead {m['cpu_layer_overhead']['time_s'] * 1e6:.0f} us")
    if m.get("cpu_threads"):
        lines.append("  threads (prefill s, decode s): " + ", ".join(
            f"{r['threads']}:({r['prefill_time_s']:.3g}, {r['decode_time_s']:.3g})" for r in m["cpu_threads"]["sweep"]))
    a = d["against"]
    lines.append(f"factors against {a['hardware']} (CPU peak "
                 + ", ".join(f"{dt} {v / 1e9:.0f}" for dt, v in a["cpu_peak_flops_per_s"].items())
                 + f" GFLOP/s, {a['cpu_memory_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s):")
    for dt, f in d["cpu"].items():
        for key, x in (("compute", "tokens"), ("memory", "tokens"), ("attention", "kv_len")):
            if f.get(key):
                lines.append(f"  cpu {key:<9} {dt:<8} " + "  ".join(f"{r[x]:g}:{r['eff']:.3g}" for r in f[key]))
        if f.get("prefill_attention"):
            lines.append(f"  cpu prefill attention core {dt:<8} {f['prefill_attention']:.3g} (apart from the GEMMs)")
    for fmt, f in (d.get("cpu_blocks") or {}).items():
        for key in ("compute", "memory"):
            lines.append(f"  cpu {key:<9} {fmt:<8} " + "  ".join(f"{r['tokens']:g}:{r['eff']:.3g}" for r in f[key])
                         + (" (blocks, against the float32 peak)" if key == "compute" else " (blocks)"))
    for key, x in (("gpu_compute", "tokens"), ("gpu_memory", "tokens"), ("h2d", "bytes"), ("d2h", "bytes")):
        if d.get(key):
            lines.append(f"  {key:<13} " + "  ".join(f"{r[x]:g}:{r['eff']:.3g}" for r in d[key]))
    lines.append(f"  cpu_layer_overhead_s {d['cpu_layer_overhead_s']:.3g}, cpu_threads {d['cpu_threads']}, "
                 f"cpu_under_copy {d['cpu_under_copy']:.3g} (decode GEMV {d.get('cpu_under_copy_gemv', 1.0):.3g})")

    if (res.path.parent.resolve() not in [d.resolve() for d in calibration_dirs()]
            or res.path.name != file_name(local_identity())):
        lines.append(f"  not in a lookup folder: use it with {FILE_ENV}={res.path}")
    share = res.doc.get("other_processes_cpu_share")
    if share is not None and share > 0.1:
        lines.append(f"  warning: other processes used {share:.0%} of the CPU during the run: these figures are "
                     "noisy; re-run on an idle machine")
    for part, why in res.doc.get("skipped", {}).items():
        lines.append(f"  skipped {part}: {why}")
    for n in d.get("notes", []):
        lines.append(f"  note: {n}")
    return "\n".join(lines)
