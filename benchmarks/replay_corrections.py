"""Replay a series of `flexplan run` records through today's state scaling and online correction.

A README demo series (``benchmarks/results/demo_series_*.txt``: each run's measured TTFT and TPOT
and the decode-GEMV probe it planned at) is fed, in order, to the correction rule of today's code,
starting from no corrections: each run is predicted with the corrections the runs before it left
(at its own probe reading), then learned from, as ``flexplan run`` does. It prints measured /
predicted per run beside what the series recorded: an A/B of a change to the state scaling or the
correction rule on the same measurements (the host's memory state cannot bias it).

    python benchmarks/replay_corrections.py benchmarks/results/demo_series_2026-11-26.txt

Only what the calibration file, the probe and the corrections decide is replayed; each run's
plan is made afresh (the policy and CPU dtype it picks may differ from what the series ran: it
says so). Runs whose line has no probe reading are skipped.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

from common import write_result  # noqa: E402

LINE = re.compile(r"TTFT: measured ([0-9.]+) ms, predicted ([0-9.]+) ms.*?TPOT: measured ([0-9.]+) ms, "
                  r"predicted ([0-9.]+) ms.*?memory probe \(decode GEMV\) ([0-9.]+) GB/s now")
SERIES = re.compile(r"^## (.*)")


def parse(path: Path) -> list[dict]:
    """The series' runs in order: {section, ttft_ms, tpot_ms, rec_ttft_ms, rec_tpot_ms, gemv_gbs}."""
    runs, section = [], ""
    for line in path.read_text().splitlines():
        m = SERIES.match(line)
        if m:
            section = m.group(1)
            continue
        m = LINE.search(line)
        if m and not line.startswith("alpha"):
            t, pt, d, pd, g = map(float, m.groups())
            runs.append(dict(section=section, ttft_ms=t, rec_ttft_ms=pt, tpot_ms=d, rec_tpot_ms=pd, gemv_gbs=g))
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("series", type=Path)
    ap.add_argument("--calibration", type=Path, default=Path(__file__).resolve().parents[1] / "calibration"
                    / "epyc-2c-nogpu-e456fdc6.yaml", help="the calibration file the series planned with")
    ap.add_argument("--input-len", type=int, default=42, help="the demo prompt's tokens (default 42)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--no-correction", action="store_true", help="state scaling alone, nothing learned")
    ap.add_argument("--elasticity-off", action="store_true",
                    help="hold the learned memory-state elasticity at 0 (the correction rule before it was learned)")
    ap.add_argument("--name", default=None, help="write the result as benchmarks/results/<name>.json")
    args = ap.parse_args()

    import torch  # noqa: F401 - loaded, as in flexplan run: plans read the GEMV and torch compute probes there

    import flexplan
    from rederive_cycles import patched_probes
    from flexplan.calibration import _at_state_now, _calibrated
    from flexplan.calibration.correction import Corrections, Observation, apply, update
    from flexplan.calibration.memory_state import reference_bytes_per_s
    from flexplan.calibration.store import check_belongs_here, load_calibration
    from flexplan.hardware import get_hardware
    from flexplan.validate import resolve_model_dir
    from flexplan.workload import resolve_model

    if args.elasticity_off:
        import flexplan.calibration.correction as correction

        correction.ELASTICITY_MAX = 0.0  # every update clips it back to 0
    runs = parse(args.series)
    if not runs:
        raise SystemExit(f"{args.series}: no run lines with a decode-GEMV probe reading")
    cal = load_calibration(args.calibration)
    check_belongs_here(cal)
    folder = resolve_model_dir("smollm2")
    spec = resolve_model(str(folder))
    compute_ref = reference_bytes_per_s(cal.measurements, "compute")
    c = Corrections()
    rows = []
    for r in runs:
        patched_probes({"gemv": r["gemv_gbs"] * 1e9, "compute": compute_ref})
        hw = get_hardware("local")
        base = _at_state_now(_calibrated(cal, hw), cal)
        q = flexplan.plan(str(folder), hw, batch_size=1, input_len=args.input_len, output_len=args.output_len,
                          dtype="float32", efficiency=apply(base, c))
        rows.append(dict(r, ttft_pred_ms=q.ttft_s * 1e3, tpot_pred_ms=q.tpot_s * 1e3, cpu_dtype=q.cpu_dtype,
                         correction=c.describe()))
        if not args.no_correction:
            obs = Observation(spec, hw, 1, args.input_len, args.output_len, q.dtype, q.cpu_dtype, q.prefill.policy,
                              q.prefill.gpu_layers, q.decode.policy, q.decode.gpu_layers, r["ttft_ms"] / 1e3,
                              r["tpot_ms"] / 1e3)
            c = update(c, obs, base)
    print(f"{'run':>3} {'section':<34} {'GEMV':>5}  TTFT m/p recorded -> replayed   TPOT m/p recorded -> replayed")
    within = {k: 0 for k in ("rec_ttft", "ttft", "rec_tpot", "tpot")}
    for i, r in enumerate(rows, 1):
        ratios = dict(rec_ttft=r["ttft_ms"] / r["rec_ttft_ms"], ttft=r["ttft_ms"] / r["ttft_pred_ms"],
                      rec_tpot=r["tpot_ms"] / r["rec_tpot_ms"], tpot=r["tpot_ms"] / r["tpot_pred_ms"])
        for k, v in ratios.items():
            within[k] += abs(v - 1) <= 0.10
        r.update({f"{k}_ratio": round(v, 4) for k, v in ratios.items()})
        print(f"{i:>3} {r['section'][:34]:<34} {r['gemv_gbs']:5.1f}  {ratios['rec_ttft']:8.2f} -> {ratios['ttft']:8.2f}"
              f"          {ratios['rec_tpot']:8.2f} -> {ratios['tpot']:8.2f}  {r['cpu_dtype']}")
    n = len(rows)
    print(f"within 10%: TTFT {within['rec_ttft']}/{n} recorded -> {within['ttft']}/{n} replayed; "
          f"TPOT {within['rec_tpot']}/{n} -> {within['tpot']}/{n}")
    print(f"corrections at the end: {c.describe()}")
    med = {k: round(statistics.median(abs(r[f'{k}_ratio'] - 1) for r in rows) * 100, 2) for k in within}
    if args.name:
        record = {"command": "python benchmarks/replay_corrections.py " + " ".join(sys.argv[1:]),
                  "series": str(args.series), "within_10pct": within, "median_abs_error_pct": med, "runs": rows}
        print(f"wrote {write_result(args.name, record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
