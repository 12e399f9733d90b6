"""`flexplan` command line: explain, hw, models, run, serve, calibrate, validate, profile-experts.

Every error flexplan raises on purpose is printed as one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from flexplan.errors import FlexplanError, InvalidInputError
from flexplan.estimator.policies import POLICIES
from flexplan.explain import format_plan, format_stored_weights, format_sweep
from flexplan.export import FORMATS as EXPORT_FORMATS
from flexplan.export import export_plan
from flexplan.factors.correction_store import describe_corrections
from flexplan.hardware import get_hardware, report
from flexplan.hardware.hwdb import is_local_name
from flexplan.hardware.introspect import introspect, local_hardware
from flexplan.inputs import gib_bytes
from flexplan.planner import plan
from flexplan.workload import catalog_names, resolve_model
from flexplan.workload.gguf_header import is_gguf_path


def _measuring():
    """flexplan.measure.first_use, imported when a command measures or describes this machine: it
    brings torch and the executor (seconds of imports), which `flexplan --help`, `models` and an
    explain on hwdb hardware do without (the same rule as LAZY_COMMANDS below)."""
    return importlib.import_module("flexplan.measure.first_use")


def _int_list(text: str) -> list[int]:
    """'1,2,4' or '1-32' (powers of two) or '8' -> list of ints."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part[1:]:
                lo, hi = (int(x) for x in part.split("-", 1))
                v = lo
                while v <= hi:
                    out.append(v)
                    v *= 2
            else:
                out.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, a list 1,2,4 or a range 1-32, got {text!r}") from None
    return out


def cmd_explain(args) -> int:
    # the user runs explain on this machine: it measures a first-use probe and the memory state of
    # now before planning (plan() itself never measures)
    eff = _measuring().measured_efficiency(get_hardware(args.hw)) if is_local_name(args.hw) else None
    plans = []
    for b in args.batch_size:
        for i in args.input_len:
            for o in args.output_len:
                plans.append(plan(args.model, hardware=args.hw, batch_size=b, input_len=i, output_len=o,
                                  dtype=args.dtype, gpu_memory_bytes=args.gpu_memory, cpu_memory_bytes=args.cpu_memory,
                                  prefill=args.prefill, decode=args.decode, gpu_layers=args.gpu_layers,
                                  routing_profile=args.routing_profile, weights=args.weights,
                                  policies=args.policies.split(",") if args.policies else None, efficiency=eff))
    if args.export:
        if len(plans) != 1:
            raise InvalidInputError(f"--export translates one plan; give one batch size, input and output length "
                                    f"(got {len(plans)} shapes)")
        p = plans[0]
        print(f"# flexplan's plan for {p.model} on {p.hardware}: prefill {p.prefill.policy} "
              f"({p.prefill.gpu_layers} GPU layers), decode {p.decode.policy} ({p.decode.gpu_layers}); "
              f"predicted TTFT {p.ttft_s:.3g} s, TPOT {p.tpot_s:.3g} s")
        print(export_plan(p, resolve_model(args.model), args.export, args.model).render())
        return 0
    if args.json:
        out = plans[0].to_dict() if len(plans) == 1 else [p.to_dict() for p in plans]
        print(json.dumps(out, indent=2))
        return 0
    print(format_plan(plans[0]) if len(plans) == 1 else format_sweep(plans))
    if is_gguf_path(args.model):  # the file's formats, read from its header (the same spec plan() read)
        print(format_stored_weights(resolve_model(args.model)))
    return 0


def cmd_hw(args) -> int:
    if args.list:
        print(report.format_list())
        return 0
    if args.hw == "local":
        machine = introspect()
        hw = local_hardware()
        print(report.format_hw(machine, hw=hw, calibration_line=_calibration_line(hw)))
    else:
        hw = get_hardware(args.hw)
        print(report.format_hw(hw, calibration_line=_calibration_line(hw)))
    return 0


def _calibration_line(hw) -> str | None:
    return f"{_measuring().describe_calibration(hw)}\n{describe_corrections(hw)}"


