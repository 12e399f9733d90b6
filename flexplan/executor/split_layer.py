"""A streamed decoder layer cut by split points (the ``split-points`` policies; Park & Egger 3.1-4.2).

The layer runs its own transformers forward with its hidden state on the host, its weights bound to
their pinned home and its KV cache at home in host memory: the CPU computes every operator there
(glue included: norms, residual adds, rotary, activation). The operators the plan's
:class:`~flexplan.plan_types.SplitPoints` give the accelerator, O[i, j), compute there instead:

- a Linear child of ``self_attn`` or ``mlp`` (or an MoE ``mlp`` whole): forward hooks move its input to
  the accelerator (once for consecutive operators that read the same tensor: k_proj, v_proj after
  q_proj), bind its parameters to the weight slot its prefetch filled, and move its output back;
- the attention core (transformers' ``AttentionInterface`` call, routed here by ``cpu_attention``):
  q, the keys and values the cache's ``update`` returned (the KV cache crosses) and the mask move to
  the accelerator, the output comes back. With the core on the CPU it reads the host cache in place.

Only the accelerator operators' weights are prefetched into the slot (:func:`load`). The operators
are found from transformers' module structure, not per family: the Linear children of ``self_attn``
in order, the last being the output projection with the attention core before it, then the Linear
children of ``mlp`` (an MoE ``mlp`` as one operator; a layer without ``mlp``: its own Linear children,
as OPT's ``fc1``, ``fc2``). A layer whose structure does not give the
plan's operators (a fused qkv projection, no ``self_attn``/``mlp``) cannot be cut:
:func:`operator_modules` returns None and the executor streams that layer whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from flexplan.executor.link import H2D, Link

ATTENTION = "attention"  # the operator that is transformers' attention call, not a module


def operator_modules(layer: nn.Module, operators: tuple[str, ...]) -> list[nn.Module | None] | None:
    """The modules of ``layer`` that are ``operators`` (None for the attention core), or None when
    its structure does not give exactly that sequence."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", layer)  # no mlp: OPT's fc1, fc2 in the layer
    if not isinstance(attn, nn.Module) or ATTENTION not in operators:
        return None
    linears = [c for c in attn.children() if isinstance(c, nn.Linear)]
    if len(linears) < 2 or operators.index(ATTENTION) != len(linears) - 1:
        return None
    ops: list[nn.Module | None] = [*linears[:-1], None, linears[-1]]
    if operators[-1] == "mlp":
        if mlp is layer:
            return None
        ops.append(mlp)
    else:
        ops += [c for c in mlp.children() if isinstance(c, nn.Linear)]
    return ops if len(ops) == len(operators) else None


def _moved(link: Link, x, to_acc: bool, kind: str, layer: int):
    if isinstance(x, torch.Tensor):
        return link.move(x, to_acc, None, kind, layer)
    if isinstance(x, (tuple, list)):
        return type(x)(_moved(link, t, to_acc, kind, layer) for t in x)
    return x


@dataclass
class LayerOps:
    """One cuttable layer: its operator modules, the parameter names of each, and the accelerator
    operators of the step now running (None: the layer is not running split)."""

    index: int
    modules: list[nn.Module | None]
    names: list[frozenset[str]]  # parameter names (the layer group's) of each operator
    on_acc: frozenset[int] | None = None
    inputs: dict = field(default_factory=dict)  # id(host input) -> (host input, its accelerator copy)


