"""Which modules of a transformers causal LM are the embedding, the decoder layers and the head.

The executor places three kinds of unit: the embedding (looked up on the host), each decoder
layer, and the head (final norm(s), OPT's ``project_out``, the LM head) that sits with the last
layer. They are found through transformers' own accessors, for any decoder-only causal LM:
``get_decoder()`` (the stack), ``get_input_embeddings()``, ``get_output_embeddings()`` (the LM
head) and the stack's ``ModuleList`` of decoder layers (``layers``, ``h``, ``blocks``, BERT's
``encoder.layer``; where ``get_decoder()`` answers no such stack, the shallowest module holding
one). The stack's other children are classified generically: those that run before the layers (position
embeddings, input projections, embedding norms) are "embedding", those after (final norms,
output projections) are "head"; modules without parameters (rotary embeddings hold buffers only)
belong to neither. Names decide where they are unambiguous, registration order otherwise.
Parameters outside the stack besides the LM head (BERT's prediction transform) join the head.

A model that cannot run layer by layer is refused here, before any allocation, with one line
that says what it is and why: an encoder-decoder, a model whose layers keep recurrent or
linear-attention state instead of a per-layer KV cache (``layer_types``; a small table for
recurrent families whose config does not say), one whose decoder takes no KV cache at all, or
one without a decoder stack and a list of layers.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from flexplan.errors import UnsupportedModelError

# The keyword a model, its layers and generate() take the KV cache by: transformers 5.24 renamed
# ``past_key_values`` to ``cache`` (the old name deprecated until 5.40, and the models' outputs
# renamed the field). flexplan passes the name of the installed release and reads either.
CACHE_KWARGS = ("cache", "past_key_values")
CACHE_KWARG = next(k for k in CACHE_KWARGS if k in BaseModelOutputWithPast.__dataclass_fields__)


def cache_in(kwargs: dict):
    """The KV cache a call's keyword arguments hold under either name, or None."""
    return next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)

# layer types (transformers' ``config.layer_types``, cache_utils) whose cache is per-layer keys and values
KV_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
WINDOWED_LAYER_TYPES = ("sliding_attention", "chunked_attention")  # their cache kwargs carry sliding_window
# recurrent families whose config has no ``layer_types`` to say so (the fallback table)
_RECURRENT = {"rwkv": "RWKV (recurrent time-mixing state)", "xlstm": "xLSTM (recurrent memory cells)",
              "lfm2": "LFM2 (short convolution layers with a conv state)",
              "lfm2_moe": "LFM2-MoE (short convolution layers with a conv state)"}
_LAYER_LIST_NAMES = ("layers", "h", "blocks", "layer", "block", "decoder_layers")
_EMBEDDING_NAME = re.compile(r"emb|wte|wpe|(^|_)in(_|$)|project_in")
_HEAD_NAME = re.compile(r"final|ln_f|norm_f|(^|_)out(_|$)|project_out|^norm$|^ln$")


@dataclass
class DecoderParts:
    family: str
    stack: nn.Module  # LlamaModel / OPTDecoder / FalconModel: owns embed, layers, final norm
    stack_prefix: str  # its qualified name in the top-level model ("model", "model.decoder", "transformer")
    layers: nn.ModuleList
    layers_prefix: str  # qualified name of the layer list ("model.layers", "transformer.h")
    embedding: dict[str, nn.Module]  # qualified name -> module (host)
    head: dict[str, nn.Module]  # qualified name -> module, in call order; lm_head last
    lm_head: nn.Module


def model_type_of(config) -> str:
    return str(getattr(config, "model_type", None) or type(config).__name__)


def text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def layer_types(config) -> list[str]:
    """transformers' type of each decoder layer (``full_attention``, ``sliding_attention``,
    ``linear_attention``...), as its DynamicCache would build them."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    return list(get_layer_types_and_kwargs(text_config(config))[0])


def layer_windows(config) -> list[int | None]:
    """Each decoder layer's attention window in tokens (sliding or chunked layers), None for full."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(text_config(config))
    if isinstance(kwargs, dict):  # older transformers 5 (5.17 seen): one dict for all layers
        return [kwargs.get("sliding_window") if t in WINDOWED_LAYER_TYPES else None for t in types]
    return [kw.get("sliding_window") for kw in kwargs]


def check_supported(config) -> str:
    """The model_type when ``config`` is a decoder-only causal LM whose layers each keep a KV
    cache; UnsupportedModelError (one line: what it is, why) otherwise."""
    if config is None or not hasattr(config, "to_dict"):
        raise UnsupportedModelError(
            "the executor needs a transformers causal LM (AutoModelForCausalLM) or a folder with its config.json")
    mt = model_type_of(config)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"model_type {mt!r} is an encoder-decoder model: the executor runs decoder-only causal LMs layer by layer")
    if mt in _RECURRENT:
        raise UnsupportedModelError(
            f"model_type {mt!r} is {_RECURRENT[mt]}: its layers keep recurrent state, not a per-layer KV cache, "
            "so the executor cannot run it layer by layer")
    try:
        types = layer_types(config)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot describe per layer
        raise UnsupportedModelError(f"model_type {mt!r}: cannot tell its decoder layers' cache types ({e})") from None
    odd = sorted({t for t in types if t not in KV_LAYER_TYPES})
    if odd:
        what = ("state-space / hybrid recurrent" if any("linear" in t or t == "conv" or t.startswith("hybrid") for t in odd)
                else "attention with state beside its KV cache")
        raise UnsupportedModelError(
            f"model_type {mt!r} has {', '.join(odd)} layers ({what}): they keep state other than a per-layer KV "
            "cache, so the executor cannot run it layer by layer")
    return mt


