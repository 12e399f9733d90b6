"""Routed experts computed on the CPU beside a layer that runs on the accelerator (the
``cpu-experts`` policy; llama.cpp's ``--n-cpu-moe``, KTransformers).

transformers 5 holds an MoE layer's routed experts as one module of fused 3-D parameters
(``gate_up_proj`` [E, 2I, H] or transposed, ``down_proj``, optional biases; ``experts`` in Mixtral,
Qwen-MoE, DeepSeek, gpt-oss) called with the router's output, ``experts(hidden, top_k_index,
top_k_weights)``. :func:`install` gives such a module an instance-level forward that, while its
layer's experts are placed on the CPU, sends the hidden states and the routing to the host,
runs :func:`routed_experts_forward` there on the host copy of the expert weights, and sends the
result back; otherwise it is transformers' own forward. Router, shared experts and attention stay
on the accelerator.

:func:`routed_experts_forward` groups the (token, choice) pairs by expert with one stable sort and
runs one GEMM (a GEMV at batch 1) per expert that some token picked, no pass over the experts no
token picked; the pairs of each expert in the order transformers' eager loop takes them, so the
result is the eager one bit for bit on the same weights. On blocked weights (the float32 CPU's
copy) the layer is four native calls and the activation's torch ops (``native_gemv.c``):
the routing grouped by expert with the rows gathered (``flexplan_route_experts``, a counting sort
in eager's order), the selected experts' GEMVs of each projection (``flexplan_grouped_gemv``),
and the weighted scatter (``flexplan_scatter_experts``, eager's roundings and order of sums).
Where the module gates as transformers' default does, SiLU(gate) * up (Mixtral, Qwen2/3-MoE,
DeepSeek; not gpt-oss's clamped SwiGLU), all of it is ONE native call with SiLU computed natively
(``native_decode.c``'s ``flexplan_moe_silu_f32``, as the dense decode layer computes it: within
1e-5 of eager, no longer bit for bit; ``fused=False`` keeps the torch activation). One call per
layer, not OpenMP regions and torch ops per expert: a decode step's experts are small GEMVs, beside
which the dispatch of a few calls per expert is a large share of the layer
(``benchmarks/bench_cpu_experts.py`` compares the paths). An experts
module of another interface
(Llama 4's, which runs every expert on every routed row) runs its own forward on the host.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from flexplan.executor import cpu_linear, native
from flexplan.executor.expert_cache import CachedExperts


def find_routed_experts(layer: nn.Module, num_experts: int) -> tuple[str, nn.Module] | None:
    """The submodule of a decoder layer holding its routed experts as parameters whose first
    dimension is ``num_experts``: 3-D as transformers stores them, or 4-D once the CPU holds them
    in the native blocked layout (:func:`blockable_experts`) (qualified name relative to the layer,
    module); None if none."""
    if not num_experts:
        return None
    for name, m in layer.named_modules():
        ps = [p for p in m._parameters.values() if p is not None]
        if name and ps and any(p.dim() in (3, 4) and p.shape[0] == num_experts for p in ps):
            return name, m
    return None


@functools.lru_cache(maxsize=None)
def _forward_signature(cls: type) -> inspect.Signature | None:
    """``cls.forward``'s signature (None if it has none), looked up once per class: a decode step
    asks for each experts module."""
    try:
        return inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return None


def routed_interface(module: nn.Module) -> bool:
    """Called as transformers' fused experts are, ``forward(hidden_states, top_k_index, top_k_weights)``,
    whatever it holds (float experts, or a GGUF file's blocks: quant.quant_experts)."""
    sig = _forward_signature(type(module))
    return sig is not None and len(sig.parameters) >= 4


def takes_routing(module: nn.Module) -> bool:
    """transformers' fused-experts interface: forward(hidden_states, top_k_index, top_k_weights)."""
    has_weights = isinstance(getattr(module, "down_proj", None), torch.Tensor) and (
        isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) or isinstance(getattr(module, "up_proj", None), torch.Tensor))
    sig = _forward_signature(type(module)) if has_weights else None
    return sig is not None and len(sig.parameters) >= 4


MATRICES = ("gate_up_proj", "up_proj", "down_proj")


