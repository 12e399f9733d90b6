"""README's demo, run again and again: how often `flexplan run` prints predictions within 10%.

Runs ``FLEXPLAN run --json`` (the executable of the environment under test: a fresh clone's
fresh venv, as README's first command leaves it) ``--runs`` times, ``--gap-s`` apart, with a
STREAM triad sample (``flexplan.measure.stream``, in that same environment) right before
each, and writes ``benchmarks/results/<name>.json`` with every run's record: the medians the
demo prints (of its ``--repeats`` timed runs, each predicted right before it), each timed run's
measured and predicted TTFT and TPOT, the memory state each prediction used, and the triad.

    python benchmarks/demo_series.py --flexplan /tmp/fresh/.venv/bin/flexplan --runs 10 --gap-s 40 \\
        --name demo_series_2026-11-26_session5

Within 10% means 0.90 <= measured / predicted <= 1.10 for TTFT and TPOT, on the printed medians
and, for comparison, on each single timed run (what the demo printed before it took medians).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import machine_description, write_result  # noqa: E402

TRIAD = "from flexplan.measure.stream import stream_triad_bytes_per_s as t; print(t() / 1e9)"
WITHIN = (0.90, 1.10)


def ratio(measured, predicted) -> float | None:
    return measured / predicted if measured and predicted else None


def within(x: float | None) -> bool:
    return x is not None and WITHIN[0] <= x <= WITHIN[1]


def one_run(flexplan: Path, extra: list[str]) -> dict:
    python = flexplan.parent / "python"
    triad = subprocess.run([str(python), "-c", TRIAD], capture_output=True, text=True, timeout=120)
    t0 = time.strftime("%H:%M:%S", time.gmtime())
    r = subprocess.run([str(flexplan), "run", "--json", *extra], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return {"utc": t0, "error": r.stderr.strip().splitlines()[-1:] or ["exit %d" % r.returncode]}
    rec = json.loads(r.stdout)
    med = rec["median"]  # per phase the timed run of the median ratio (flexplan.run_cmd.medians)
    return {"utc": t0, "triad_gb_per_s": float(triad.stdout.strip() or "nan"),
            "median": med, "ttft_ratio": ratio(med["ttft_s"], med["predicted_ttft_s"]),
            "tpot_ratio": ratio(med["tpot_s"], med["predicted_tpot_s"]),
            "runs": [{"ttft_ratio": ratio(x["ttft_s"], x["predicted_ttft_s"]),
                      "tpot_ratio": ratio(x["tpot_s"], x["predicted_tpot_s"]),
                      "ttft_s": x["ttft_s"], "tpot_s": x["tpot_s"], "memory_state": x.get("memory_state", "")}
                     for x in rec["runs"]],
            "output_tokens": rec["output_tokens"], "text": rec["text"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flexplan", type=Path, required=True, help="the flexplan executable of the environment under test")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--gap-s", type=float, default=40.0, help="seconds between the starts of runs")
    ap.add_argument("--name", default="demo_series")
    ap.add_argument("extra", nargs="*", help="more arguments for `flexplan run` (after --)")
    args = ap.parse_args()
    if not args.flexplan.is_file():
        sys.exit(f"demo_series: no executable at {args.flexplan}")
    rows = []
    for i in range(args.runs):
        start = time.monotonic()
        row = one_run(args.flexplan, args.extra)
        rows.append(row)
        if "error" in row:
            print(f"run {i + 1} {row['utc']}: error {row['error']}", flush=True)
        else:
            each = " ".join(f"{x['ttft_ratio']:.2f}/{x['tpot_ratio']:.2f}" for x in row["runs"])
            print(f"run {i + 1} {row['utc']} triad {row['triad_gb_per_s']:.1f} GB/s: median TTFT "
                  f"{row['ttft_ratio']:.2f}, TPOT {row['tpot_ratio']:.2f} measured/predicted (single runs {each})",
                  flush=True)
        if i + 1 < args.runs:
            time.sleep(max(0.0, args.gap_s - (time.monotonic() - start)))
    ok = [r for r in rows if "error" not in r]
    singles = [x for r in ok for x in r["runs"]]
    summary = {
        "medians_within_10pct_both": sum(within(r["ttft_ratio"]) and within(r["tpot_ratio"]) for r in ok),
        "medians_within_10pct_ttft": sum(within(r["ttft_ratio"]) for r in ok),
        "medians_within_10pct_tpot": sum(within(r["tpot_ratio"]) for r in ok),
        "singles_within_10pct_both": sum(within(x["ttft_ratio"]) and within(x["tpot_ratio"]) for x in singles),
        "runs": len(ok), "singles": len(singles), "errors": len(rows) - len(ok),
    }
    print(f"medians within 10% on both phases: {summary['medians_within_10pct_both']} of {len(ok)} "
          f"(TTFT {summary['medians_within_10pct_ttft']}, TPOT {summary['medians_within_10pct_tpot']}); "
          f"single timed runs: {summary['singles_within_10pct_both']} of {len(singles)}")
    path = write_result(args.name, {"machine": machine_description(), "flexplan": str(args.flexplan),
                                    "extra_args": args.extra, "gap_s": args.gap_s, "summary": summary, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
