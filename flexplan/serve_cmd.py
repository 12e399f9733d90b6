"""`flexplan serve [MODEL]`: the serving engine behind an OpenAI-compatible HTTP server.

With no MODEL it serves the embedded SmolLM2-135M-Instruct, so `flexplan serve` works on a fresh
box. The server is the ``[serve]`` extra (FastAPI, uvicorn, prometheus-client, jinja2):
``pip install 'flexplan-infer[serve]'``.

    flexplan serve                                   # SmolLM2 on 127.0.0.1:8000
    flexplan serve ./my-llama --port 8080 --gpu-memory 6 --device cuda
    curl localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 8}'
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

import torch

from flexplan.errors import FlexplanError, InvalidInputError
from flexplan.inputs import gib_bytes
from flexplan.hardware import get_hardware
from flexplan.measure.state import efficiency_now
from flexplan.serving.engine import Engine
from flexplan.serving.scheduler import NeoApexScheduler
from flexplan.smollm import MODEL_NAME, default_model_dir
from flexplan.workload import resolve_model

EXTRA = ("fastapi", "uvicorn", "prometheus_client", "jinja2")
INSTALL_HINT = "pip install 'flexplan-infer[serve]'  (FastAPI, uvicorn, prometheus-client, jinja2)"
EMBEDDED_ALIASES = (f"HuggingFaceTB/{MODEL_NAME}", "smollm2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="transformers model folder or hub name (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--device", default=None, help="where the weights live: cpu or cuda (default: cuda if "
                                                       "available, else cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--gpu-memory", type=gib_bytes, default=None, metavar="GiB",
                        help="the accelerator's budget: its KV pool is this less the weights and one iteration's "
                             "activations (on the CPU: a pool that stands in for an accelerator's)")
    parser.add_argument("--cpu-memory", type=gib_bytes, default=None, metavar="GiB",
                        help="the host KV pool's budget (default: a quarter of the available memory, at most 2 GiB)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model's name in the API (default: the folder's name)")
    parser.add_argument("--max-waiting", type=int, default=256, metavar="N",
                        help="requests queued beyond the running batch before new ones get HTTP 429 (default 256)")
    parser.add_argument("--max-running", type=int, default=256, metavar="N", help="requests running at once")
    parser.add_argument("--token-budget", type=int, default=512, metavar="N",
                        help="new tokens per iteration: prefill chunks + decodes (default 512)")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="N",
                        help="context length served (default: the model's)")
    parser.add_argument("--drain-s", type=float, default=5.0, metavar="S",
                        help="on SIGTERM, seconds requests in flight get before they are aborted (default 5)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def model_names(model: str | None, served_name: str | None) -> tuple[str, tuple[str, ...]]:
    """The API's model name and its aliases (the argument as typed; the embedded model's hub name)."""
    if model is None:
        return served_name or MODEL_NAME, tuple(a for a in (MODEL_NAME, *EMBEDDED_ALIASES) if a != served_name)
    name = served_name or Path(model.rstrip("/")).name or model
    return name, tuple(a for a in {model, Path(model.rstrip("/")).name} if a != name)


def _device(name: str | None) -> str:
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidInputError(f"--device {name}: no CUDA device here; use --device cpu")
    return name


def scheduler_for(model: str | None, device: str):
    """NEO's and APEX's load-aware scheduler, priced by this machine's calibrated factors, where an
    accelerator holds the device pool; None (the engine's FCFS) on the CPU alone, where every
    decode attends beside its KV in one pool."""
    if device == "cpu":
        return None
    hw = get_hardware("local")
    spec = resolve_model(model if model is not None else str(default_model_dir()))
    return NeoApexScheduler(spec, hw, efficiency_now(hw))


def run(args: argparse.Namespace) -> int:
    """Entry point of `flexplan serve`; FlexplanError -> one line on stderr and exit code 2."""
    missing = [m for m in EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        print(f"flexplan serve: error: the server needs {', '.join(missing)}: {INSTALL_HINT}", file=sys.stderr)
        return 2
    # imported once the extra is known to be installed (the check above prints how to get it)
    server = importlib.import_module("flexplan.serving.server")
    try:
        device = _device(args.device)
        engine = Engine.from_pretrained(args.model, device=device, dtype=getattr(torch, args.dtype),
                                        device_memory_bytes=args.gpu_memory, host_memory_bytes=args.cpu_memory,
                                        max_running=args.max_running, token_budget=args.token_budget,
                                        max_model_len=args.max_model_len, scheduler=scheduler_for(args.model, device))
    except FlexplanError as e:
        print(f"flexplan serve: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    name, aliases = model_names(args.model, args.served_model_name)
    stats = engine.stats()
    print(f"flexplan serve: {name} on {engine.device} ({args.dtype}), context {engine.max_model_len} tokens, "
          f"KV blocks {dict(stats.blocks_free)}; http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    app = server.create_app(engine, name, aliases=aliases, max_waiting=args.max_waiting, drain_s=args.drain_s)
    try:
        server.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0
