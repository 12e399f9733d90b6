"""`flexplan serve [MODEL]`: the serving engine behind an OpenAI-compatible HTTP server.

With no MODEL it serves the embedded SmolLM2-135M-Instruct, so `flexplan serve` works on a fresh
box. The server is the ``[serve]`` extra (FastAPI, uvicorn, prometheus-client, jinja2):
``pip install 'flexplan-infer[serve]'``.

    flexplan serve                                   # SmolLM2 on 127.0.0.1:8000
    flexplan serve ./my-llama --port 8080 --gpu-memory 6 --device cuda
    flexplan serve ./model-Q4_K_M.gguf                # the file's own blocks, on the CPU
    flexplan serve ./my-llama --weights int4          # quantised at load, on the CPU
    flexplan serve ./my-70b --accelerator cuda --gpu-memory 20   # placed per phase by the planner
    curl localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 8}'
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path

import torch

from flexplan.errors import FlexplanError, InvalidInputError
from flexplan.estimator.policies import POLICIES
from flexplan.inputs import gib_bytes, port_number, positive_ms
from flexplan.hardware import get_hardware
from flexplan.measure.state import efficiency_now
from flexplan.quant.sources import DENSE, GGUF_BLOCKS, GGUF_FLOAT32, WeightsSource, weights_source
from flexplan.serving.engine import KV_DTYPES, Engine
from flexplan.serving.scheduler import NeoApexScheduler
from flexplan.smollm import MODEL_NAME, default_model_dir
from flexplan.workload import resolve_model
from flexplan.workload.gguf_header import is_gguf_path

EXTRA = ("fastapi", "uvicorn", "prometheus_client", "jinja2")
INSTALL_HINT = "pip install 'flexplan-infer[serve]'  (FastAPI, uvicorn, prometheus-client, jinja2)"
EMBEDDED_ALIASES = (f"HuggingFaceTB/{MODEL_NAME}", "smollm2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="transformers model folder, hub name or .gguf file (default: the embedded "
                             "SmolLM2-135M-Instruct, float32)")
    parser.add_argument("--weights", default="auto", choices=("auto", "float32", "int8", "int4"),
                        help="what the weights are held as. auto (default): a .gguf file's own blocks (on the CPU), "
                             "a folder's float weights (in --dtype); float32: a .gguf file dequantised to float32 "
                             "(any --device), a folder as auto; int8 / int4: a folder's decoder and head linears "
                             "quantised at load to group-wise blocks (Q8_0 / Q4_1, groups of 32; on the CPU)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=8000, help="port (default 8000)")
    parser.add_argument("--device", default=None, help="where the weights live: cpu or cuda (default: cuda if "
                                                       "available, else cpu; blocks run on the cpu only)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--gpu-memory", type=gib_bytes, default=None, metavar="GiB",
                        help="the accelerator's budget: its KV pool is this less the weights and one iteration's "
                             "activations (on the CPU: a pool that stands in for an accelerator's)")
    parser.add_argument("--cpu-memory", type=gib_bytes, default=None, metavar="GiB",
                        help="the host KV pool's budget (default: a quarter of the available memory, at most 2 GiB)")
    parser.add_argument("--accelerator", default=None, choices=("cuda", "cpu"),
                        help="serve a model larger than the accelerator: flexplan's planner places its weights per "
                             "phase within --gpu-memory (streamed, resident, on the CPU) and each iteration runs "
                             "under the placement the estimator prices lower; 'cpu' stands in for the accelerator")
    parser.add_argument("--prefill", default=None, metavar="POLICY",
                        help=f"with --accelerator: force the prefill policy ({', '.join(POLICIES)})")
    parser.add_argument("--decode", default=None, metavar="POLICY", help="with --accelerator: force the decode policy")
    parser.add_argument("--gpu-layers", type=int, default=None, metavar="M",
                        help="with --accelerator: force M, the accelerator-resident layers")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model's name in the API (default: the folder's or the .gguf file's name)")
    parser.add_argument("--max-waiting", type=int, default=256, metavar="N",
                        help="requests queued beyond the running batch before new ones get HTTP 429 (default 256)")
    parser.add_argument("--max-running", type=int, default=256, metavar="N", help="requests running at once")
    parser.add_argument("--token-budget", type=int, default=512, metavar="N",
                        help="new tokens per iteration: prefill chunks + decodes (default 512)")
    parser.add_argument("--kv-dtype", default="auto",
                        choices=("auto", *(str(d).removeprefix("torch.") for d in KV_DTYPES if d is not None)),
                        help="the KV blocks' dtype (default auto: the model's); bfloat16 under a float32 model halves "
                             "the bytes a decode's attention reads and doubles the tokens a pool holds")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="compute every prompt whole (default: a prompt's leading blocks that an earlier request "
                             "computed, a shared system prompt or a conversation's earlier turns, are taken from "
                             "the KV pool)")
    parser.add_argument("--tpot-target-ms", type=positive_ms, default=None, metavar="MS",
                        help="the time between a running request's tokens to aim for: each iteration's prefill "
                             "chunks sized to it from the iterations measured, at most --token-budget tokens "
                             "(default: none, always --token-budget)")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="N",
                        help="context length served (default: the model's)")
    parser.add_argument("--drain-s", type=float, default=5.0, metavar="S",
                        help="on SIGTERM, seconds requests in flight get before they are aborted (default 5)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def model_names(model: str | None, served_name: str | None) -> tuple[str, tuple[str, ...]]:
    """The API's model name and its aliases (the argument as typed; the embedded model's hub name)."""
    if model is None:
        return served_name or MODEL_NAME, tuple(a for a in (MODEL_NAME, *EMBEDDED_ALIASES) if a != served_name)
    base = Path(model.rstrip("/")).name or model
    name = served_name or base
    # a .gguf file answers to its stem too: what a client types without the suffix
    candidates = (model, base, Path(base).stem) if is_gguf_path(base) else (model, base)
    return name, tuple(a for a in dict.fromkeys(candidates) if a != name)


def _device(name: str | None) -> str:
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidInputError(f"--device {name}: no CUDA device here; use --device cpu")
    return name


def weights_and_device(model: str | None, weights: str, device: str | None) -> tuple[WeightsSource, str]:
    """(what MODEL loads as for ``--weights``, the device it is served on): the rule is flexplan.load's
    (quant.sources.weights_source). Blocks default to the CPU: their kernels are CPU code today (the
    engine refuses another --device, naming what works)."""
    source = weights_source(model if model is not None else str(default_model_dir(verbose=False)), weights)
    if source.blocks:
        return source, device or "cpu"
    return source, _device(device)


def weights_label(source: WeightsSource, dtype: str) -> str:
    """What the startup line says the weights are: the dtype of float weights, or their blocks."""
    if source.kind == DENSE:
        return dtype
    if source.kind == GGUF_FLOAT32:
        return f"dequantised to {dtype}"
    return ("the file's own blocks" if source.kind == GGUF_BLOCKS else f"{source.kind} blocks quantised at load") + \
        ", float32 activations"


def scheduler_for(model: str | None, device: str, source: WeightsSource | None = None):
    """NEO's and APEX's load-aware scheduler, priced by this machine's calibrated factors, where an
    accelerator holds the device pool; None (the engine's FCFS) on the CPU alone, where every
    decode attends beside its KV in one pool."""
    if device == "cpu":
        return None
    hw = get_hardware("local")
    spec = resolve_model(model if model is not None else str(default_model_dir()))
    if source is not None and source.kind == GGUF_FLOAT32:  # priced as served: plain float tensors
        spec = dataclasses.replace(spec, stored_weights=())
    return NeoApexScheduler(spec, hw, efficiency_now(hw))


def placed_plan(args: argparse.Namespace):
    """What ``flexplan.load`` places the model by: "auto" or the forced policies and M; None (the
    whole model on ``--device``) without ``--accelerator``."""
    forced = {k: v for k, v in (("prefill", args.prefill), ("decode", args.decode), ("gpu_layers", args.gpu_layers))
              if v is not None}
    if args.accelerator is None:
        if forced:
            raise InvalidInputError(f"--{'/--'.join(k.replace('_', '-') for k in forced)} place the model per phase: "
                                    "add --accelerator cuda (or cpu, the stand-in)")
        return None
    if args.device is not None:
        raise InvalidInputError("--device puts the whole model on one device; --accelerator places it per phase: "
                                "give one of them")
    return forced or "auto"


def run(args: argparse.Namespace) -> int:
    """Entry point of `flexplan serve`; FlexplanError -> one line on stderr and exit code 2."""
    missing = [m for m in EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        print(f"flexplan serve: error: the server needs {', '.join(missing)}: {INSTALL_HINT}", file=sys.stderr)
        return 2
    # imported once the extra is known to be installed (the check above prints how to get it)
    server = importlib.import_module("flexplan.serving.server")
    try:
        plan = placed_plan(args)
        limits = dict(dtype=getattr(torch, args.dtype), device_memory_bytes=args.gpu_memory,
                      host_memory_bytes=args.cpu_memory, max_running=args.max_running,
                      token_budget=args.token_budget, max_model_len=args.max_model_len,
                      iteration_target_s=None if args.tpot_target_ms is None else args.tpot_target_ms / 1e3,
                      kv_dtype=None if args.kv_dtype == "auto" else getattr(torch, args.kv_dtype),
                      prefix_caching=not args.no_prefix_caching)
        if plan is not None:  # placed per phase; its scheduler prices the placements (serving.placed_scheduler)
            source = weights_source(args.model if args.model is not None else str(default_model_dir(verbose=False)),
                                    args.weights)
            engine = Engine.from_pretrained(args.model, weights=args.weights, plan=plan, accelerator=args.accelerator,
                                            gpu_memory_bytes=args.gpu_memory, **limits)
        else:
            source, device = weights_and_device(args.model, args.weights, args.device)
            engine = Engine.from_pretrained(args.model, weights=args.weights, device=device,
                                            scheduler=scheduler_for(args.model, device, source), **limits)
    except FlexplanError as e:
        print(f"flexplan serve: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    name, aliases = model_names(args.model, args.served_model_name)
    stats = engine.stats()
    where = engine.device if engine.flexmodel is None else (
        f"{engine.device}, placed: prefill {engine.flexmodel.plan.prefill.policy}, decode "
        f"{engine.flexmodel.plan.decode.policy}, M={engine.flexmodel.plan.decode.gpu_layers}")
    print(f"flexplan serve: {name} on {where} ({weights_label(source, args.dtype)}), "
          f"context {engine.max_model_len} tokens, KV blocks {dict(stats.blocks_free)}; "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    app = server.create_app(engine, name, aliases=aliases, max_waiting=args.max_waiting, drain_s=args.drain_s)
    try:
        server.run(app, host=args.host, port=args.port, log_level=args.log_level)
    except server.ServerFailed as e:
        print(f"flexplan serve: error: {e}", file=sys.stderr)
        return 2
    finally:
        engine.close()
    return 0
