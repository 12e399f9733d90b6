"""`flexplan validate`: run the executor over a grid and compare measured TTFT/TPOT with predictions.

For every (batch, input, output) point and every prefill/decode policy pair of the grid it runs
one greedy generation of exactly ``output`` tokens (after a warm-up), reads the measured TTFT and
TPOT (TPOT = (E2E - TTFT) / (output - 1)), and records predictions beside them:

- the plan's own (the calibration in use, scaled to the memory state at that moment) and the
  default efficiency factors (hwdb peaks x guessed factors);
- for each *calibration set* (the one in use, or the files named with ``--calibrations
  full=a.yaml,quick=b.yaml``): **cold**, the calibration alone (memory state of now applied), and
  **warm**, after online correction learned from ONE call (``CORRECTING_CALL``, a shape outside
  the default grid, run before the grid). The measurements are shared: several calibrations are
  judged against the same runs.

The run itself plans with online correction off (so the grid's own runs teach nothing). It
writes, to ``--out`` or to a folder in the user's cache (never into the current directory):

- ``validation.csv``: one row per run;
- ``validation.png``: predicted vs measured, one panel per phase;
- ``summary.json``: MAPE and p90 absolute percentage error per phase and policy (calibrated,
  default factors, and cold/warm per calibration set), and the planner's regret: measured E2E of
  the pair the planner picks among the grid's pairs over the best measured E2E at that point.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from flexplan import validate_cpu_attention as vca
from flexplan import validate_experts as ve
from flexplan import validate_split_ops as vs
from flexplan.api import load
from flexplan.errors import InvalidInputError
from flexplan.estimator import DefaultEfficiency
from flexplan.estimator.policies import POLICIES
from flexplan.factors import efficiency_for, efficiency_from_file
from flexplan.factors.correction import Observation, apply, corrections_after, uncorrected
from flexplan.factors.memory_state import PROBE_UNITS
from flexplan.hardware import get_hardware
from flexplan.hardware.introspect import introspect
from flexplan.hardware.standin import standin_hardware
from flexplan.inputs import gib_bytes
from flexplan.measure import membw
from flexplan.measure.state import at_state_now, readings_now
from flexplan.measure.stream import stream_triad_bytes_per_s
from flexplan.planner import plan as make_plan
from flexplan.smollm import default_model_dir
from flexplan.synthetic import random_llama_dir

CSV_COLUMNS = [
    "model", "hardware", "prefill_policy", "decode_policy", "prefill_gpu_layers", "decode_gpu_layers",
    "batch_size", "input_len", "output_len", "cpu_dtype", "cpu_threads",
    "measured_ttft_s", "measured_tpot_s", "measured_e2e_s",
    "predicted_ttft_s", "predicted_tpot_s", "predicted_e2e_s",
    "default_predicted_ttft_s", "default_predicted_tpot_s", "default_predicted_e2e_s", "calibration",
    "repeat_spread_ttft_pct", "repeat_spread_tpot_pct",
]
DEFAULT_GRID = "b=1,4,8 i=32,128,512 o=16,64"


def parse_grid(text: str) -> dict[str, list[int]]:
    """'b=1,4,8 i=32,128 o=16,64' -> {'b': [...], 'i': [...], 'o': [...]}."""
    grid: dict[str, list[int]] = {}
    for part in text.replace(";", " ").split():
        key, _, vals = part.partition("=")
        if key not in ("b", "i", "o") or not vals:
            raise InvalidInputError(f"bad grid part {part!r}; write e.g. {DEFAULT_GRID!r}")
        try:
            grid[key] = [int(v) for v in vals.split(",")]
        except ValueError:
            raise InvalidInputError(f"grid values must be integers: {part!r}") from None
        if any(v <= 0 for v in grid[key]):
            raise InvalidInputError(f"grid values must be positive: {part!r}")
    missing = {"b", "i", "o"} - set(grid)
    if missing:
        raise InvalidInputError(f"grid lacks {', '.join(sorted(missing))}; write e.g. {DEFAULT_GRID!r}")
    if min(grid["o"]) < 2:
        raise InvalidInputError("output lengths must be >= 2 to measure TPOT")
    return grid


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """'cpu' or 'cpu,splitgen' (homogeneous) or 'gpu-offload:splitgen' (prefill:decode)."""
    pairs = []
    for item in text.split(","):
        p, _, d = item.strip().partition(":")
        d = d or p
        for name in (p, d):
            if name not in POLICIES:
                raise InvalidInputError(f"unknown policy {name!r}; use {', '.join(POLICIES)}")
        pairs.append((p, d))
    return pairs


def _pct_errors(pred: list[float], meas: list[float]) -> list[float]:
    return [abs(p - m) / m * 100 for p, m in zip(pred, meas) if m and m > 0 and p is not None and math.isfinite(p)]


def _p90(xs: list[float]) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    k = 0.9 * (len(xs) - 1)
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """MAPE and p90 per phase and policy (calibrated and default factors) and the planner's regret."""
    out: dict[str, Any] = {"mape": {}, "p90": {}, "mape_default": {}, "p90_default": {}, "runs": len(rows)}
    for phase, key in (("prefill", "ttft"), ("decode", "tpot")):
        pol_key = f"{phase}_policy"
        for pol in sorted({r[pol_key] for r in rows}):
            sel = [r for r in rows if r[pol_key] == pol]
            meas = [r[f"measured_{key}_s"] for r in sel]
            for suffix, pk in (("", f"predicted_{key}_s"), ("_default", f"default_predicted_{key}_s")):
                errs = _pct_errors([r[pk] for r in sel], meas)
                out["mape" + suffix].setdefault(phase, {})[pol] = sum(errs) / len(errs) if errs else math.nan
                out["p90" + suffix].setdefault(phase, {})[pol] = _p90(errs)
    # regret: at each grid point, the pair with the lowest predicted E2E vs the lowest measured one
    points: dict[tuple, list[dict]] = {}
    for r in rows:
        points.setdefault((r["batch_size"], r["input_len"], r["output_len"]), []).append(r)
    regrets = []
    for runs in points.values():
        chosen = min(runs, key=lambda r: r["predicted_e2e_s"])
        best = min(r["measured_e2e_s"] for r in runs)
        regrets.append(chosen["measured_e2e_s"] / best)
    out["regret"] = sum(regrets) / len(regrets) if regrets else math.nan
    out["regret_max"] = max(regrets) if regrets else math.nan
    out["pairs_per_point"] = max((len(v) for v in points.values()), default=0)
    out["sets"] = _summarize_sets(rows)
    out["repeat_spread_pct"] = repeat_spread(rows)
    return out


