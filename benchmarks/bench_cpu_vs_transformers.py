"""flexplan's ``cpu`` policy against plain transformers ``generate()`` on this machine.

Same model, dtype (``--dtype``, default float32), torch threads and greedy decoding on both sides; prompts are
random token ids of the exact input length, and ``min_new_tokens = max_new_tokens`` so both
generate exactly the output length. Each side runs once to warm up, then ``--repeats``
times, interleaved (transformers, flexplan, transformers, ...) so background load hits
both alike; the median is reported.

TTFT and TPOT are taken the same way on both sides, from a streamer that timestamps every
token generate() hands it: TTFT = first new token - call start, TPOT = mean gap between
the following tokens, E2E = the whole call. flexplan's own ``last_stats`` are kept next to
them in the JSON.

Cases: (a) SmolLM2-135M-Instruct, batch 1, input 128, output 32; (b) SmolLM2, batch 8,
input 512, output 32; (c) a random-weight Llama of ~2 GB fp32 (benchmarks/common.py),
batch 1, input 128, output 32; (d) the same Llama as a bf16 checkpoint (0.98 GB; its weights
rounded to bf16), same shape: transformers computes in bf16 (the checkpoint's dtype), flexplan in
float32 on the weights kept in bf16 (spec.cpu_weight_dtype), so both read 2-byte weights; --dtype
does not apply to it. (c) and (d) print the decode bandwidth achieved: (weights read + KV cache
read per decode step, flexplan's bytes: float32 KV) / TPOT, against STREAM triad bandwidth measured right before every timed
run (this VM's memory bandwidth swings between ~38 and ~66 GB/s from minute to minute, so a
figure taken once at the start is not the bandwidth the runs saw). Each run's fraction is its
bandwidth over the mean of the STREAM samples just before and after it; the median is reported.

    python benchmarks/bench_cpu_vs_transformers.py                 # all cases
    python benchmarks/bench_cpu_vs_transformers.py --quick --cases a
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

from common import fmt_s, median, random_llama_dir, write_result  # noqa: E402  (also puts the repo on sys.path)

CASES = {
    # name: (model, batch, input_len, output_len); quick: smaller shapes for a smoke test
    "a": ("smollm2", 1, 128, 32),
    "b": ("smollm2", 8, 512, 32),
    "c": ("random-llama", 1, 128, 32),
    "d": ("random-llama-bf16", 1, 128, 32),
}
QUICK_CASES = {"a": ("smollm2", 1, 32, 8), "b": ("smollm2", 2, 64, 8), "c": ("random-llama", 1, 32, 8),
               "d": ("random-llama-bf16", 1, 32, 8)}
WEIGHTS_DTYPE = {"random-llama-bf16": "bfloat16"}  # checkpoints whose dtype is fixed (not --dtype)
DTYPE = "float32"  # set from --dtype
NOT_SLOWER_TOLERANCE = 1.05  # flexplan/transformers up to this counts as "not slower" (run-to-run noise)
BANDWIDTH_TARGET_FRACTION = 0.75


class TimingStreamer:
    """A generate() streamer that timestamps each put(); the first put is the prompt."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def figures(self, t0: float, t_end: float) -> dict[str, float]:
        new = self.times[1:]  # drop the prompt
        ttft = new[0] - t0 if new else float("nan")
        tpot = (new[-1] - new[0]) / (len(new) - 1) if len(new) > 1 else float("nan")
        return {"ttft_s": ttft, "tpot_s": tpot, "e2e_s": t_end - t0, "new_tokens": len(new)}


def timed_generate(model, inputs, output_len: int, pad_token_id: int) -> dict[str, float]:
    import torch

    streamer = TimingStreamer()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                             temperature=None, top_p=None, top_k=None, pad_token_id=pad_token_id, streamer=streamer)
        t_end = time.perf_counter()
    fig = streamer.figures(t0, t_end)
    fig["output_shape"] = list(out.shape)
    return fig


def model_folder(name: str) -> Path:
    if name == "smollm2":
        from flexplan.smollm import default_model_dir

        return default_model_dir()
    if name == "random-llama-bf16":
        from flexplan.synthetic import random_llama_bf16_dir

        return random_llama_bf16_dir()
    return random_llama_dir()


