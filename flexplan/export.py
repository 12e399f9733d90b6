"""A plan as the settings of the engines users outgrow into: llama.cpp, vLLM, accelerate.

Each exporter reads the plan's placement (decode's: the phase a deployment lives in; prefill's
differences are said) and writes that tool's own flags or ``device_map``, then says, line by line,
what of the plan the tool cannot express and what it does instead. Nothing is measured or run:
the export is a translation of the plan, as ``explain`` is a rendering of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from flexplan.errors import InvalidInputError
from flexplan.estimator.policies import placement_of
from flexplan.hardware.spec import DTYPE_BYTES
from flexplan.placement import (
    CPU,
    CPU_EXPERTS,
    RESIDENT,
    SPLIT_POINTS,
    STREAMED,
    STREAMED_CPU_ATTENTION,
    LayerMode,
    PhasePlacement,
)
from flexplan.plan_types import Plan
from flexplan.workload.catalog import config_dict
from flexplan.workload.costs import kv_cache_bytes_per_layer
from flexplan.workload.model import ModelSpec

GiB = 1 << 30
FORMATS = ("llama.cpp", "vllm", "accelerate")


@dataclass
class Export:
    """One tool's settings for a plan: the command line (or code) and what it cannot express."""

    tool: str
    settings: str
    cannot: list[str] = field(default_factory=list)

    def render(self) -> str:
        lines = [self.settings]
        if self.cannot:
            lines.append(f"# not expressible in {self.tool}:")
            lines += [f"#   - {c}" for c in self.cannot]
        return "\n".join(lines)


def export_plan(plan: Plan, spec: ModelSpec, tool: str, model_ref: str | None = None) -> Export:
    """``plan`` (of ``spec``) as ``tool``'s settings; ``model_ref``: the model path or id to put in
    the command (accelerate also reads its module names from it)."""
    if tool not in FORMATS:
        raise InvalidInputError(f"unknown export format {tool!r}; use one of {', '.join(FORMATS)}")
    placement = placement_of(plan, spec.num_layers)
    decode, prefill = placement.phases["decode"], placement.phases["prefill"]
    return {"llama.cpp": _llama_cpp, "vllm": _vllm, "accelerate": _accelerate}[tool](
        plan, spec, prefill, decode, model_ref or plan.model)


def _layers(pp: PhasePlacement, *modes: LayerMode) -> list[int]:
    return [i for i, m in enumerate(pp.modes) if m in modes]


def _alternation(layers: list[int]) -> str:
    """``blk\\.(0|1|2)\\.``: the layers' tensors, as llama.cpp's --override-tensor matches them."""
    return r"blk\.(" + "|".join(str(i) for i in layers) + r")\."


def _head_on_accelerator(pp: PhasePlacement) -> bool:
    return pp.head_mode == RESIDENT


def _prefill_note(prefill: PhasePlacement, decode: PhasePlacement, tool: str, how: str) -> list[str]:
    """Where prefill's placement differs from decode's: the tool holds one placement for both."""
    if prefill.modes == decode.modes:
        return []
    return [f"prefill's own placement ({prefill.describe()}) beside decode's: {tool} holds one placement for both "
            f"phases ({how})"]