class SplitLayers:
    """The cuttable layers of a model under a plan: hooks on their operator modules, and the
    per-step binding of each operator's weights to where it computes."""

    def __init__(self, link: Link):
        self.link = link
        self.layers: dict[int, LayerOps] = {}
        self._hooks: list = []

    def install(self, i: int, layer: nn.Module, params: dict[str, tuple[nn.Module, str]],
                operators: tuple[str, ...]) -> bool:
        """Hook layer ``i``'s operators (``params``: its group's parameters by name); False when its
        structure does not give ``operators``."""
        mods = operator_modules(layer, operators)
        if mods is None:
            return False
        attn = layer.self_attn
        names = []
        for m in mods:
            owners = set(m.modules()) if m is not None else {attn}
            if m is None:  # the core: the attention module's own parameters (gpt-oss's sinks)
                names.append(frozenset(n for n, (mod, leaf) in params.items() if mod is attn))
            else:
                names.append(frozenset(n for n, (mod, leaf) in params.items() if mod in owners))
        ops = LayerOps(i, mods, names)
        self.layers[i] = ops
        for k, m in enumerate(mods):
            if m is not None:
                self._hooks.append(m.register_forward_pre_hook(self._pre(ops, k), with_kwargs=True))
                self._hooks.append(m.register_forward_hook(self._post(ops, k)))
        return True

    def uninstall(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self.layers = [], {}

    def accelerator_names(self, i: int, points: tuple[int, int]) -> frozenset[str]:
        """The parameters of layer i's accelerator operators O[i, j)."""
        lo, hi = points
        return frozenset().union(*self.layers[i].names[lo:hi])

    def begin(self, i: int, points: tuple[int, int], group, pinned_views: dict, slot_views: dict, tag) -> None:
        """Before layer i runs split at ``points``: the CPU operators' weights at their pinned home, the
        accelerator operators' in the slot their prefetch filled."""
        ops = self.layers[i]
        gpu = self.accelerator_names(i, points)
        group.bind_views({n: (slot_views[n] if n in gpu else v) for n, v in pinned_views.items()}, tag=tag)
        ops.on_acc = frozenset(range(points[0], points[1]))
        ops.inputs = {}

    def end(self, i: int) -> None:
        ops = self.layers.get(i)
        if ops is not None:
            ops.on_acc, ops.inputs = None, {}

    def attention_on_acc(self, i: int) -> bool | None:
        """Whether layer i's attention core computes on the accelerator now (None: not running split)."""
        ops = self.layers.get(i)
        if ops is None or ops.on_acc is None:
            return None
        return ops.modules.index(None) in ops.on_acc

    def load(self, slot_buffer: torch.Tensor, group, i: int, points: tuple[int, int]) -> None:
        """Copy only the accelerator operators' weights of layer i from its pinned home into the slot
        (caller on the copy stream), adjacent tensors in one copy."""
        gpu = self.accelerator_names(i, points)
        st = group.storages["pinned"]
        ranges: list[list[int]] = []
        for name, _, off, nbytes in st.layout.entries:
            if name not in gpu:
                continue
            if ranges and ranges[-1][1] >= off - 64:  # alignment padding between neighbours
                ranges[-1][1] = off + nbytes
            else:
                ranges.append([off, off + nbytes])
        for lo, hi in ranges:
            self.link.copy(slot_buffer[lo:hi], st.buffer.tensor[lo:hi], H2D, "weights", i)

    def attend(self, i: int, module, inner, query, key, value, attention_mask, moved: dict, **kwargs):
        """Layer i's attention call: on the host as is, or on the accelerator with q, the KV the cache
        returned and the mask moved there (the mask once per step: ``moved``) and the output back."""
        if not self.attention_on_acc(i):
            return inner(module, query, key, value, attention_mask, **kwargs)
        link = self.link
        q = link.move(query, True, None, "activation", i)
        k, v = (link.move(t, True, None, "kv", i) for t in (key, value))
        mask = attention_mask
        if isinstance(mask, torch.Tensor):
            key_ = ("split mask", id(mask))
            if key_ not in moved:
                moved[key_] = (mask, link.move(mask, True, None, "aux"))
            mask = moved[key_][1]
        out, weights = inner(module, q, k, v, mask, **kwargs)
        return link.move(out, False, None, "activation", i), weights

    def _pre(self, ops: LayerOps, k: int):
        def hook(module, args, kwargs):
            if ops.on_acc is None or k not in ops.on_acc:
                return None
            if args:
                x, rest = args[0], args[1:]
            else:
                x, rest = kwargs.pop("hidden_states"), ()
            hit = ops.inputs.get(id(x))
            if hit is None or hit[0] is not x:
                hit = ops.inputs[id(x)] = (x, self.link.move(x, True, None, "activation", ops.index))
            if not args:
                kwargs["hidden_states"] = hit[1]
                return rest, kwargs
            return (hit[1],) + tuple(rest), kwargs
        return hook

    def _post(self, ops: LayerOps, k: int):
        def hook(module, args, output):
            if ops.on_acc is None or k not in ops.on_acc:
                return None
            return _moved(self.link, output, False, "activation", ops.index)
        return hook
