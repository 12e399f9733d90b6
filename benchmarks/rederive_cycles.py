"""Judge today's factor derivation on a kept calibration-cycles run, without measuring again.

``bench_calibration_cycles.py`` keeps its calibration files and each validation's CSV in
``benchmarks/results/<name>-files/``. For every CSV row (one grid point, measured once, median of
its repeats) and every calibration set, this re-predicts the cold TTFT and TPOT with the code of
today, the memory and compute probes set to the readings taken right before the point's timed runs
(the CSV's ``probe_before_*`` columns, what validate priced at; ``--probes after``: right after
them; ``mean``: both; older CSVs: what each prediction's note says it was scaled by), and prints the MAPE of the
recorded predictions (the code that ran) beside the re-derived ones (this code) on the same
measurements: an A/B of a derivation change that the host's memory states cannot bias.

    python benchmarks/rederive_cycles.py benchmarks/results/calibration_cycles_avx512_run3-files

Only what the calibration file and the probe readings decide is re-derived: a change to the
executor, or to what calibration measures, needs a new cycles run. ``--files-from`` prices the
runs with another run's calibration files instead (what an older calibration code measured, on
this run's validation runs: whether a run's figures moved with the code or with the host).
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
from pathlib import Path

from common import write_result  # noqa: E402

MODELS = {"smollm2": "smollm2", "random-llama": "random-llama"}  # CSV name part -> validate's --model
READINGS = {  # probe -> (the note's pattern, the unit's scale)
    "gemv": (r"memory probe \(decode GEMV\) ([0-9.]+) GB/s now", 1e9),
    "memory": (r"memory probe ([0-9.]+) GB/s now", 1e9),
    "compute": (r"compute probe ([0-9.]+) GFLOP/s now", 1e9),
}


def readings(row: dict, name: str, when: str) -> dict[str, float]:
    """{probe: figure} to re-derive one CSV row's prediction of set ``name`` at: the readings right
    ``when`` ("before"/"after") its timed runs where validate recorded them (``probe_<when>_*``
    columns), else ("note", or older CSVs) what the set's memory-state note says it was scaled by."""
    if when == "mean":  # the geometric mean of both: the state the runs most likely met (not causal)
        before, after = readings(row, name, "before"), readings(row, name, "after")
        return {k: (before[k] * after[k]) ** 0.5 for k in before.keys() & after.keys()} or before
    if when != "note":
        cols = {k: float(v) for k, v in row.items() if k.startswith(f"probe_{when}_") and v not in (None, "")}
        if cols:
            return {k[len(f"probe_{when}_"):].split("_", 1)[0]: v for k, v in cols.items()}
    note = row.get(f"{name}:cold_memory_state", "")
    out = {}
    for probe, (pattern, unit) in READINGS.items():
        m = re.search(pattern, note or "")
        if m:
            out[probe] = float(m.group(1)) * unit
    return out


def patched_probes(values: dict[str, float]):
    """Set membw's plan-time probes to ``values`` (a probe without a reading fails: not scaled)."""
    from flexplan.calibration import membw

    def fixed(probe):
        def read(max_age_s=0.0, reference=None):
            if probe not in values:
                raise RuntimeError("no reading recorded")
            return values[probe]
        return read

    membw.probe_gemv_bytes_per_s = fixed("gemv")
    membw.probe_bytes_per_s = fixed("memory")
    membw.probe_flops_per_s = fixed("compute")


_LOADED: dict[Path, object] = {}


def predict(model_dir: Path, cal_path: Path, row: dict, values: dict[str, float]) -> tuple[float, float]:
    """Cold (TTFT, TPOT) of one grid point from one calibration file, the probes at ``values``."""
    import flexplan
    from flexplan.calibration import _at_state_now, _calibrated
    from flexplan.calibration.store import load_calibration
    from flexplan.hardware import get_hardware

    if cal_path not in _LOADED:  # loaded once: its factors are derived once (calibration._calibrated)
        # not checked against this machine: a kept run of another VM is re-derived offline (the
        # factors are measured rates over this machine's hwdb peaks, and priced over the same peaks)
        _LOADED[cal_path] = load_calibration(cal_path)
    cal = _LOADED[cal_path]
    patched_probes(values)
    hw = get_hardware("local")
    eff = _at_state_now(_calibrated(cal, hw), cal)
    q = flexplan.plan(str(model_dir), hw, batch_size=int(row["batch_size"]), input_len=int(row["input_len"]),
                      output_len=int(row["output_len"]), dtype="float32", prefill=row["prefill_policy"],
                      decode=row["decode_policy"], efficiency=eff, cpu_dtype=row["cpu_dtype"])
    return q.ttft_s, q.tpot_s


