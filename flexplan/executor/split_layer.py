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
  the accelerator, the output comes back. With the core on the CPU it reads the host cache in place
  (the runner's: flexplan's native decode attention where it covers the layer, as ``cpu-attention``).

A Linear operator the plan leaves on the CPU computes as the plan's CPU does (its ``cpu_dtype``), on
its dense pinned weight (the layout its accelerator copy needs, kept as the one host copy):
:func:`cpu_operator_linear`, the native dense kernel (``native_gemv.c``): 4 weight rows per pass for
decode-sized batches, 64-row panels packed chunk by chunk into the blocked layout above 32 rows.
Stock ``F.linear`` on the same dense weights streams a few decode rows at a fraction of this
kernel's rate and computes prefill rows at about half of it; the kernel comes within ~15-25% of the
blocked one (``benchmarks/bench_cpu_linear.py`` compares them).
The estimator prices these operators at the dense kernel's own calibrated rates (``flexplan validate --split-ops``).

Only the accelerator operators' weights are prefetched into the slot (:func:`load`). The operators
are found from transformers' module structure, not per family: the Linear children of ``self_attn``
in order, the last being the output projection with the attention core before it, then the Linear
children of ``mlp`` (an MoE ``mlp`` as one operator; a layer without ``mlp``: its own Linear children,
as OPT's ``fc1``, ``fc2``). A layer whose structure does not give the
plan's operators (a fused qkv projection, no ``self_attn``/``mlp``) cannot be cut:
:func:`operator_modules` returns None and the executor streams that layer whole.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from flexplan.executor import cpu_linear, native
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


def dense_kernel(compute_dtype: torch.dtype, weight: torch.Tensor):
    """The native library whose dense kernel computes ``weight`` for :func:`cpu_operator_linear`
    (float32 computation, a weight type it reads, contiguous, ``in`` a multiple of its vector
    width), else None (``F.linear``)."""
    gemv = native.status()[0] if compute_dtype == torch.float32 else None
    if (gemv is not None and weight.dtype in native.WEIGHT_TYPES and weight.is_contiguous()
            and weight.shape[-1] % gemv.vector_width == 0):
        return gemv
    return None


def cpu_operator_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               compute_dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a split layer's operator on the CPU, computed in
    ``compute_dtype`` (the plan's CPU dtype) on a dense weight of any 16/32-bit dtype, the result in
    ``x``'s dtype: the native dense kernel for float32 computation (16-bit weights widened as read;
    its row kernel for decode-sized batches, packed 64-row panels for prefill), else ``F.linear`` in
    ``compute_dtype``."""
    k, out = x.shape[-1], weight.shape[0]
    rows = x.numel() // max(k, 1)
    gemv = dense_kernel(compute_dtype, weight)
    if gemv is not None:
        y = gemv.dense_gemv(weight, x.reshape(rows, k).to(torch.float32).contiguous(),
                            None if bias is None else bias.to(torch.float32).contiguous())
        return y.reshape(*x.shape[:-1], out).to(x.dtype)
    cast = lambda t: t if t is None or t.dtype == compute_dtype else t.to(compute_dtype)  # noqa: E731
    return F.linear(cast(x), cast(weight), cast(bias)).to(x.dtype)


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

    def __init__(self, link: Link, cpu_dtype: torch.dtype = torch.float32):
        self.link = link
        # called once the accelerator operators of the layer running split are done (their last
        # output is back on the host): the runner issues the next layer's weight copy then
        self.segment_done: Callable[[], None] | None = None
        self.cpu_dtype = cpu_dtype  # what the CPU operators compute in (the plan's CPU dtype)
        self.layers: dict[int, LayerOps] = {}
        self._hooks: list = []
        self._forwards: list = []  # (Linear, the instance forward it had before install)

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
                if type(m) is nn.Linear:
                    self._forwards.append((m, m.__dict__.get("forward")))  # the executor's (cpu_linear.install)
                    m.forward = functools.partial(self._linear_forward, ops, k, m)
        return True

    def uninstall(self) -> None:
        for h in self._hooks:
            h.remove()
        for m, forward in reversed(self._forwards):
            if forward is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = forward
        self._hooks, self._forwards, self.layers = [], [], {}

    def _linear_forward(self, ops: LayerOps, k: int, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """Operator k of a cut layer: on the CPU (running split, k not the accelerator's) by
        :func:`cpu_operator_linear`; anywhere else by the executor's CPU kernels' dispatch on the weight's layout
        (a layer the other phase runs on the CPU holds packed weights there)."""
        if ops.on_acc is not None and k not in ops.on_acc and x.device.type == "cpu":
            return cpu_operator_linear(x, module.weight, module.bias, self.cpu_dtype)
        return cpu_linear.linear(x, module.weight, module.bias)

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
        for name, _, off, nbytes, _ in st.layout.entries:
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
        out = link.move(out, False, None, "activation", i)
        self._maybe_done(self.layers[i], self.layers[i].modules.index(None))
        return out, weights

    def _maybe_done(self, ops: LayerOps, k: int) -> None:
        """After operator k's output came back: the segment is done when k is its last operator."""
        if self.segment_done is not None and ops.on_acc and k == max(ops.on_acc):
            self.segment_done()

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
            out = _moved(self.link, output, False, "activation", ops.index)
            self._maybe_done(ops, k)
            return out
        return hook