def _llama_cpp(plan: Plan, spec: ModelSpec, prefill, decode, model_ref: str) -> Export:
    n, cannot = spec.num_layers, []
    on_gpu = _layers(decode, RESIDENT, CPU_EXPERTS)
    gguf = model_ref.endswith(".gguf")
    args = ["llama-server", "-m", model_ref if gguf else "MODEL.gguf"]
    head_gpu = _head_on_accelerator(decode)
    if on_gpu == list(range(n - len(on_gpu), n)):  # -ngl N: the last N layers (and the output layer: N > n_layer)
        args += ["-ngl", str(len(on_gpu) + (1 if head_gpu and len(on_gpu) == n else 0))]
        if head_gpu and len(on_gpu) < n:
            args += ["-ot", r"'output\.=CUDA0'"]
    else:
        args += ["-ngl", str(n + 1)]
        off = [i for i in range(n) if i not in on_gpu]
        if off:
            args += ["-ot", f"'{_alternation(off)}=CPU'"]
        if not head_gpu:
            args += ["-ot", r"'output\.=CPU'"]
    experts = _layers(decode, CPU_EXPERTS)
    if experts:
        if experts == list(range(len(experts))):
            args += ["--n-cpu-moe", str(len(experts))]  # the experts of the first N layers on the CPU
        else:
            args += ["-ot", f"'{_alternation(experts)}ffn_.*_exps\\.=CPU'"]
    if _layers(decode, STREAMED_CPU_ATTENTION):
        args += ["-nkvo"]
        cannot.append("decode attention on the CPU beside a host KV cache for some layers only: -nkvo keeps every "
                      "layer's KV in host memory and attends there")
    streamed = _layers(decode, STREAMED, STREAMED_CPU_ATTENTION, SPLIT_POINTS)
    if streamed:
        cannot.append(f"{len(streamed)} decode layers streamed to the GPU each step (their weights in host memory, "
                      "computed on the GPU): llama.cpp computes layers whose weights stay in host memory on the CPU")
    if _layers(decode, SPLIT_POINTS) or _layers(prefill, SPLIT_POINTS):
        cannot.append("split points inside a layer (Park & Egger): -ot places whole tensors, the split is "
                      "per operator and per phase")
    cannot += _prefill_note(prefill, decode, "llama.cpp",
                            "decode's; its op offload, on by default, copies CPU layers' weights to the GPU for "
                            "batches of 32+ tokens, the nearest it has to a streamed prefill")
    args += ["-np", str(plan.batch_size), "-c", str(plan.batch_size * (plan.input_len + plan.output_len))]
    if plan.cpu_dtype != plan.dtype:
        cannot.append(f"the CPU computing in {plan.cpu_dtype} on {plan.dtype} weights: llama.cpp computes in the "
                      "file's types")
    head = "" if gguf else f"# MODEL.gguf: {model_ref} as a GGUF file (llama.cpp reads GGUF only)\n"
    return Export("llama.cpp", head + " ".join(args), cannot)


def _layer_bytes(spec: ModelSpec, layers: list[int], dtype: str) -> float:
    return float(sum(spec.layer_params(i) for i in layers) * DTYPE_BYTES[dtype])


def _expert_bytes(spec: ModelSpec, layers: list[int], dtype: str) -> float:
    return float(sum(spec.num_experts * spec.expert_params for i in layers if spec.moe_layers[i]) * DTYPE_BYTES[dtype])


def _gib(x: float) -> str:
    return f"{math.ceil(x / GiB * 10) / 10:g}"


def _vllm(plan: Plan, spec: ModelSpec, prefill, decode, model_ref: str) -> Export:
    cannot = []
    streamed = _layers(decode, STREAMED, STREAMED_CPU_ATTENTION, SPLIT_POINTS)
    on_cpu = _layers(decode, CPU)
    experts = _layers(decode, CPU_EXPERTS)
    offload = _layer_bytes(spec, streamed + on_cpu, plan.dtype) + _expert_bytes(spec, experts, plan.dtype)
    args = ["vllm", "serve", model_ref, "--dtype", plan.dtype, "--max-model-len", str(plan.input_len + plan.output_len),
            "--max-num-seqs", str(plan.batch_size)]
    if offload:
        args += ["--cpu-offload-gb", _gib(offload)]  # weights in host memory, streamed to the GPU each forward
    if on_cpu:
        cannot.append(f"{len(on_cpu)} layers computed on the CPU: vLLM computes every layer on the GPU; counted in "
                      "--cpu-offload-gb (streamed each step instead)")
    if experts:
        cannot.append(f"routed experts of {len(experts)} layers computed on the CPU: offloaded and streamed instead")
    host_kv = _layers(decode, STREAMED_CPU_ATTENTION, SPLIT_POINTS, CPU)
    if host_kv:
        kv = float(kv_cache_bytes_per_layer(spec, plan.batch_size, plan.input_len + plan.output_len,
                                            DTYPE_BYTES[plan.dtype])) * len(host_kv)
        args += ["--kv-offloading-size", _gib(kv)]
        cannot.append("decode attention on the CPU beside the host KV cache: vLLM's KV offloading keeps a host copy "
                      "and attends on the GPU")
    if _layers(decode, SPLIT_POINTS) or _layers(prefill, SPLIT_POINTS):
        cannot.append("split points inside a layer (Park & Egger)")
    cannot += _prefill_note(prefill, decode, "vLLM", "decode's")
    return Export("vLLM", " ".join(args), cannot)