def repeat_spread(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per phase, the mean over points of how far single runs of a point lie from their median
    (``--repeats`` >= 2; None otherwise): the machine's own run-to-run noise, which a prediction
    judged against one run cannot beat."""
    out: dict[str, float | None] = {}
    for phase, key in (("prefill", "ttft"), ("decode", "tpot")):
        xs = [r[f"repeat_spread_{key}_pct"] for r in rows if r.get(f"repeat_spread_{key}_pct") is not None]
        out[phase] = sum(xs) / len(xs) if xs else None
    return out


def _spread_pct(runs: list, key: str) -> float | None:
    """Mean |run - median| / median of ``key`` over ``runs`` (None for fewer than 2)."""
    import statistics

    xs = [float(getattr(r, key)) for r in runs if math.isfinite(float(getattr(r, key)))]
    if len(xs) < 2:
        return None
    mid = statistics.median(xs)
    return sum(abs(x - mid) for x in xs) / len(xs) / mid * 100 if mid > 0 else None


def _summarize_sets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """{set: {"cold"|"warm": {"mape"|"p90": {phase: {policy: %}}}}} over the rows' ``sets``."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(n for r in rows for n in r.get("sets", {})):
        for kind in ("cold", "warm"):
            sel = [r for r in rows if kind in r.get("sets", {}).get(name, {})]
            if not sel:
                continue
            d = out.setdefault(name, {}).setdefault(kind, {"mape": {}, "p90": {}})
            for phase, key in (("prefill", "ttft"), ("decode", "tpot")):
                for pol in sorted({r[f"{phase}_policy"] for r in sel}):
                    mine = [r for r in sel if r[f"{phase}_policy"] == pol]
                    errs = _pct_errors([r["sets"][name][kind][f"{key}_s"] for r in mine],
                                       [r[f"measured_{key}_s"] for r in mine])
                    d["mape"].setdefault(phase, {})[pol] = sum(errs) / len(errs) if errs else math.nan
                    d["p90"].setdefault(phase, {})[pol] = _p90(errs)
    return out


def set_columns(rows: list[dict[str, Any]]) -> list[str]:
    """CSV columns of the calibration sets' predictions: '<set>:<cold|warm>_<ttft|tpot|e2e>_s'."""
    cols = []
    for r in rows:
        for name, kinds in r.get("sets", {}).items():
            for kind, pred in kinds.items():
                cols += [f"{name}:{kind}_{k}" for k in pred]
    return list(dict.fromkeys(cols))


def probe_columns(rows: list[dict[str, Any]]) -> list[str]:
    """CSV columns of the probe readings right before and right after each point's timed runs,
    'probe_<before|after>_<memory|gemv|compute>_<unit>' (none where the probes are off)."""
    return list(dict.fromkeys(k for r in rows for k in r if k.startswith(("probe_before_", "probe_after_"))))


def _flat(r: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in r.items() if k != "sets"}
    for name, kinds in r.get("sets", {}).items():
        for kind, pred in kinds.items():
            out.update({f"{name}:{kind}_{k}": v for k, v in pred.items()})
    return out


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def write_outputs(rows: list[dict[str, Any]], summary: dict[str, Any], out_dir: Path, meta: dict[str, Any],
                  plot: bool = True) -> dict[str, Path]:
    """CSV, summary JSON and plot, each written to a temp name and renamed (never half-written)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / "validation.csv", "summary": out_dir / "summary.json"}
    tmp = paths["csv"].with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        columns = CSV_COLUMNS + probe_columns(rows) + set_columns(rows)
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            flat = _flat(r)
            w.writerow({k: flat.get(k) for k in columns})
    os.replace(tmp, paths["csv"])
    tmp = paths["summary"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean({**meta, **summary}), indent=2) + "\n")
    os.replace(tmp, paths["summary"])
    if plot:
        paths["plot"] = out_dir / "validation.png"
        plot_validation(rows, paths["plot"])
    return paths


def plot_validation(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, (phase, key) in zip(axes, (("prefill", "ttft"), ("decode", "tpot"))):
        for label, pk, marker in (("calibrated", f"predicted_{key}_s", "o"), ("defaults", f"default_predicted_{key}_s", "x")):
            xs = [r[f"measured_{key}_s"] for r in rows]
            ys = [r[pk] for r in rows]
            ax.scatter(xs, ys, marker=marker, label=label, alpha=0.8)
        lo = min(min(r[f"measured_{key}_s"] for r in rows), min(r[f"predicted_{key}_s"] for r in rows)) * 0.8
        hi = max(max(r[f"measured_{key}_s"] for r in rows), max(r[f"predicted_{key}_s"] for r in rows)) * 1.25
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {key.upper()} (s)")
        ax.set_ylabel(f"predicted {key.upper()} (s)")
        ax.set_title(f"{phase}: {key.upper()}")
        ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"{'phase':<8} {'policy':<21} {'MAPE':>7} {'p90':>7}   {'MAPE (defaults)':>15} {'p90 (defaults)':>14}"]
    for phase in ("prefill", "decode"):
        for pol, mape in s["mape"].get(phase, {}).items():
            lines.append(f"{phase:<8} {pol:<21} {mape:>6.1f}% {s['p90'][phase][pol]:>6.1f}%   "
                         f"{s['mape_default'][phase][pol]:>14.1f}% {s['p90_default'][phase][pol]:>13.1f}%")
    for name, kinds in s.get("sets", {}).items():
        for kind, d in kinds.items():
            for phase in ("prefill", "decode"):
                for pol, mape in d["mape"].get(phase, {}).items():
                    lines.append(f"{phase:<8} {pol:<21} {mape:>6.1f}% {d['p90'][phase][pol]:>6.1f}%   "
                                 f"calibration {name!r}, {kind}")
    spread = s.get("repeat_spread_pct") or {}
    if any(v is not None for v in spread.values()):
        lines.append("run-to-run spread of the repeats around their median (the noise floor): " + ", ".join(
            f"{ph} {v:.1f}%" for ph, v in spread.items() if v is not None))
    lines.append(f"planner regret (measured E2E of chosen pair / best measured): mean {s['regret']:.3f}, "
                 f"max {s['regret_max']:.3f} over points with {s['pairs_per_point']} pair(s) each")
    return "\n".join(lines)


# ---- running ------------------------------------------------------------------------------
def resolve_model_dir(name: str) -> Path:
    if name in ("smollm2", "default"):
        return default_model_dir()
    if name.startswith("random-llama"):
        return random_llama_dir()
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise InvalidInputError(f"--model {name!r} is not smollm2, random-llama-1gb, or a folder with config.json")
    return path


CORRECTING_CALL = (2, 64, 24)  # (batch, input, output) of the one call that warm predictions learn from


def calibration_sets(spec: str | None) -> dict[str, Path | None]:
    """``--calibrations``: 'full=a.yaml,quick=b.yaml' -> {name: path}; None/empty: the calibration
    in use, {'in use': None}."""
    if not spec:
        return {"in use": None}
    sets: dict[str, Path | None] = {}
    for item in spec.split(","):
        name, sep, path = item.strip().partition("=")
        if not sep or not name or not path:
            raise InvalidInputError(f"bad --calibrations item {item!r}; write name=path, e.g. full=cal-full.yaml,quick=cal-quick.yaml")
        if name in sets:
            raise InvalidInputError(f"--calibrations names {name!r} twice")
        p = Path(path).expanduser()
        if not p.is_file():
            raise InvalidInputError(f"--calibrations {name}: no file {p}")
        sets[name] = p
    return sets


def _cold_efficiency(path: Path | None, hw):
    """The efficiency of one calibration set now: the file's factors (the one in use when None),
    scaled to the memory state of this moment, without online corrections."""

    return uncorrected(efficiency_for(hw, at_state_now)) if path is None else efficiency_from_file(path, hw, at_state_now)


def _predict(lm, hw, eff, b: int, i: int, o: int, p_pol: str, d_pol: str, plan) -> dict[str, float]:
    q = make_plan(lm.config, hw, batch_size=b, input_len=i, output_len=o, dtype=plan.dtype, prefill=p_pol,
                      decode=d_pol, gpu_layers=plan.decode.gpu_layers or None,
                      gpu_memory_bytes=lm._planner_args.get("gpu_memory_bytes"), efficiency=eff,
                      cpu_dtype=plan.cpu_dtype)
    return {"ttft_s": q.ttft_s, "tpot_s": q.tpot_s, "e2e_s": q.ttft_s + q.switch_s + (o - 1) * q.tpot_s}


def _generate(lm, ids, new_tokens: int):
    import torch

    lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False)
    return lm.last_stats


def run_grid(model_dir: Path, grid: dict[str, list[int]], pairs: list[tuple[str, str]], hardware: str = "local",
             accelerator: str | None = None, gpu_memory_bytes: float | None = None, repeats: int = 1,
             progress=None, sets: dict[str, Path | None] | None = None, warm: bool = True) -> list[dict[str, Any]]:
    import torch


    hw = get_hardware(hardware)
    if accelerator == "cpu":
        hw = standin_hardware(int(gpu_memory_bytes or 4 << 30), base=hw)
    sets = sets or {"in use": None}
    default_eff = DefaultEfficiency.for_hardware(hw)
    rows = []
    shapes = [(b, i, o) for b in grid["b"] for i in grid["i"] for o in grid["o"]]
    for p_pol, d_pol in pairs:
        lm = load(str(model_dir), plan={"prefill": p_pol, "decode": d_pol}, accelerator=accelerator,
                           hardware=hw, gpu_memory_bytes=gpu_memory_bytes, online_correction=False)  # calibration alone
        vocab = lm.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        _generate(lm, torch.randint(3, vocab, (1, 16), generator=gen), 4)
        learned: dict[str, Any] = {}
        if warm:  # the one call the warm predictions learn from, measured after a warm-up of its shape
            b, i, o = CORRECTING_CALL
            ids = torch.randint(3, vocab, (b, i), generator=gen)
            _generate(lm, ids, o)  # its own output length: the same plan as the observed call (below)
            observed = _generate(lm, ids, o)
            obs = Observation.from_stats(observed, lm.executor.spec, hw)
            learned = {name: corrections_after([obs], _cold_efficiency(path, hw)) for name, path in sets.items()}
        for b, i, o in shapes:
            ids = torch.randint(3, vocab, (b, i), generator=gen)
            # warm this shape with its own output length: the plan, and with it the CPU dtype the
            # weights are placed in, depends on it (a warm-up of another length can be planned in
            # another CPU dtype, and the timed run's TTFT would then hold the weights' re-placement,
            # several times a warm prefill); oneDNN caches kernels
            _generate(lm, ids, o)
            # every prediction of this point is priced at the state probed right before its timed runs
            # (as a plan made just before them would be); the state right after them is kept beside it
            before = readings_now()
            with membw.held_probes():
                runs = sorted((_generate(lm, ids, o) for _ in range(repeats)), key=lambda s: s.e2e_s)
                after = readings_now(keep=False)
                st = runs[len(runs) // 2]
                p = st.plan
                dp = _predict(lm, hw, default_eff, b, i, o, p_pol, d_pol, p)
                by_set = {}
                for name, path in sets.items():
                    cold_eff = _cold_efficiency(path, hw)
                    by_set[name] = {"cold": {**_predict(lm, hw, cold_eff, b, i, o, p_pol, d_pol, p),
                                             "memory_state": cold_eff.origin.state_note}}
                    if name in learned:
                        by_set[name]["warm"] = _predict(lm, hw, apply(cold_eff, learned[name]), b, i, o, p_pol, d_pol,
                                                        p)
            rows.append(dict(
                model=model_dir.name, hardware=hw.name, prefill_policy=p_pol, decode_policy=d_pol,
                prefill_gpu_layers=p.prefill.gpu_layers, decode_gpu_layers=p.decode.gpu_layers, batch_size=b,
                input_len=i, output_len=o, cpu_dtype=p.cpu_dtype, cpu_threads=st.cpu_threads,
                measured_ttft_s=st.ttft_s, measured_tpot_s=st.tpot_s, measured_e2e_s=st.e2e_s,
                predicted_ttft_s=p.ttft_s, predicted_tpot_s=p.tpot_s,
                predicted_e2e_s=p.ttft_s + p.switch_s + (o - 1) * p.tpot_s,
                default_predicted_ttft_s=dp["ttft_s"], default_predicted_tpot_s=dp["tpot_s"],
                default_predicted_e2e_s=dp["e2e_s"], calibration=p.calibration,
                repeat_spread_ttft_pct=_spread_pct(runs, "ttft_s"), repeat_spread_tpot_pct=_spread_pct(runs, "tpot_s"),
                **{f"probe_{when}_{k}_{PROBE_UNITS[k]}": v for when, r in (("before", before), ("after", after))
                   for k, v in r.items()},
                sets=by_set))
            if progress:
                progress(rows[-1])
        del lm
    return rows


def default_out_dir(model_name: str, stamp: str) -> Path:
    """``$XDG_CACHE_HOME/flexplan/validate/<model>-<stamp>`` (default ``~/.cache/...``): never the
    directory the user happens to be in."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flexplan" / "validate" / f"{model_name}-{stamp}"


def memory_state_gbs() -> float | None:
    """STREAM triad now (GB/s, 128 MB arrays, best of 3): the memory state a validation ran in."""
    try:
        return round(stream_triad_bytes_per_s(128 * 2**20, repeats=3) / 1e9, 2)
    except Exception:  # noqa: BLE001 - a record, not a result: never fail the validation over it
        return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 (default), random-llama-1gb, or an HF model folder")
    p.add_argument("--grid", default=DEFAULT_GRID, help=f"batch, input, output values (default {DEFAULT_GRID!r})")
    p.add_argument("--policies", default="cpu", help="policies or prefill:decode pairs, comma separated (default cpu)")
    p.add_argument("--hw", default="local")
    p.add_argument("--accelerator", choices=["cuda", "cpu", "none"], default=None)
    p.add_argument("--gpu-memory", type=gib_bytes, default=None, metavar="GiB", help="cap the GPU budget")
    p.add_argument("--repeats", type=int, default=1, help="runs per point; the median E2E run is kept")
    p.add_argument("--calibrations", default=None, metavar="NAME=FILE,...",
                   help="judge these calibration files (cold and warm) against the same runs, e.g. "
                        "full=a.yaml,quick=b.yaml (default: the calibration in use)")
    p.add_argument("--no-warm", action="store_true", help="skip the correcting call and the warm predictions")
    p.add_argument("--out", default=None, help="output folder (default: <cache>/flexplan/validate/<model>-<date>)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--cpu-attention", action="store_true",
                   help="instead of the grid: the cpu-attention policies' CPU attention term, predicted vs measured "
                        "over head layouts, batches and contexts (no accelerator needed)")
    p.add_argument("--cpu-experts", nargs="?", const="Qwen/Qwen3-30B-A3B", default=None, metavar="MODEL",
                   help="instead of the grid: the cpu-experts policy's CPU expert term, predicted vs measured at "
                        "decode batches 1-16 on MODEL's expert shape (default Qwen/Qwen3-30B-A3B; no accelerator needed)")
    p.add_argument("--split-ops", nargs="?", const="meta-llama/Meta-Llama-3-8B", default=None, metavar="MODEL",
                   help="instead of the grid: the split-points policy's CPU operator terms (projections, attention "
                        "core), predicted vs measured at decode batches 1, 4, 8 on MODEL's dense layer shape "
                        "(default meta-llama/Meta-Llama-3-8B; no accelerator needed)")


def run_cpu_term(args, name: str, result: dict, text: str) -> int:
    """One CPU term's check (``--cpu-attention``, ``--cpu-experts``, ``--split-ops``): ``result`` (rows and a MAPE)
    written to ``<name>.json`` in the output folder (temp name, renamed), ``text`` printed (or the
    MAPE as JSON with --json)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out).expanduser() if args.out else default_out_dir(name.replace("_", "-"), stamp)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean({"hardware": args.hw, "date_utc": stamp, **result}), indent=2) + "\n")
    os.replace(tmp, path)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k.startswith("mape")} | {"out": str(path)}, indent=2))
    else:
        print(text)
        print(f"wrote {path}")
    return 0


def run_cpu_attention(args) -> int:
    """``--cpu-attention``: flexplan.validate_cpu_attention's check of the cpu-attention policies' CPU term."""

    s = vca.run_check(args.hw)
    return run_cpu_term(args, "cpu_attention", s, vca.format_check(s))


def run_cpu_experts(args) -> int:
    """``--cpu-experts [MODEL]``: flexplan.validate_experts' check of the cpu-experts policy's CPU
    term on MODEL's expert shape (at most 32 experts held, so that the float32 copy fits a small machine)."""

    s = ve.validate_cpu_experts(args.cpu_experts, hardware=args.hw, max_experts=32)
    return run_cpu_term(args, "cpu_experts", s, ve.format_check(s))


def run_split_ops(args) -> int:
    """``--split-ops [MODEL]``: flexplan.validate_split_ops' check of the split-points policy's CPU
    operator terms on MODEL's dense layer shape."""

    s = vs.validate_split_ops(args.split_ops, hardware=args.hw)
    return run_cpu_term(args, "split_ops", s, vs.format_check(s))


def run(args) -> int:
    if getattr(args, "split_ops", None):
        return run_split_ops(args)
    if getattr(args, "cpu_attention", False):
        return run_cpu_attention(args)
    if getattr(args, "cpu_experts", None):
        return run_cpu_experts(args)
    grid = parse_grid(args.grid)
    pairs = parse_pairs(args.policies)
    if args.repeats < 1:
        raise InvalidInputError("--repeats must be >= 1")
    model_dir = resolve_model_dir(args.model)
    acc = None if args.accelerator in (None, "none") else args.accelerator
    gpu_mem = args.gpu_memory
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out).expanduser() if args.out else default_out_dir(model_dir.name, stamp)
    sets = calibration_sets(args.calibrations)
    total = len(pairs) * len(grid["b"]) * len(grid["i"]) * len(grid["o"])
    t0 = time.perf_counter()

    def progress(r):
        done = progress.n = getattr(progress, "n", 0) + 1
        print(f"[{done}/{total}] {r['prefill_policy']}:{r['decode_policy']} b={r['batch_size']} i={r['input_len']} "
              f"o={r['output_len']}: TTFT {r['measured_ttft_s'] * 1e3:.1f} ms (pred {r['predicted_ttft_s'] * 1e3:.1f}), "
              f"TPOT {r['measured_tpot_s'] * 1e3:.1f} ms (pred {r['predicted_tpot_s'] * 1e3:.1f})",
              file=sys.stderr if args.json else sys.stdout, flush=True)

    triad_before = memory_state_gbs()
    rows = run_grid(model_dir, grid, pairs, hardware=args.hw, accelerator=acc, gpu_memory_bytes=gpu_mem,
                    repeats=args.repeats, progress=progress, sets=sets, warm=not args.no_warm)
    triad_after = memory_state_gbs()

    m = introspect()
    meta = {"model": model_dir.name, "grid": args.grid, "policies": args.policies, "hardware": args.hw,
            "machine": {"cpu": m.cpu.model_name, "usable_cores": m.cpu.usable_physical_cores, "gpus": [g.name for g in m.gpus]},
            "calibration": rows[0]["calibration"] if rows else None, "wall_s": time.perf_counter() - t0,
            "date_utc": stamp, "calibration_sets": {k: str(v) if v else "in use" for k, v in sets.items()},
            "correcting_call": None if args.no_warm else dict(zip(("batch", "input", "output"), CORRECTING_CALL)),
            "stream_triad_gbs": {"before": triad_before, "after": triad_after}}
    summary = summarize(rows)
    paths = write_outputs(rows, summary, out_dir, meta, plot=not args.no_plot)
    if args.json:
        print(json.dumps(_clean({"mape": summary["mape"], "p90": summary["p90"], "regret": summary["regret"],
                                 "mape_default": summary["mape_default"], "p90_default": summary["p90_default"],
                                 "regret_max": summary["regret_max"], "sets": summary["sets"],
                                 "repeat_spread_pct": summary["repeat_spread_pct"],
                                 "stream_triad_gbs": meta["stream_triad_gbs"], "out": str(out_dir)}), indent=2))
    else:
        print(format_summary(summary))
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
