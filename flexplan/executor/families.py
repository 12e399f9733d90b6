"""Which modules of a HuggingFace causal LM are the embedding, the decoder layers and the head.

The executor places three kinds of unit: the embedding (looked up on the host), each decoder
layer, and the head (final norm, OPT's ``project_out``, the LM head) that sits with the last
layer. Adding a family is one entry in ``_FAMILIES``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from flexplan.errors import UnsupportedModelError

# model_type -> (path of the decoder stack, embedding module names, head module names), relative to
# the stack; the LM head is always ``lm_head`` on the top-level model.
_FAMILIES = {
    "llama": ("model", ("embed_tokens",), ("norm",)),
    "mistral": ("model", ("embed_tokens",), ("norm",)),
    "qwen2": ("model", ("embed_tokens",), ("norm",)),
    "opt": ("model.decoder", ("embed_tokens", "embed_positions", "project_in"), ("final_layer_norm", "project_out")),
}
SUPPORTED_FAMILIES = tuple(_FAMILIES)


@dataclass
class DecoderParts:
    family: str
    stack: nn.Module  # LlamaModel / OPTDecoder: owns embed, layers, final norm
    stack_prefix: str  # its qualified name in the top-level model ("model", "model.decoder")
    layers: nn.ModuleList
    embedding: dict[str, nn.Module]  # qualified name -> module (host)
    head: dict[str, nn.Module]  # qualified name -> module, in call order; lm_head last
    lm_head: nn.Linear


def model_type_of(config) -> str:
    return str(getattr(config, "model_type", None) or type(config).__name__)


def check_supported(config) -> str:
    mt = model_type_of(config)
    if mt not in _FAMILIES:
        raise UnsupportedModelError(
            f"the executor cannot run model_type {mt!r} layer by layer; supported families: "
            f"{', '.join(SUPPORTED_FAMILIES)} (SmolLM2 is llama). Plan it with flexplan.plan() only, or "
            "convert it to one of these architectures")
    return mt


def decoder_parts(model: nn.Module) -> DecoderParts:
    """The placement units of ``model`` (a ``*ForCausalLM``); UnsupportedModelError otherwise."""
    config = getattr(model, "config", None)
    family = check_supported(config)
    stack_path, embed_names, head_names = _FAMILIES[family]
    stack = model
    for attr in stack_path.split("."):
        stack = getattr(stack, attr, None)
        if stack is None:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no {stack_path!r} decoder stack; pass a *ForCausalLM model "
                f"(e.g. AutoModelForCausalLM) of a supported family: {', '.join(SUPPORTED_FAMILIES)}")
    lm_head = getattr(model, "lm_head", None)
    layers = getattr(stack, "layers", None)
    if lm_head is None or not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a causal LM with an lm_head and a list of decoder layers; "
            f"load it with AutoModelForCausalLM (supported families: {', '.join(SUPPORTED_FAMILIES)})")
    embedding = {f"{stack_path}.{n}": getattr(stack, n) for n in embed_names if getattr(stack, n, None) is not None}
    head = {f"{stack_path}.{n}": getattr(stack, n) for n in head_names if getattr(stack, n, None) is not None}
    head["lm_head"] = lm_head
    return DecoderParts(family, stack, stack_path, layers, embedding, head, lm_head)