def module_names(model_ref: str, num_layers: int) -> tuple[dict[str, str], list[str], str]:
    """({"embed", "norm", "head"} -> module name, decoder layer names, how they were found), asked of
    transformers' model built on the meta device from the model's config (no weights read); the
    usual ``model.layers.N`` names where transformers cannot build it."""
    fallback = ({"embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"},
                [f"model.layers.{i}" for i in range(num_layers)], "transformers' usual names (the model could not "
                                                                       "be built to read its own)")
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = config_dict(model_ref)
        if cfg is None:
            return fallback
        config = AutoConfig.for_model(**cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - any failure to build falls back to the usual names, said in the output
        return fallback
    names = {id(m): name for name, m in model.named_modules()}
    decoder = model.get_decoder()
    layers = [names[id(m)] for m in getattr(decoder, "layers", [])]
    if len(layers) != num_layers:
        return fallback
    norm = next((names[id(m)] for k, m in decoder.named_children() if "norm" in k), fallback[0]["norm"])
    out = {"embed": names.get(id(model.get_input_embeddings()), fallback[0]["embed"]), "norm": norm,
           "head": names.get(id(model.get_output_embeddings()), fallback[0]["head"])}
    return out, layers, "read from transformers' model of this config"


def _accelerate(plan: Plan, spec: ModelSpec, prefill, decode, model_ref: str) -> Export:
    parts, layers, how = module_names(model_ref, spec.num_layers)
    cannot = []
    entries = [(parts["embed"], '"cpu"')]
    for i, m in enumerate(decode.modes):
        if m == RESIDENT:
            entries.append((layers[i], "0"))
        elif m == CPU_EXPERTS:
            entries.append((layers[i], "0"))
            if spec.moe_layers[i]:
                entries.append((f"{layers[i]}.mlp.experts", '"cpu"'))
        else:
            entries.append((layers[i], '"cpu"'))
    head_gpu = _head_on_accelerator(decode)
    entries += [(parts["norm"], "0" if head_gpu else '"cpu"'), (parts["head"], "0" if head_gpu else '"cpu"')]
    body = "\n".join(f'    "{k}": {v},' for k, v in entries)
    budget = f'max_memory = {{0: "{_gib(plan.gpu_memory_bytes)}GiB", "cpu": "{_gib(plan.cpu_memory_bytes)}GiB"}}'
    # transformers reads a GGUF file from its folder with gguf_file= (it dequantises the blocks)
    gguf = Path(model_ref) if str(model_ref).endswith(".gguf") else None
    source = f'"{gguf.parent}", gguf_file="{gguf.name}"' if gguf is not None else f'"{model_ref}"'
    code = (f"# module names: {how}\n{budget}\ndevice_map = {{\n{body}\n}}\n"
            f'model = AutoModelForCausalLM.from_pretrained({source}, device_map=device_map, '
            f'max_memory=max_memory, dtype="{plan.dtype}")')
    on_cpu = _layers(decode, CPU)
    if on_cpu:
        cannot.append(f"{len(on_cpu)} layers computed on the CPU: accelerate runs \"cpu\" modules on the GPU, "
                      "copying their weights in at each forward (streamed)")
    if _layers(decode, CPU_EXPERTS):
        cannot.append("routed experts computed on the CPU: their module is offloaded and streamed to the GPU instead")
    if _layers(decode, STREAMED_CPU_ATTENTION, SPLIT_POINTS):
        cannot.append("attention on the CPU beside a host KV cache, split points: accelerate places whole modules "
                      "and keeps the KV cache on the GPU")
    cannot.append("the embedding table in host memory with its lookup on the host: accelerate copies the whole "
                  f"table to the GPU at each forward; put {parts['embed']} on 0 where the GPU has room")
    cannot += _prefill_note(prefill, decode, "accelerate", "decode's device_map")
    return Export("accelerate", code, cannot)