def blockable_experts(module: nn.Module) -> dict[str, bool]:
    """Leaf name -> stored transposed, for the expert matrices of a module on transformers' routed
    interface whose output width is a multiple of the native block (cpu_linear.BLOCK): the CPU's
    float32 copy of them is held blocked, one [out/64, in, 64] matrix per expert."""
    if not takes_routing(module) or not native.available():
        return {}
    transposed = bool(getattr(module, "is_transposed", False))
    out = {}
    for name in MATRICES:
        p = module._parameters.get(name)
        if p is not None and p.dim() == 3 and p.shape[2 if transposed else 1] % cpu_linear.BLOCK == 0:
            out[name] = transposed
    return out


def block_experts_into(dense: torch.Tensor, transposed: bool, view: torch.Tensor) -> torch.Tensor:
    """Write the experts [E, out, in] (or [E, in, out] when ``transposed``) into ``view``'s bytes
    as [E, out/64, in, 64] (each expert's W as cpu_linear.block lays it out); the blocked view."""
    w = dense.transpose(1, 2) if transposed else dense
    e, o, i = w.shape
    blocked = view.reshape(-1).view(e, o // cpu_linear.BLOCK, i, cpu_linear.BLOCK)
    blocked.copy_(w.reshape(e, o // cpu_linear.BLOCK, cpu_linear.BLOCK, i).transpose(2, 3))
    return blocked


def unblock_experts(blocked: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The dense experts behind :func:`block_experts_into` (a new tensor, in the stored orientation)."""
    e, nb, i, bl = blocked.shape
    w = blocked.transpose(2, 3).reshape(e, nb * bl, i)
    return (w.transpose(1, 2) if transposed else w).contiguous()


def _project(module: nn.Module, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
    """One expert's projection ``name`` (with its bias if any) on the rows routed to it: the
    native blocked GEMV on a blocked CPU copy, else as transformers' eager loop computes it
    (``x @ W[e]`` for transposed weights, else F.linear)."""
    w = getattr(module, name)[e]
    b = getattr(module, f"{name}_bias", None)
    b = b[e] if isinstance(b, torch.Tensor) else None
    if w.dim() == 3:  # blocked: [out/64, in, 64]
        return cpu_linear.blocked_linear(x, w, b)
    if getattr(module, "is_transposed", False):
        y = x @ w
        return y + b if b is not None else y
    return F.linear(x, w, b)


def _grouped_kernel(module: nn.Module, x: torch.Tensor, first: str):
    """The native library when every projection of ``module`` (``first``, then down_proj) is held
    blocked (4-D) in a weight type the kernel reads, their biases float32 or absent, and ``x`` is
    float32: then one grouped call per projection computes all the selected experts; else None."""
    gemv = native.status()[0] if x.dtype == torch.float32 else None
    if gemv is None or not gemv.has_expert_calls:
        return None
    for name in (first, "down_proj"):
        w, b = getattr(module, name, None), getattr(module, f"{name}_bias", None)
        if not (isinstance(w, torch.Tensor) and w.dim() == 4 and w.dtype in native.WEIGHT_TYPES
                and w.is_contiguous()) or (isinstance(b, torch.Tensor) and b.dtype != torch.float32):
            return None
    return gemv


def _grouped_forward(module: nn.Module, gemv, x: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor, has_gate: bool) -> torch.Tensor:
    """All selected experts in a few native calls: the routing grouped by expert with the rows
    gathered (``route_experts``), the first and the down projection (``grouped_gemv``), the
    weighting and scatter (``scatter_experts``), and one pass of each activation op over all the
    rows, stacked expert after expert in eager's order; each expert's rows are what
    :func:`_project` gives them and the sums run over the pairs in the per-expert loop's order,
    so the result is the same bit for bit."""
    tokens = top_k_index.shape[0]
    pairs, experts, row_start, h = gemv.route_experts(top_k_index.to(torch.int64).contiguous(),
                                                      module.down_proj.shape[0], x.contiguous())

    def project(name, h):
        b = getattr(module, f"{name}_bias", None)
        return gemv.grouped_gemv(getattr(module, name), experts, row_start, h.contiguous(),
                                 b.contiguous() if isinstance(b, torch.Tensor) else None)

    h = module._apply_gate(project("gate_up_proj", h)) if has_gate else module.act_fn(project("up_proj", h))
    h = project("down_proj", h)
    post_norm = getattr(module, "has_post_expert_norm", False)
    if post_norm or top_k_weights.dtype not in native.WEIGHT_TYPES:
        if post_norm:
            h = module.post_expert_norm(h)
        h = h * top_k_weights.t().reshape(-1)[pairs, None]  # pairs index the [k, T] order
        return torch.zeros_like(x).index_add_(0, pairs % tokens, h.to(x.dtype))
    # a 16-bit routing weight widens exactly, as torch's type promotion widens it in h * w
    return gemv.scatter_experts(h.contiguous(), top_k_weights.float().contiguous(), pairs, tokens)


def default_silu_gate(module: nn.Module) -> bool:
    """Whether ``module`` gates as transformers' default does, SiLU(gate) * up over the halves of
    gate_up (``_default_apply_gate`` with a SiLU ``act_fn``), with no norm after the experts: what
    native_decode.c's fused call computes. A class with its own gate (gpt-oss's clamped SwiGLU)
    or another activation is not."""
    try:
        from transformers.activations import SiLUActivation
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # another transformers: its gate is not known here
        return False
    return (getattr(type(module), "_apply_gate", None) is _default_apply_gate
            and type(getattr(module, "act_fn", None)) in (SiLUActivation, nn.SiLU)
            and not getattr(module, "has_post_expert_norm", False))


def _fused_forward(module: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor | None:
    """The whole layer in one native call (NativeDecode.moe_silu), where it applies: the default
    SiLU gate, both projections blocked in one weight type, float32 biases (or none), a routing
    weight the kernel widens exactly; else None."""
    if not default_silu_gate(module) or top_k_weights.dtype not in native.WEIGHT_TYPES:
        return None
    ops = native.decode_status()[0]
    gu, dn = module.gate_up_proj, module.down_proj
    if ops is None or gu.dtype != dn.dtype:
        return None
    bias = [getattr(module, f"{name}_bias", None) for name in ("gate_up_proj", "down_proj")]
    bias = [b.contiguous() if isinstance(b, torch.Tensor) else None for b in bias]
    return ops.moe_silu(gu, dn, bias[0], bias[1], top_k_index.to(torch.int64).contiguous(),
                        top_k_weights.float().contiguous(), x.contiguous())


def expert_rows(top_k_index: torch.Tensor, num_experts: int):
    """(expert, its tokens, their choice positions) for every expert some token picked, experts
    ascending, each expert's (choice, token) pairs in [k, T] order: the order transformers' eager
    loop takes them (one stable sort); a sentinel id (expert parallelism, padding, an expert
    computed elsewhere) is skipped."""
    tokens = top_k_index.shape[0]
    flat = top_k_index.t().reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        pairs = order[start:start + n]
        start += n
        if 0 <= e < num_experts:
            yield e, pairs % tokens, torch.div(pairs, tokens, rounding_mode="floor")


def routed_experts_forward(module: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, grouped: bool = True, fused: bool = True) -> torch.Tensor:
    """The routed experts' output for tokens ``x`` [T, H] routed to ``top_k_index`` [T, k] with
    ``top_k_weights`` [T, k]: one GEMM per selected expert (see the module docstring); with blocked
    weights, all of them in one native call per projection (``grouped``; False: one call per expert
    and projection, as before, for comparison), and with the default SiLU gate the whole layer in
    one native call (``fused``; False: the activation in torch, eager's result bit for bit)."""
    num_experts = module.down_proj.shape[0]
    has_gate = getattr(module, "has_gate", True) and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
    gemv = _grouped_kernel(module, x, "gate_up_proj" if has_gate else "up_proj") if grouped else None
    if gemv is not None:
        out = _fused_forward(module, x, top_k_index, top_k_weights) if fused and has_gate else None
        return out if out is not None else _grouped_forward(module, gemv, x, top_k_index, top_k_weights, has_gate)
    out = torch.zeros_like(x)
    for e, tok, pos in expert_rows(top_k_index, num_experts):
        h = x[tok]
        if has_gate:
            h = module._apply_gate(_project(module, h, "gate_up_proj", e))
        else:
            h = module.act_fn(_project(module, h, "up_proj", e))
        h = _project(module, h, "down_proj", e)
        if getattr(module, "has_post_expert_norm", False):
            h = module.post_expert_norm(h)
        h = h * top_k_weights[tok, pos, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out


def split_forward(cached: CachedExperts, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  host_forward, place) -> torch.Tensor:
    """The routed experts' output for ``x`` on the accelerator: cached pairs computed here, the rest
    by ``host_forward(x, index, weights)`` (the CPU path, its output back on the accelerator)."""

    slot = cached.slot_of[top_k_index]
    hit = slot >= 0
    hits = int(hit.sum())  # one synchronisation: the count says both how many and whether all hit
    place.cache_pairs += hits
    place.routed_pairs += int(top_k_index.numel())
    run = routed_experts_forward if takes_routing(cached.module) else type(cached.module).forward  # blocks: their own
    out = run(cached.module, x.to(cached.dtype), slot, top_k_weights).to(x.dtype)
    if hits == top_k_index.numel():
        return out
    miss = torch.where(hit, torch.full_like(top_k_index, cached.num_experts), top_k_index)
    return out + host_forward(x, miss, top_k_weights)


class ExpertsPlace:
    """Per experts module: whether the current step computes it on the CPU, and the link that
    moves its inputs and output (set by the executor before the layer runs)."""

    def __init__(self, layer: int):
        self.layer = layer
        self.on_cpu = False
        self.link = None
        self.calls = 0  # CPU expert calls (tests check the path ran)
        self.rows = 0  # tokens those calls computed
        self.cached = None  # executor.expert_cache.CachedExperts: some experts kept on the accelerator
        self.cache_pairs = 0  # (token, choice) pairs the cache computed
        self.routed_pairs = 0  # (token, choice) pairs routed while the cache was there

    @property
    def cache_hit_rate(self) -> float | None:
        """Measured share of the routed pairs the accelerator's cache served (None: no cache ran)."""
        return self.cache_pairs / self.routed_pairs if self.routed_pairs else None


def _routing_args(module: nn.Module, args: tuple, kwargs: dict):
    """(hidden states, top_k_index, top_k_weights) of a call on transformers' routed interface."""
    bound = _forward_signature(type(module)).bind(module, *args, **kwargs)
    return tuple(bound.arguments.values())[1:4]


def _forward(module: nn.Module, place: ExpertsPlace, *args, **kwargs):
    own = type(module).forward
    if not place.on_cpu:
        return own(module, *args, **kwargs)
    if place.cached is not None and routed_interface(module):
        return split_forward(place.cached, *_routing_args(module, args, kwargs),
                             lambda *a: _host_forward(module, place, a, {}), place)
    return _host_forward(module, place, args, kwargs)


def _host_forward(module: nn.Module, place: ExpertsPlace, args: tuple, kwargs: dict):
    """The experts on the host copy of their weights: inputs over the link, output back."""
    own = type(module).forward
    link, layer = place.link, place.layer
    first = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
    back_dtype = first.dtype
    w = next(p for p in module._parameters.values() if p is not None)

    def to_host(t):
        if not isinstance(t, torch.Tensor):
            return t
        # to the host weights' dtype where they are floats (blocks, QuantExperts', compute on float inputs)
        cast = w.dtype if t.is_floating_point() and w.is_floating_point() and t.dtype != w.dtype else None
        return link.move(t, False, cast, "expert inputs", layer)

    args = tuple(to_host(a) for a in args)
    kwargs = {k: to_host(v) for k, v in kwargs.items()}
    place.calls += 1
    place.rows += int(args[0].shape[0]) if args else 0
    if takes_routing(module):
        out = routed_experts_forward(module, *args, **kwargs)
    else:
        out = own(module, *args, **kwargs)
    return link.move(out, True, back_dtype, "expert outputs", layer)


def with_its_layer(module: nn.Module) -> bool:
    """Whether ``module`` computes this step where its layer does, by its own forward: no executor
    forward (:func:`install`) or one whose place is not apart on the CPU; what a fused layer that
    computes the experts itself may stand in for."""
    f = module.__dict__.get("forward")
    if f is None:
        return True
    return isinstance(f, functools.partial) and f.func is _forward and not f.args[1].on_cpu


def install(module: nn.Module, place: ExpertsPlace) -> None:
    """Give ``module`` a forward that computes on the host while ``place.on_cpu``."""
    module.forward = functools.partial(_forward, module, place)


def uninstall(module: nn.Module) -> None:
    module.__dict__.pop("forward", None)