def random_inputs(vocab_size: int, batch: int, input_len: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (batch, input_len), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def load_transformers(folder: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()


def load_flexplan(folder: Path, batch: int, input_len: int, output_len: int, dtype: str, cpu_dtype: str):
    """flexplan with the ``cpu`` policy for both phases, planned for this exact shape, weights in
    ``dtype`` like the transformers side, computing in ``cpu_dtype`` (forced: the planner may
    otherwise pick bf16)."""
    from flexplan.api import load
    from flexplan.planner import plan

    p = plan(folder, hardware="local", batch_size=batch, input_len=input_len, output_len=output_len,
             dtype=dtype, cpu_dtype=cpu_dtype, prefill="cpu", decode="cpu")
    return load(folder, plan=p, accelerator=None, dtype=dtype), p


def decode_bytes_per_step(folder: Path, batch: int, input_len: int, output_len: int, weight_bytes: int,
                          kv_bytes: int) -> float:
    """Mean bytes a decode step reads: every layer's weights and its KV cache (at the context
    length of that step, averaged over the output_len - 1 decode steps), plus the final norm and
    LM head (flexplan.workload.costs, Table 2)."""
    import numpy as np

    from flexplan.workload import resolve_model
    from flexplan.workload.costs import d_kv_cache, d_lm_head, d_weights

    m = resolve_model(folder)
    ctx = input_len + np.arange(1, output_len)  # keys attended by decode steps 1 .. output_len - 1
    kv = float(np.mean(d_kv_cache(m, batch, ctx, kv_bytes)))
    return m.num_layers * (d_weights(m, weight_bytes) + kv) + d_lm_head(m, weight_bytes)


def run_case(name: str, spec: tuple, repeats: int) -> dict:
    import torch

    model_name, batch, input_len, output_len = spec
    folder = model_folder(model_name)
    dtype = WEIGHTS_DTYPE.get(model_name, DTYPE)
    cpu_dtype = "float32" if model_name in WEIGHTS_DTYPE else DTYPE  # a fixed 16-bit checkpoint: widened
    print(f"\n({name}) {folder.name}: batch {batch}, input {input_len}, output {output_len}, weights {dtype}, "
          f"flexplan computes in {cpu_dtype}, {torch.get_num_threads()} threads", flush=True)
    hf = load_transformers(folder, dtype)
    inputs = random_inputs(hf.config.vocab_size, batch, input_len)
    pad = hf.generation_config.pad_token_id
    pad = 0 if pad is None else int(pad if not isinstance(pad, list) else pad[0])
    fx, plan = load_flexplan(folder, batch, input_len, output_len, dtype, cpu_dtype)

    runs = {"transformers": [], "flexplan": []}
    flexplan_stats = []
    sides = (("transformers", hf), ("flexplan", fx))
    bandwidth = model_name.startswith("random-llama")
    stream = []  # STREAM triad samples, one before each timed run and one after the last
    for side, model in sides:  # warm-up
        timed_generate(model, inputs, output_len, pad)
    for _ in range(repeats):
        for side, model in sides:
            if bandwidth:
                stream.append(stream_sample())
            runs[side].append(timed_generate(model, inputs, output_len, pad))
            if side == "flexplan":
                flexplan_stats.append(_stats_dict(getattr(model, "last_stats", None)))
    if bandwidth:
        stream.append(stream_sample())
    del hf, fx
    gc.collect()

    result = {"model": folder.name, "dtype": dtype, "flexplan_cpu_dtype": cpu_dtype, "batch": batch, "input_len": input_len, "output_len": output_len,
              "repeats": repeats, "plan": plan.to_dict(), "runs": runs, "flexplan_stats": flexplan_stats}
    for side in runs:
        result[side] = {k: median([r[k] for r in runs[side]]) for k in ("ttft_s", "tpot_s", "e2e_s")}
    result["ratio_flexplan_over_transformers"] = {
        k: result["flexplan"][k] / result["transformers"][k] for k in ("ttft_s", "tpot_s", "e2e_s")}
    result["not_slower"] = result["ratio_flexplan_over_transformers"]["e2e_s"] <= NOT_SLOWER_TOLERANCE

    print(f"  {'':<14}{'TTFT':>11}{'TPOT':>11}{'E2E':>11}")
    for side in ("transformers", "flexplan"):
        r = result[side]
        print(f"  {side:<14}{fmt_s(r['ttft_s']):>11}{fmt_s(r['tpot_s']):>11}{fmt_s(r['e2e_s']):>11}")
    ratio = result["ratio_flexplan_over_transformers"]
    print(f"  {'ratio fx/hf':<14}{ratio['ttft_s']:>11.2f}{ratio['tpot_s']:>11.2f}{ratio['e2e_s']:>11.2f}   "
          f"not slower (E2E ratio <= {NOT_SLOWER_TOLERANCE}): {'yes' if result['not_slower'] else 'NO'}")

    print(f"  planner predicted TTFT {fmt_s(plan.ttft_s)}, TPOT {fmt_s(plan.tpot_s)} "
          f"(efficiency factors: {plan.calibration})")

    if bandwidth:
        from flexplan.hardware.spec import DTYPE_BYTES, cpu_weight_dtype

        step_bytes = decode_bytes_per_step(folder, batch, input_len, output_len,
                                           DTYPE_BYTES[cpu_weight_dtype(dtype, cpu_dtype)], DTYPE_BYTES[cpu_dtype])
        result["decode_bytes_per_step"] = step_bytes
        result["stream_triad_samples_bytes_per_s"] = stream
        result["stream_triad_bytes_per_s"] = median(stream)
        print(f"  decode reads {step_bytes / 1e9:.2f} GB per step; STREAM triad next to the runs "
              f"{min(stream) / 1e9:.1f} .. {max(stream) / 1e9:.1f} GB/s (median {median(stream) / 1e9:.1f})")
        for k, (side, _) in enumerate(sides):
            fractions = []
            for r, run in enumerate(runs[side]):
                i = 2 * r + k  # STREAM sample taken just before this run; the next one just after
                fractions.append(step_bytes / run["tpot_s"] / ((stream[i] + stream[i + 1]) / 2))
            bw = step_bytes / result[side]["tpot_s"]
            frac = median(fractions)
            result[side]["decode_bytes_per_s"] = bw
            result[side]["decode_fraction_of_stream_per_run"] = fractions
            result[side]["decode_fraction_of_stream"] = frac
            ok = "meets" if frac >= BANDWIDTH_TARGET_FRACTION else "below"
            print(f"  {side:<14} decode achieved {bw / 1e9:.1f} GB/s; {100 * frac:.1f}% of the STREAM triad measured "
                  f"around each run (median; {ok} the {100 * BANDWIDTH_TARGET_FRACTION:.0f}% target)")
    return result


def stream_sample() -> float:
    """STREAM triad bytes/s now, with the benchmark's threads (about 0.5 s)."""
    import torch

    from flexplan.measure.stream import stream_triad_bytes_per_s

    return stream_triad_bytes_per_s(threads=torch.get_num_threads())


def _stats_dict(stats):
    if stats is None or isinstance(stats, dict):
        return stats
    if hasattr(stats, "to_dict"):
        return stats.to_dict()
    from dataclasses import asdict, is_dataclass

    return asdict(stats) if is_dataclass(stats) else repr(stats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of both sides (bfloat16 only where the CPU is fast at it)")
    ap.add_argument("--cases", default="a,b,c,d", help="comma-separated subset of a,b,c,d (default: all)")
    ap.add_argument("--quick", action="store_true", help="smaller shapes and 1 repeat (smoke test)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per side (default 3, quick 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    ap.add_argument("--name", default=None, help="results file name (default bench_cpu_vs_transformers[_quick])")
    args = ap.parse_args(argv)
    import torch

    global DTYPE
    DTYPE = args.dtype
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; use a subset of {', '.join(CASES)}")
    table = QUICK_CASES if args.quick else CASES
    repeats = args.repeats or (1 if args.quick else 3)
    results = {c: run_case(c, table[c], repeats) for c in cases}
    name = args.name or ("bench_cpu_vs_transformers" + ("_quick" if args.quick else "")
                         + ("" if DTYPE == "float32" else f"_{DTYPE}"))
    path = write_result(name, {"quick": args.quick, "threads": torch.get_num_threads(), "cases": results})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
