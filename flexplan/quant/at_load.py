"""Group-wise int8 / int4 weights made at load from a float checkpoint (issue 40): a model folder's
decoder and head linears quantised tensor by tensor as its shards are read, into the block formats
the kernels run, so host memory peaks at the quantised model plus one float tensor.

- ``int4``: Q4_1 blocks, groups of 32 consecutive weights of a row, asymmetric (a float16 scale and
  a float16 minimum each: FlexGen's group-wise int4 at the smallest group it allows, 32);
- ``int8``: Q8_0 blocks, groups of 32, symmetric (a float16 scale each).

Quantised as llama.cpp's reference does (the ``gguf`` package's quantizer). A MoE layer's routed
experts (transformers' fused gate_up / down) become a
:class:`~flexplan.quant.quant_experts.QuantExperts` on blocks of the same format, one matrix per
expert; embeddings, norms and routers stay float32, as a GGUF file's are once loaded
(workload.weight_formats).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import gguf
import torch
from torch import nn

from flexplan.errors import InvalidInputError
from flexplan.executor.loading import SafetensorsSource, build_skeleton, read_config
from flexplan.quant import quant_experts
from flexplan.quant.formats import BY_NAME, BlockFormat
from flexplan.quant.gguf_weights import QuantTensor
from flexplan.quant.quant_experts import QuantExperts
from flexplan.quant.quant_linear import QuantLinear
from flexplan.workload.weight_formats import AT_LOAD

AT_LOAD_FORMATS: dict[str, BlockFormat] = {k: BY_NAME[v] for k, v in AT_LOAD.items()}
_DECODER_LINEAR = re.compile(r"(^|\.)layers\.\d+\.")


def quantize(name: str, weight: torch.Tensor, fmt: BlockFormat) -> QuantTensor:
    """``weight`` [out, in] as ``fmt``'s blocks (rows of in / 32 blocks)."""
    if weight.shape[-1] % fmt.block_weights:
        raise InvalidInputError(f"{name}: {weight.shape[-1]} inputs is not a multiple of {fmt.name}'s "
                                f"{fmt.block_weights}-weight groups; load this model without weights=")
    blocks = gguf.quants.quantize(weight.detach().float().contiguous().numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
    return QuantTensor(name, torch.from_numpy(blocks), tuple(weight.shape), fmt)


def quantised_linear_names(model: nn.Module, config) -> list[str]:
    """The linears made blocks: every ``nn.Linear`` of a decoder layer but a MoE router (its few
    outputs choose experts: kept exact), and the LM head."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        router = experts and module.out_features == experts
        if (_DECODER_LINEAR.search(name) and not router) or name == "lm_head":
            out.append(name)
    return out


def _quantized_experts(name: str, module: nn.Module, source, fmt: BlockFormat) -> QuantExperts:
    """transformers' fused experts ``module`` read from ``source`` as QuantExperts on ``fmt`` blocks:
    each [experts, out, in] as the module computes it (a transposed module's [experts, in, out]
    turned), its rows in the module's order (what its gate reads)."""
    transposed = bool(getattr(module, "is_transposed", False))

    def read(leaf: str) -> torch.Tensor | None:
        if module._parameters.get(leaf) is None:
            return None
        value = source(f"{name}.{leaf}").float()
        return value.transpose(1, 2) if transposed and not leaf.endswith("_bias") else value

    gate_up, down = read("gate_up_proj"), read("down_proj")
    blocks = {leaf: quantize(f"{name}.{leaf}", w, fmt).data for leaf, w in (("gate_up_proj", gate_up), ("down_proj", down))}
    return QuantExperts(module, (blocks["gate_up_proj"], fmt), (blocks["down_proj"], fmt), hidden=down.shape[1],
                        intermediate=down.shape[2], gate_up_bias=read("gate_up_proj_bias"),
                        down_bias=read("down_proj_bias"))


def load_quantized_folder(folder: str | Path, weights: str, log=None) -> nn.Module:
    """The transformers model of ``folder`` (config.json + *.safetensors) with its decoder and head
    linears as ``QuantLinear`` on ``weights`` ("int4" / "int8") blocks, everything else float32."""
    if weights not in AT_LOAD_FORMATS:
        raise InvalidInputError(f"weights={weights!r}: a model folder is quantised at load to "
                                f"{' or '.join(map(repr, AT_LOAD_FORMATS))}")
    fmt, log = AT_LOAD_FORMATS[weights], log or (lambda line: print(line, file=sys.stderr))
    config = read_config(folder)
    model = build_skeleton(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    source = SafetensorsSource(folder, {"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    if not source.holds_all(names):
        raise InvalidInputError(f"{folder}: its tensors are not the model's as transformers builds it (a checkpoint "
                                "transformers converts on load, e.g. per-expert MoE tensors); weights='int4'/'int8' "
                                "read the shards tensor by tensor: load this model without weights=")
    linears = set(quantised_linear_names(model, config))
    experts = [n for n, m in model.named_modules() if quant_experts.replaceable(m)]
    try:
        for mod_name, module in list(model.named_modules()):
            if mod_name in experts:
                model.set_submodule(mod_name, _quantized_experts(mod_name, module, source, fmt))
                continue
            if mod_name in linears:
                weight = source(f"{mod_name}.weight")
                qt = quantize(f"{mod_name}.weight", weight, fmt)
                bias = source(f"{mod_name}.bias").float().clone() if module.bias is not None else None
                model.set_submodule(mod_name, QuantLinear(qt, bias))
                continue
            for pname, _ in list(module.named_parameters(recurse=False)):
                value = source(f"{mod_name}.{pname}" if mod_name else pname)
                module._parameters[pname] = nn.Parameter(value.float().clone(), requires_grad=False)
    finally:
        source.close()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise InvalidInputError(f"{folder}: no tensor read for {', '.join(left[:5])}")
    model.config.tie_word_embeddings = False  # the head holds its own blocks
    also = f" and the routed experts of {len(experts)} layers" if experts else ""
    log(f"flexplan: {len(linears)} linear weights{also} of {Path(folder).name} quantised at load to {weights} "
        f"({fmt.name} blocks: {fmt.block_weights} weights a group)")
    return model