def cmd_models(args) -> int:
    print(f"{'model':<38} {'family':<12} {'layers':>6} {'hidden':>7} {'heads/kv':>9} {'params':>9} "
          f"{'active':>8}  attention")
    for name in catalog_names():
        m = resolve_model(name)
        active = f"{m.active_params / 1e9:>7.2f}B" if m.is_moe else f"{'':>8}"
        windowed = sum(m.layer_window(i) is not None for i in range(m.num_layers))
        attn = f"{windowed}/{m.num_layers} layers window {m.sliding_window}" if windowed else "full"
        if m.is_moe:
            attn += f"; MoE {m.experts_per_token} of {m.num_experts} experts"
        print(f"{name:<38} {m.family:<12} {m.num_layers:>6} {m.hidden_size:>7} "
              f"{str(m.num_heads) + '/' + str(m.num_kv_heads):>9} {m.total_params / 1e9:>8.2f}B {active}  {attn}")
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """``command``: the subcommand about to run; only its module is imported (keeps `flexplan hw` fast)."""

    ap = argparse.ArgumentParser(prog="flexplan", description="Plan and run LLM inference over CPU + GPU (FlexInfer).")
    sub = ap.add_subparsers(dest="command", required=True)

    ex = sub.add_parser("explain", help="predict every policy per phase and show the chosen pair")
    ex.add_argument("model", help="catalog id (see `flexplan models`), config.json, model folder or .gguf file "
                                   "(its metadata only)")
    ex.add_argument("--hw", default="local", help="hwdb server, CPU[xS]+GPU+LINK, or 'local' (default)")
    ex.add_argument("-b", "--batch-size", type=_int_list, default=[1], help="batch size(s): 8, 1,4,16 or 1-32")
    ex.add_argument("-i", "--input-len", type=_int_list, default=[512])
    ex.add_argument("-o", "--output-len", type=_int_list, default=[32])
    ex.add_argument("--dtype", default="bfloat16")
    ex.add_argument("--gpu-memory", type=gib_bytes, default=None, metavar="GiB", help="GPU memory budget")
    ex.add_argument("--cpu-memory", type=gib_bytes, default=None, metavar="GiB", help="host memory budget")
    ex.add_argument("--prefill", choices=POLICIES, default=None, help="force the prefill policy")
    ex.add_argument("--decode", choices=POLICIES, default=None, help="force the decode policy")
    ex.add_argument("--gpu-layers", type=int, default=None, help="force M, the GPU-resident layers")
    ex.add_argument("--routing-profile", default=None, metavar="FILE",
                    help="routing profile (`flexplan profile-experts`): price cpu-experts from it and cache the "
                         "most-used CPU experts on the accelerator in the memory left")
    ex.add_argument("--policies", default=None, metavar="A,B,...",
                    help="choose among these policies only (e.g. FlexInfer's: cpu,gpu,gpu-offload,gpu-offload-partial,splitgen)")
    ex.add_argument("--weights", default=None, metavar="FORMAT",
                    help="how the weights are held: gguf (a .gguf file's blocks, its default), float32, int4, int8 "
                         "or a block format (Q4_0, Q4_K, Q8_0, ...: a float model's linears in it)")
    ex.add_argument("--json", action="store_true", help="print plan.to_dict() as JSON")
    ex.add_argument("--export", choices=EXPORT_FORMATS, default=None,
                    help="print the plan as llama.cpp's flags, vLLM's or accelerate's device_map, and what they "
                         "cannot express")
    ex.set_defaults(func=cmd_explain)

    hw = sub.add_parser("hw", help="show this machine and its hwdb matches (or --list hwdb)")
    hw.add_argument("--list", action="store_true", help="list hwdb servers, CPUs, GPUs and links")
    hw.add_argument("--hw", default="local", help="describe a hwdb entry instead of this machine")
    hw.set_defaults(func=cmd_hw)

    mo = sub.add_parser("models", help="list the bundled model catalog")
    mo.set_defaults(func=cmd_models)

    for name, (module, help_text) in LAZY_COMMANDS.items():
        _add_lazy(sub, name, module, help_text, load=(command == name))
    return ap


# Commands whose modules import torch: imported only when that command runs.
LAZY_COMMANDS = {
    "run": ("flexplan.run_cmd", "run a model under a plan (default: the embedded SmolLM2)"),
    "serve": ("flexplan.serve_cmd", "an OpenAI-compatible server, continuous batching (default: the embedded SmolLM2)"),
    "calibrate": ("flexplan.measure.calibrate", "measure this machine's efficiency factors"),
    "validate": ("flexplan.validate", "predicted vs measured TTFT/TPOT over a grid"),
    "profile-experts": ("flexplan.profile_cmd", "count a MoE model's router choices on a few prompts (for --routing-profile)"),
}


def _add_lazy(sub, name: str, module: str, help_text: str, load: bool) -> None:
    import importlib
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return
    p = sub.add_parser(name, help=help_text)
    if load:
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FlexplanError as e:
        print(f"flexplan {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `flexplan ... | head`: the reader left; exit quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
