"""Host memory kept for the next step (flexplan/executor/host_allocator.py) against glibc's malloc
left as it is: TTFT, TPOT and page faults of SmolLM2-135M-Instruct on the CPU, in both CPU dtypes.

malloc's setting is process-wide and cannot be undone, so each variant runs in a child process
(``FLEXPLAN_HOST_ALLOCATOR=default`` for glibc's own behaviour), the two alternating round after
round, a STREAM triad sample beside each. Each child runs every shape once to warm up, then
measures it: TTFT (prefill) as the median of three 2-token generates, and TPOT as the median of
three 9-token ones, with the minor page faults and system CPU time of the measured calls.
Reported: the median over rounds per variant.

    python benchmarks/bench_host_allocator.py --rounds 3      # writes results/bench_host_allocator.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import REPO_ROOT, median, write_result  # noqa: E402  (also puts the repo on sys.path)

SHAPES = ((8, 128), (1, 512), (4, 512))  # (batch, prompt tokens)
VARIANTS = {"kept (flexplan)": "", "glibc default": "default"}

CHILD = r"""
import json, resource, sys, torch
import flexplan
from flexplan.smollm import default_model_dir
out = {}
for dtype in ("float32", "bfloat16"):
    lm = flexplan.load(str(default_model_dir(verbose=False)), plan={"prefill": "cpu", "decode": "cpu", "cpu_dtype": dtype},
                       online_correction=False)
    g = torch.Generator().manual_seed(0)
    for b, i in SHAPES:
        ids = torch.randint(3, lm.config.vocab_size, (b, i), generator=g)
        def run(n):
            lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False)
            return lm.last_stats
        run(2)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        ttft = sorted(run(2).ttft_s for _ in range(3))[1]
        tpot = sorted(run(9).tpot_s for _ in range(3))[1]
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        out[f"{dtype} b{b} i{i}"] = {"ttft_s": ttft, "tpot_s": tpot, "minor_faults": r1.ru_minflt - r0.ru_minflt,
                                     "system_s": r1.ru_stime - r0.ru_stime,
                                     "allocator": lm.last_stats.host_allocator}
    del lm
print("RESULT " + json.dumps(out))
"""


def run_child(setting: str) -> dict:
    env = dict(os.environ, FLEXPLAN_ONLINE_CORRECTION="0", PYTHONPATH=str(REPO_ROOT))
    env.pop("FLEXPLAN_HOST_ALLOCATOR", None)
    if setting:
        env["FLEXPLAN_HOST_ALLOCATOR"] = setting
    code = f"SHAPES = {SHAPES!r}\n" + CHILD
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO_ROOT)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"child ({setting or 'kept'}) failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="bench_host_allocator")
    args = ap.parse_args()
    from flexplan.measure.stream import stream_triad_bytes_per_s

    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    triads = []
    for k in range(args.rounds):
        order = list(VARIANTS.items()) if k % 2 == 0 else list(reversed(VARIANTS.items()))
        for name, setting in order:
            triad = stream_triad_bytes_per_s() / 1e9
            triads.append(round(triad, 1))
            runs[name].append(run_child(setting))
            print(f"round {k + 1}: {name} done (triad {triad:.1f} GB/s before)", flush=True)
    rows = []
    for key in runs[next(iter(VARIANTS))][0]:
        row = {"case": key}
        for name in VARIANTS:
            for field in ("ttft_s", "tpot_s", "minor_faults", "system_s"):
                row[f"{field} {name}"] = median([r[key][field] for r in runs[name]])
        rows.append(row)
        kept, plain = (f"{{}} {n}" for n in VARIANTS)
        print(f"{key:<20} TTFT {1e3 * row[kept.format('ttft_s')]:7.1f} vs {1e3 * row[plain.format('ttft_s')]:7.1f} ms, "
              f"TPOT {1e3 * row[kept.format('tpot_s')]:6.2f} vs {1e3 * row[plain.format('tpot_s')]:6.2f} ms, "
              f"faults {row[kept.format('minor_faults')]:.0f} vs {row[plain.format('minor_faults')]:.0f}  "
              f"(kept vs glibc default)")
    path = write_result(args.name, {"model": "SmolLM2-135M-Instruct", "policy": "cpu", "rounds": args.rounds,
                                    "variants": {n: s or "flexplan's setting" for n, s in VARIANTS.items()},
                                    "allocator": runs[next(iter(VARIANTS))][0][rows[0]["case"]]["allocator"],
                                    "triad_gb_per_s": triads, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
