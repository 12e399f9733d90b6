"""Decode attention on the CPU beside a host KV cache, for layers that otherwise compute on the
accelerator (the ``cpu-attention`` policies; FlexGen's ``cpu_cache_compute``, NEO section 3).

transformers' attention modules compute q/k/v, append k/v to the cache (``update``) and then call
the attention function that ``config._attn_implementation`` names in its ``AttentionInterface``.
That call is where the attention moves to the CPU: each attention module of a decoder layer gets
its own shallow copy of the config naming :data:`NAME`, a function registered once in the
``AttentionInterface`` that calls the executor's handler (set per module by :func:`install`) and,
where the handler is off (prefill, a phase that keeps the attention on the accelerator), the
implementation the model was loaded with, unchanged. The mask creation, the other layers and the
class are untouched; :func:`uninstall` restores each module's config.

A layer whose attention does not go through the ``AttentionInterface`` (a model-specific attention
forward) cannot be split this way: :func:`install` says which.
"""

from __future__ import annotations

import copy
import inspect
import sys

from torch import nn

from flexplan.errors import UnsupportedModelError

NAME = "flexplan_cpu_attention"
HANDLER = "_flexplan_cpu_attention"  # module attribute: (handler, whether it attends now, layer index)
INNER = "_flexplan_inner_attention"  # config attribute: the implementation the model was loaded with
_registered = False


def _interface():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    return ALL_ATTENTION_FUNCTIONS, AttentionInterface


def inner_function(module: nn.Module):
    """The attention function the module would call without flexplan: its implementation in the
    ``AttentionInterface``, or its modeling file's own ``eager_attention_forward``."""
    functions, _ = _interface()
    name = getattr(module.config, INNER, "eager")
    eager = sys.modules[type(module).__module__].__dict__.get("eager_attention_forward")
    if name == "eager" or name is None:
        return eager
    return functions.get_interface(name, eager)


def _dispatch(module: nn.Module, query, key, value, attention_mask, **kwargs):
    handler = getattr(module, HANDLER, None)
    inner = inner_function(module)
    if handler is None:
        return inner(module, query, key, value, attention_mask, **kwargs)
    fn, _, layer = handler
    return fn(layer, module, inner, query, key, value, attention_mask, **kwargs)


def routed_now(module: nn.Module) -> bool:
    """Whether this attention module's call goes to the CPU beside its KV cache in the step now
    running (other fused forwards of the module stand aside then)."""
    handler = module.__dict__.get(HANDLER)
    return handler is not None and handler[1](handler[2])


def _register() -> None:
    global _registered
    if not _registered:
        _interface()[1].register(NAME, _dispatch)
        _registered = True


def _calls_interface(module: nn.Module) -> bool:
    f = inspect.unwrap(type(module).forward)
    return "ALL_ATTENTION_FUNCTIONS" in getattr(getattr(f, "__code__", None), "co_names", ())


def attention_modules(layer: nn.Module) -> list[nn.Module]:
    """The modules of a decoder layer that call transformers' attention interface."""
    return [m for m in layer.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")
            and _calls_interface(m)]


def install(layers: dict[int, nn.Module], handler, active) -> list[nn.Module]:
    """Route the attention calls of ``layers`` (index -> decoder layer) through ``handler(layer,
    module, inner, query, key, value, attention_mask, **kwargs)``; ``active(layer)`` says whether
    the step now running attends on the CPU for that layer. The modules changed."""
    _register()
    changed = []
    for i, layer in layers.items():
        mods = attention_modules(layer)
        if not mods:
            raise UnsupportedModelError(
                f"decoder layer {i} ({type(layer).__name__}) computes its attention in its own forward, not through "
                "transformers' AttentionInterface, so flexplan cannot run it on the CPU beside the KV cache; "
                "use gpu-offload (or another policy) for this model")
        for m in mods:
            if HANDLER not in m.__dict__:
                config = copy.copy(m.config)
                inner = m.config._attn_implementation
                setattr(config, INNER, inner)
                config._attn_implementation_internal = NAME  # this copy only (the setter recurses into shared sub-configs)
                m.__dict__["_flexplan_config"] = m.config
                m.config = config
            m.__dict__[HANDLER] = (handler, active, i)
            changed.append(m)
    return changed


def uninstall(modules: list[nn.Module]) -> None:
    for m in modules:
        m.__dict__.pop(HANDLER, None)
        original = m.__dict__.pop("_flexplan_config", None)
        if original is not None:
            m.config = original