def pct(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas * 100.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="a <name>-files folder kept by bench_calibration_cycles.py")
    ap.add_argument("--probes", choices=("before", "after", "mean", "note"), default="before",
                    help="the state to re-derive at: the probes right before each point's timed runs (the CSV's "
                         "probe_before_* columns; what validate prices at), right after them, the geometric mean "
                         "of both (not causal: an upper bound of what timing the probe can give), or what each "
                         "prediction's note says (CSVs without those columns use the note)")
    ap.add_argument("--files-from", type=Path, default=None, metavar="FOLDER",
                    help="price with another kept run's calibration files (its cycle N's file for this run's "
                         "cycle N) instead of this run's: calibration code of two runs judged on the same "
                         "validation runs")
    ap.add_argument("--name", default=None, help="write the result as benchmarks/results/<name>.json")
    args = ap.parse_args()
    import torch  # noqa: F401 - loaded, as in validate: plans read the GEMV and torch compute probes there
    from flexplan.validate import resolve_model_dir

    csvs = sorted(args.folder.glob("cycle*-validate-*.csv"))
    if not csvs:
        raise SystemExit(f"{args.folder}: no cycle*-validate-*.csv (run bench_calibration_cycles.py first)")
    errors: dict = {}  # (model, set) -> {phase: {"recorded"|"rederived": {cycle: [% error of each point]}}}
    for path in csvs:
        m = re.match(r"cycle(\d+)-validate-(.+)\.csv$", path.name)
        cycle, model = m.group(1), m.group(2)
        model_dir = resolve_model_dir(MODELS.get(model, model))
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        sets = sorted({c.split(":")[0] for c in rows[0] if c.endswith(":cold_ttft_s")})
        for name in sets:
            cal = (args.files_from or args.folder) / f"cycle{cycle}-{name}.yaml"
            if not cal.is_file():
                print(f"skip {path.name} {name}: no {cal.name}", file=sys.stderr)
                continue
            for row in rows:
                ttft, tpot = predict(model_dir, cal, row, readings(row, name, args.probes))
                e = errors.setdefault((model, name), {})
                for phase, meas, old, new in (("prefill", "measured_ttft_s", f"{name}:cold_ttft_s", ttft),
                                              ("decode", "measured_tpot_s", f"{name}:cold_tpot_s", tpot)):
                    d = e.setdefault(phase, {"recorded": {}, "rederived": {}})
                    d["recorded"].setdefault(cycle, []).append(pct(float(row[old]), float(row[meas])))
                    d["rederived"].setdefault(cycle, []).append(pct(new, float(row[meas])))
    from flexplan.validate import _p90

    result = {}
    print("median over cycles of each cycle's MAPE and p90 (as bench_calibration_cycles.py reports them)")
    if args.files_from:
        print(f"'re-derived': priced with {args.files_from}'s calibration files")
    print(f"{'model':<13} {'set':<6} {'phase':<8} {'cycles':>6}  MAPE recorded -> re-derived   p90 recorded -> re-derived")
    for (model, name), phases in sorted(errors.items()):
        for phase, d in phases.items():
            r = {k: {"mape": round(statistics.median(statistics.fmean(v) for v in by_cycle.values()), 2),
                     "p90": round(statistics.median(_p90(v) for v in by_cycle.values()), 2)}
                 for k, by_cycle in d.items()}
            result.setdefault(model, {}).setdefault(name, {})[phase] = {**r, "cycles": len(d["recorded"])}
            print(f"{model:<13} {name:<6} {phase:<8} {len(d['recorded']):>6}  {r['recorded']['mape']:6.1f}% -> "
                  f"{r['rederived']['mape']:6.1f}%          {r['recorded']['p90']:6.1f}% -> {r['rederived']['p90']:6.1f}%")
    if args.name:
        print(f"wrote {write_result(args.name, {'command': 'python benchmarks/rederive_cycles.py ' + ' '.join(sys.argv[1:]), 'folder': str(args.folder), 'mape_pct': result})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
