"""Peak host memory while loading the random-weight Llama (~2 GB fp32, benchmarks/common.py):
flexplan's streaming loader against plain ``from_pretrained``.

Each loader runs in its own fresh Python process, so the figure is that loader's alone. The
child imports torch/transformers/flexplan, records its resident set (VmRSS) as the baseline,
loads the model with the ``cpu`` policy (flexplan) or ``AutoModelForCausalLM.from_pretrained``
in float32 (transformers), runs one forward step on 8 tokens to prove the model is usable,
and reports the peak resident set VmHWM from /proc/self/status, once right after loading and
once after the forward step. Printed: model size on disk, peak RSS, peak RSS above the
post-import baseline, the ratio flexplan/transformers, and each loader's peak while loading.

flexplan's expected peak is the placed model plus its largest tensor: tensors of flat buffers
are read straight into them, but a CPU linear's weight is read into a temporary before it is
reordered into its packed layout, flexplan's blocked one or oneDNN's (for this model the untied
262 MB LM head).

    python benchmarks/bench_load_memory.py
    python benchmarks/bench_load_memory.py --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import dir_size_bytes, median, random_llama_dir, write_result  # noqa: E402

LOADERS = ("flexplan", "transformers")


def proc_status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmHWM, VmRSS), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class AnonPeakSampler:
    """Polls RssAnon (private memory, as opposed to file pages mapped from the safetensors,
    which the kernel can drop) every ``interval_s`` in a thread; VmHWM counts both."""

    def __init__(self, interval_s: float = 0.005):
        import threading

        self.peak = proc_status_bytes("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(interval_s,), daemon=True)
        self._thread.start()

    def _poll(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.peak = max(self.peak, proc_status_bytes("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, proc_status_bytes("RssAnon"))


def child(loader: str, folder: Path, kernel: str | None = None) -> dict:
    """Runs in the subprocess: load once, measure, print one JSON line."""
    import torch
    import transformers  # noqa: F401  (imported before the baseline on both sides)

    from flexplan.api import load  # noqa: F401  (same imports on both sides before the baseline)

    baseline = proc_status_bytes("VmRSS")
    baseline_anon = proc_status_bytes("RssAnon")
    sampler = AnonPeakSampler()
    t0 = time.perf_counter()
    if loader == "flexplan":
        from flexplan.executor.loading import load_streaming
        from flexplan.executor.plans import fixed_plan

        p = fixed_plan(transformers.AutoConfig.from_pretrained(folder), "cpu", "cpu", dtype="float32",
                       cpu_dtype="float32", batch_size=1, input_len=8, output_len=1)
        model = load_streaming(folder, p, "cpu", cpu_linear_kernel=kernel)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    load_s = time.perf_counter() - t0
    peak_anon = sampler.stop()
    peak_load = proc_status_bytes("VmHWM")  # the load's peak, before the forward step below
    ids = torch.arange(3, 11).unsqueeze(0)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    return {"loader": loader, "load_s": load_s, "baseline_rss_bytes": baseline,
            "peak_rss_bytes": proc_status_bytes("VmHWM"), "peak_rss_load_bytes": peak_load,
            "final_rss_bytes": proc_status_bytes("VmRSS"),
            "baseline_anon_bytes": baseline_anon, "peak_anon_bytes": peak_anon,
            "final_anon_bytes": proc_status_bytes("RssAnon"), "final_file_bytes": proc_status_bytes("RssFile")}


def gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def measure(loader: str, folder: Path, kernel: str | None = None) -> dict:
    env = dict(os.environ)
    extra = ["--cpu-linear-kernel", kernel] if kernel else []
    r = subprocess.run([sys.executable, __file__, "--child", loader, "--model", str(folder), *extra],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{loader} loader failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="subprocess runs per loader (median reported)")
    ap.add_argument("--model", default=None, help="model folder (default: the random Llama, created once)")
    ap.add_argument("--child", choices=LOADERS, help=argparse.SUPPRESS)
    ap.add_argument("--cpu-linear-kernel", choices=["flexplan-blocked", "onednn-packed", "F.linear"], default=None,
                    help="flexplan's CPU linear kernel (default: cpu_linear.default_kernel()); results file "
                         "bench_load_memory_<kernel>.json when given")
    args = ap.parse_args(argv)
    folder = Path(args.model) if args.model else random_llama_dir()
    if args.child:
        print(json.dumps(child(args.child, folder, args.cpu_linear_kernel)))
        return 0

    disk = dir_size_bytes(folder)
    print(f"{folder.name}: {disk / 1e9:.2f} GB of safetensors on disk")
    runs = {loader: [measure(loader, folder, args.cpu_linear_kernel) for _ in range(args.repeats)] for loader in LOADERS}
    summary = {}
    keys = ("peak_rss_bytes", "peak_rss_load_bytes", "baseline_rss_bytes", "peak_anon_bytes", "baseline_anon_bytes",
            "final_anon_bytes", "final_file_bytes", "load_s")
    print(f"  {'loader':<14}{'peak RSS':>11}{'above base':>12}{'peak anon':>12}{'final anon':>12}"
          f"{'final file':>12}{'load':>9}")
    for loader in LOADERS:
        s = {k: median([r[k] for r in runs[loader]]) for k in keys}
        s["peak_above_baseline_bytes"] = s["peak_rss_bytes"] - s["baseline_rss_bytes"]
        s["load_peak_above_baseline_bytes"] = s["peak_rss_load_bytes"] - s["baseline_rss_bytes"]
        s["peak_anon_above_baseline_bytes"] = s["peak_anon_bytes"] - s["baseline_anon_bytes"]
        summary[loader] = s
        print(f"  {loader:<14}{gb(s['peak_rss_bytes']):>11}{gb(s['peak_above_baseline_bytes']):>12}"
              f"{gb(s['peak_anon_above_baseline_bytes']):>12}{gb(s['final_anon_bytes']):>12}"
              f"{gb(s['final_file_bytes']):>12}{s['load_s']:>7.1f} s")
    ratio = summary["flexplan"]["peak_rss_bytes"] / summary["transformers"]["peak_rss_bytes"]
    ratio_above = summary["flexplan"]["peak_above_baseline_bytes"] / summary["transformers"]["peak_above_baseline_bytes"]
    print(f"  ratio flexplan/transformers: peak RSS {ratio:.2f}, above baseline {ratio_above:.2f}; "
          f"flexplan peak above baseline = {summary['flexplan']['peak_above_baseline_bytes'] / disk:.2f} x model size")
    for loader in LOADERS:
        print(f"  {loader}: peak while loading (VmHWM before the first forward) "
              f"{gb(summary[loader]['load_peak_above_baseline_bytes'])} above baseline = "
              f"{summary[loader]['load_peak_above_baseline_bytes'] / disk:.2f} x model size")
    print("  (RSS counts private memory and safetensors pages mapped from the page cache; 'anon' is private "
          "memory alone, sampled every 5 ms, above the post-import baseline)")
    name = "bench_load_memory" + (f"_{args.cpu_linear_kernel.replace('.', '_')}" if args.cpu_linear_kernel else "")
    path = write_result(name, {
        "cpu_linear_kernel": args.cpu_linear_kernel, "model": folder.name, "model_bytes_on_disk": disk, "runs": runs,
        "summary": summary, "ratio_peak_rss": ratio, "ratio_peak_above_baseline": ratio_above,
    })
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