def _qualified(model: nn.Module, module: nn.Module) -> str | None:
    for name, m in model.named_modules():
        if m is module:
            return name
    return None


def _layer_list(stack: nn.Module, num_layers: int | None) -> tuple[str, nn.ModuleList] | None:
    """The decoder layers: the shallowest ModuleList under ``stack`` of ``num_layers`` modules
    (``layers``, ``h``, ``blocks``, or nested as BERT's ``encoder.layer``); its dotted path."""
    lists = [(n, m) for n, m in stack.named_modules() if n and isinstance(m, nn.ModuleList) and len(m)]
    if num_layers is not None:
        lists = [(n, m) for n, m in lists if len(m) == num_layers] or lists

    def rank(nm):
        leaf = nm[0].rsplit(".", 1)[-1]
        return nm[0].count("."), _LAYER_LIST_NAMES.index(leaf) if leaf in _LAYER_LIST_NAMES else 99

    return min(lists, key=rank) if lists else None


def _find_stack(model: nn.Module, num_layers: int | None) -> nn.Module | None:
    """``get_decoder()``, or (where it answers the model itself, as Llama 4's does) the
    shallowest submodule that holds the decoder layers directly."""
    get_decoder = getattr(model, "get_decoder", None)
    stack = get_decoder() if callable(get_decoder) else None
    if isinstance(stack, nn.Module) and stack is not model and _layer_list(stack, num_layers) is not None:
        return stack  # (ModernBERT-decoder's get_decoder() answers its LM head: not a stack)
    for name, m in model.named_modules():
        found = _layer_list(m, num_layers) if name else None
        if found is not None and "." not in found[0]:
            return m
    return None


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def decoder_parts(model: nn.Module) -> DecoderParts:
    """The placement units of ``model`` (a ``*ForCausalLM``); UnsupportedModelError otherwise."""
    config = getattr(model, "config", None)
    family = check_supported(config)
    name = type(model).__name__
    num_layers = getattr(text_config(config), "num_hidden_layers", None)
    stack = _find_stack(model, num_layers)
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if stack is None or lm_head is None or embed is None:
        raise UnsupportedModelError(
            f"{name} is not a causal LM with a decoder stack, input embeddings and an LM head; load it with "
            "AutoModelForCausalLM")
    stack_prefix = _qualified(model, stack)
    found = _layer_list(stack, num_layers)
    if stack_prefix is None or found is None:
        raise UnsupportedModelError(f"{name}: its decoder {type(stack).__name__} has no list of decoder layers")
    takes = inspect.signature(type(stack).forward).parameters
    if not any(k in takes for k in CACHE_KWARGS):
        raise UnsupportedModelError(
            f"model_type {family!r} keeps no KV cache (its {type(stack).__name__} takes no {CACHE_KWARG}): every "
            "step would recompute the whole sequence, so the executor does not run it")
    list_path, layers = found
    embedding: dict[str, nn.Module] = {}
    head: dict[str, nn.Module] = {}
    # the children of the stack and of each module between it and the layer list (BERT's encoder)
    path = list_path.split(".")
    parents = [(stack_prefix, stack)]
    for part in path[:-1]:
        parents.append((f"{parents[-1][0]}.{part}" if parents[-1][0] else part, getattr(parents[-1][1], part)))
    on_path = {id(m) for _, m in parents} | {id(layers)}
    for parent_prefix, parent in parents:
        before = True  # registration order: children registered before the layer list run before it
        for child_name, child in parent.named_children():
            if id(child) in on_path:
                before = False
                continue
            if not _has_params(child):
                continue
            q = f"{parent_prefix}.{child_name}" if parent_prefix else child_name
            if child is embed or _EMBEDDING_NAME.search(child_name):
                embedding[q] = child
            elif _HEAD_NAME.search(child_name) or not before:
                head[q] = child
            else:
                embedding[q] = child
    if not any(sub is embed for m in embedding.values() for sub in m.modules()):  # held outside the stack
        embedding[_qualified(model, embed)] = embed
    # parameters outside the stack besides the LM head (BERT's prediction transform): they run after
    # the stack, so they belong to the head
    claimed = {id(p) for m in (stack, *embedding.values(), lm_head) for p in m.parameters()}
    for q, m in model.named_modules():
        if any(id(p) not in claimed for p in m._parameters.values() if p is not None):
            head[q] = m
            claimed |= {id(p) for p in m.parameters()}
    head[_qualified(model, lm_head)] = lm_head
    layers_prefix = f"{stack_prefix}.{list_path}" if stack_prefix else list_path
    return DecoderParts(family, stack, stack_prefix, layers, layers_prefix, embedding, head, lm_head)
