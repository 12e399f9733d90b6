"""flexplan at another git revision against this checkout, interleaved in one run.

A code change that should not cost speed is checked here: two worker processes each import
flexplan from their own source tree (``--old REF`` is checked out into a temporary git worktree),
load the same model with the ``cpu`` policy for both phases, and then run one timed greedy
``generate()`` at a time, alternately (old, new, old, new, ...), with a STREAM triad sample
before every run, so both sides meet this machine's memory-bandwidth states alike. TTFT and TPOT
are taken as in ``bench_cpu_vs_transformers.py`` (a timestamping streamer); the median per side
and the per-run triad samples are written to ``benchmarks/results/<name>.json``.

    python benchmarks/bench_old_vs_new.py --old 70fadf3 --cases a,c --repeats 7
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO_ROOT, fmt_s, median, write_result  # noqa: E402

import bench_cpu_vs_transformers as bench  # noqa: E402


def worker(src: str, case: str, dtype: str) -> None:
    """Serve timed runs on stdin ("run" -> one JSON line) with flexplan imported from ``src``."""
    sys.path.insert(0, src)
    for mod in [m for m in sys.modules if m == "flexplan" or m.startswith("flexplan.")]:
        del sys.modules[mod]
    import flexplan

    assert Path(flexplan.__file__).resolve().is_relative_to(Path(src).resolve()), flexplan.__file__
    bench.DTYPE = dtype
    model_name, batch, input_len, output_len = bench.CASES[case]
    folder = bench.model_folder(model_name)
    wdtype = bench.WEIGHTS_DTYPE.get(model_name, dtype)
    cpu_dtype = "float32" if model_name in bench.WEIGHTS_DTYPE else dtype
    fx, plan = bench.load_flexplan(folder, batch, input_len, output_len, wdtype, cpu_dtype)
    inputs = bench.random_inputs(fx.config.vocab_size, batch, input_len)
    pad = 0
    bench.timed_generate(fx, inputs, output_len, pad)  # warm-up
    print(json.dumps({"ready": True, "flexplan": flexplan.__file__}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        print(json.dumps(bench.timed_generate(fx, inputs, output_len, pad)), flush=True)


class Side:
    def __init__(self, name: str, src: Path, case: str, dtype: str):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(src), "--cases", case, "--dtype", dtype],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).parent))
        self.ready = json.loads(self._line())

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited (code {self.proc.wait()})")
        return line

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def run_case(case: str, old_src: Path, dtype: str, repeats: int) -> dict:
    spec = bench.CASES[case]
    print(f"\n({case}) {spec[0]}: batch {spec[1]}, input {spec[2]}, output {spec[3]}, {dtype}", flush=True)
    runs: dict[str, list] = {"old": [], "new": []}
    stream: list[float] = []
    sides = []
    try:
        sides = [Side("old", old_src, case, dtype)]  # one model loaded at a time while loading
        sides.append(Side("new", REPO_ROOT, case, dtype))
        for _ in range(repeats):
            for side in sides:
                stream.append(bench.stream_sample())
                runs[side.name].append(side.run())
        stream.append(bench.stream_sample())
    finally:
        for side in sides:
            side.close()
    out = {"case": spec, "dtype": dtype, "repeats": repeats, "runs": runs,
           "stream_triad_samples_bytes_per_s": stream}
    print(f"  {'':<6}{'TTFT':>11}{'TPOT':>11}{'E2E':>11}")
    for name in runs:
        out[name] = {k: median([r[k] for r in runs[name]]) for k in ("ttft_s", "tpot_s", "e2e_s")}
        r = out[name]
        print(f"  {name:<6}{fmt_s(r['ttft_s']):>11}{fmt_s(r['tpot_s']):>11}{fmt_s(r['e2e_s']):>11}")
    keys = ("ttft_s", "tpot_s", "e2e_s")
    out["ratio_new_over_old"] = {k: out["new"][k] / out["old"][k] for k in keys}
    # each round's new run over the old run just before it (same memory state, most likely)
    out["paired_ratio_new_over_old"] = {k: median([n[k] / o[k] for o, n in zip(runs["old"], runs["new"])])
                                        for k in keys}
    ratio, paired = out["ratio_new_over_old"], out["paired_ratio_new_over_old"]
    print(f"  new/old {ratio['ttft_s']:>9.3f}{ratio['tpot_s']:>11.3f}{ratio['e2e_s']:>11.3f}   (ratio of medians)")
    print(f"  paired  {paired['ttft_s']:>9.3f}{paired['tpot_s']:>11.3f}{paired['e2e_s']:>11.3f}   (median of per-round ratios)")
    print(f"  STREAM triad {min(stream) / 1e9:.1f} .. {max(stream) / 1e9:.1f} GB/s (median {median(stream) / 1e9:.1f})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="HEAD~1", help="git revision of the old side (default HEAD~1)")
    ap.add_argument("--cases", default="a,c", help=f"comma-separated subset of {','.join(bench.CASES)}")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per side")
    ap.add_argument("--name", default="bench_old_vs_new")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in bench.CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; use a subset of {', '.join(bench.CASES)}")
    if args.worker:
        worker(args.worker, cases[0], args.dtype)
        return 0
    rev = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", args.old], capture_output=True,
                         text=True)
    if rev.returncode:
        ap.error(f"--old {args.old!r} is not a git revision of {REPO_ROOT}: {rev.stderr.strip()}")
    new_rev = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="flexplan-old-") as tmp:
        old_src = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "-q", str(old_src),
                        rev.stdout.strip()], check=True)
        try:
            results = {c: run_case(c, old_src, args.dtype, args.repeats) for c in cases}
        finally:
            subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(old_src)])
    path = write_result(args.name, {"old": rev.stdout.strip(), "new": f"{new_rev} + working tree",
                                    "cases": results})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
