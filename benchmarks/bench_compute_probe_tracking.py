"""Which compute probe follows a small model's prefill (TTFT) across the host's states?

    python benchmarks/bench_compute_probe_tracking.py [--seconds 240]

For ``--seconds``, over and over: torch's best-of-5 512^3 float32 product (the compute probe before
the burst), flexplan's compute probe now (``membw.measure_matmul_flops_per_s``: a burst of small
prefill-shaped products timed whole), the same burst by flexplan's own CPU linear kernel over 8
weights of SmolLM2's MLP shape, the decode-GEMV probe, then SmolLM2-135M (the embedded model,
``flexplan.load``, CPU only) generating 8 tokens after a 42-token prompt: its TTFT and TPOT.
Reports, per probe, the log-log slope and correlation of the TTFT (and TPOT) against it, and the
medians of 20-second blocks. Writes ``benchmarks/results/probe_tracking_compute.json``
(``--name`` to change); ``--from-samples FILE`` summarises samples kept before instead.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from common import write_result

PROMPT_TOKENS, NEW_TOKENS = 42, 8
PROBES = ("matmul512_best5", "burst_torch", "burst_flexplan_kernel", "gemv")


def measure(seconds: float) -> list[dict]:
    import torch

    import flexplan
    from flexplan.measure import membw
    from flexplan.executor.cpu_linear import LinearKernel
    from flexplan.validate import resolve_model_dir

    lm = flexplan.load(str(resolve_model_dir("smollm2")), plan={"prefill": "cpu", "decode": "cpu"}, accelerator=None,
                       online_correction=False)
    ids = torch.randint(3, 40000, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))

    def generate() -> tuple[float, float]:
        lm.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, temperature=None,
                    top_p=None, top_k=None)
        return lm.last_stats.ttft_s, lm.last_stats.tpot_s

    a, b, out = torch.rand(512, 512), torch.rand(512, 512), torch.empty(512, 512)

    def matmul512() -> float:
        torch.mm(a, b, out=out)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - t0)
        return 2.0 * 512 ** 3 / best

    rows_, k, n, count = membw.COMPUTE_BURST
    kernel = LinearKernel(device="cpu")
    weights = [kernel.prepare(torch.randn(n, k) * 1e-2, rows_) for _ in range(8)]
    x = torch.randn(rows_, k)

    def burst_kernel() -> float:
        with torch.inference_mode():
            for w in weights:
                kernel(x, w)
            t0 = time.perf_counter()
            for i in range(count):
                kernel(x, weights[i % len(weights)])
            return 2.0 * rows_ * k * n * count / (time.perf_counter() - t0)

    generate(), generate()
    samples = []
    end = time.time() + seconds
    while time.time() < end:
        r = dict(t=time.time(), matmul512_best5=matmul512(), burst_torch=membw.measure_matmul_flops_per_s(),
                 burst_flexplan_kernel=burst_kernel(), gemv=membw.measure_gemv_bytes_per_s())
        r["ttft_s"], r["tpot_s"] = generate()
        samples.append(r)
    return samples


def summarise(samples: list[dict]) -> dict:
    a = {k: np.array([s[k] for s in samples], float) for k in samples[0]}
    fits = {}
    for phase in ("ttft_s", "tpot_s"):
        y = np.log(a[phase])
        for probe in PROBES:
            x = np.log(a[probe])
            slope, icpt = np.polyfit(x, y, 1)
            fits[f"{phase} vs {probe}"] = dict(slope=round(float(slope), 3), corr=round(float(np.corrcoef(x, y)[0, 1]), 3),
                                               log_sd_before=round(float(np.std(y)), 4),
                                               log_sd_after=round(float(np.std(y - (slope * x + icpt))), 4))
    t = a["t"] - a["t"][0]
    blocks = []
    for start in np.arange(0.0, float(t[-1]) + 1e-9, 20.0):
        sel = (t >= start) & (t < start + 20.0)
        if sel.any():
            blocks.append({"t_s": float(start), "n": int(sel.sum()),
                           **{k: float(np.median(a[k][sel])) for k in (*PROBES, "ttft_s", "tpot_s")}})
    return {"samples": len(samples), "fits": fits, "blocks_20s": blocks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--name", default="probe_tracking_compute")
    ap.add_argument("--from-samples", default=None, metavar="FILE", help="summarise kept samples (JSON list)")
    args = ap.parse_args()
    samples = json.load(open(args.from_samples)) if args.from_samples else measure(args.seconds)
    summary = summarise(samples)
    for k, v in summary["fits"].items():
        print(f"{k:<34} slope {v['slope']:6.2f}  corr {v['corr']:5.2f}  log sd {v['log_sd_before']:.3f} -> "
              f"{v['log_sd_after']:.3f}")
    for b in summary["blocks_20s"]:
        print(f"{b['t_s']:5.0f} s  " + "  ".join(f"{p} {b[p] / 1e9:6.1f}" for p in PROBES)
              + f"  TTFT {b['ttft_s'] * 1e3:5.1f} ms  TPOT {b['tpot_s'] * 1e3:5.1f} ms")
    print(f"wrote {write_result(args.name, {'seconds': args.seconds, **summary, 'raw': samples})}")


if __name__ == "__main__":
    main()
