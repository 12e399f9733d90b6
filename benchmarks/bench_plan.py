"""How long flexplan.plan() takes (target: median under 10 ms over the catalog's models).

    python benchmarks/bench_plan.py [--hw flexinfer-server2] [--repeats 15] [--old REF --rounds 3]

Each catalog model is planned ``--repeats`` times, each for another request shape around -b/-i/-o
(batch /4..x4, input /2..x2: no call repeats an earlier one), after a first call that fills the
per-model caches (its time is reported as ``first_call_ms``; a model that fits no placement is
timed too: that answer is the planner's). With ``--old REF`` the same timing runs
for flexplan at git revision REF (checked out into a temporary worktree) in its own process,
alternately with this checkout's (old, new, old, new, ...) for ``--rounds`` rounds, with a
STREAM triad sample beside each round: a planner change is judged on the same machine state.
Prints the median over models of each model's median and writes
``benchmarks/results/plan_speed.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO_ROOT, machine_description, triad_gbs, write_result  # noqa: E402

TARGET_MS = 10.0


def shapes_around(b: int, i: int, o: int, repeats: int) -> list[tuple[int, int, int]]:
    """``repeats`` distinct request shapes around (b, i, o): batch b/4..4b, input i/2..2i. Every
    call plans a request the previous ones did not: what planning keeps per model (layouts,
    coefficients) is reused, as it is for a server that re-plans as its batch changes; no answer is."""
    out = []
    for k in range(repeats):
        bk = max(1, int(b * 2.0 ** ((k % 5) - 2)))
        ik = max(1, int(i * 2.0 ** ((k // 5) % 3 - 1)))
        out.append((bk, ik, o + k // 15))
    return out


def time_catalog(src: str, hw: str, b: int, i: int, o: int, repeats: int) -> dict[str, dict]:
    """{model: {"median_ms", "p90_ms", "first_call_ms", "fits"}} of flexplan imported from ``src``."""
    sys.path.insert(0, src)
    import flexplan
    from flexplan.workload import catalog_names

    rows = {}
    for name in catalog_names():
        def one(shape) -> bool:
            try:
                flexplan.plan(name, hw, batch_size=shape[0], input_len=shape[1], output_len=shape[2])
                return True
            except flexplan.DoesNotFitError:
                return False

        t0 = time.perf_counter()
        fits = one((b, i, o + repeats))  # the model's first plan (its per-model caches filled), a shape not timed below
        first_ms = (time.perf_counter() - t0) * 1e3
        times = []
        for shape in shapes_around(b, i, o, repeats):
            t0 = time.perf_counter()
            one(shape)
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        rows[name] = {"median_ms": statistics.median(times), "p90_ms": times[int(0.9 * (len(times) - 1))],
                      "first_call_ms": first_ms, "fits": fits}
    return rows


def run_side(src: Path, args) -> dict[str, dict]:
    """One round of one side, in a fresh process importing flexplan from ``src``."""
    cmd = [sys.executable, __file__, "--worker", str(src), "--hw", args.hw, "-b", str(args.b), "-i", str(args.i),
           "-o", str(args.o), "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise SystemExit(f"plan timing of {src} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(rounds: list[dict[str, dict]]) -> dict:
    """Per model the median over rounds of its median; the median and worst over models."""
    per_model = {m: statistics.median(r[m]["median_ms"] for r in rounds) for m in rounds[0]}
    return {"per_model_median_ms": per_model, "catalog_median_ms": statistics.median(per_model.values()),
            "worst_median_ms": max(per_model.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hw", default="flexinfer-server2")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("-b", type=int, default=16)
    ap.add_argument("-i", type=int, default=512)
    ap.add_argument("-o", type=int, default=32)
    ap.add_argument("--old", default=None, metavar="REF", help="also time flexplan at this git revision, interleaved")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per side")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(time_catalog(args.worker, args.hw, args.b, args.i, args.o, args.repeats)))
        return 0
    print(f"flexplan.plan() on {args.hw}, batch {args.b}, input {args.i}, output {args.o}, "
          f"{args.repeats} calls per model per round")
    sides: dict[str, Path] = {"new": REPO_ROOT}
    tmp = None
    if args.old:
        tmp = Path(tempfile.mkdtemp(prefix="flexplan-old-"))
        subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "-q", str(tmp / "tree"), args.old],
                       check=True)
        sides = {"old": tmp / "tree", "new": REPO_ROOT}
    rounds: dict[str, list] = {k: [] for k in sides}
    triads: list[float] = []
    try:
        for r in range(args.rounds if args.old else 1):
            for side, src in sides.items():
                triads.append(triad_gbs())
                rounds[side].append(run_side(src, args))
                s = summary(rounds[side][-1:])
                print(f"round {r + 1} {side:>3}: catalog median {s['catalog_median_ms']:6.2f} ms, worst "
                      f"{s['worst_median_ms']:7.2f} ms (triad {triads[-1]} GB/s)")
    finally:
        if tmp is not None:
            subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(tmp / "tree")])
    out = {side: summary(rs) for side, rs in rounds.items()}
    for side, rs in rounds.items():
        out[side]["first_call_median_ms"] = statistics.median(
            statistics.median(r[m]["first_call_ms"] for r in rs) for m in rs[0])
    print(f"{'model':<42} " + " ".join(f"{s + ' ms':>9}" for s in out))
    for m in out["new"]["per_model_median_ms"]:
        print(f"{m:<42} " + " ".join(f"{out[s]['per_model_median_ms'][m]:9.2f}" for s in out))
    new = out["new"]["catalog_median_ms"]
    line = (f"catalog median {new:.2f} ms ({'under' if new < TARGET_MS else 'OVER'} the {TARGET_MS:.0f} ms target); "
            f"a model's first plan: median {out['new']['first_call_median_ms']:.1f} ms")
    if args.old:
        ratios = [out["new"]["per_model_median_ms"][m] / out["old"]["per_model_median_ms"][m]
                  for m in out["new"]["per_model_median_ms"]]
        line += f"; new / old per model: median {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
    print(line)
    path = write_result("plan_speed", {
        "command": "python benchmarks/bench_plan.py " + " ".join(sys.argv[1:]), "hardware_planned_for": args.hw,
        "batch_size": args.b, "input_len": args.i, "output_len": args.o, "repeats": args.repeats,
        "old": args.old, "rounds": rounds, "summary": out, "triad_gb_per_s": triads, "target_ms": TARGET_MS,
        "machine": machine_description()})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
