"""Fused CPU forwards for Llama-style decoder layers: a whole decode step, or its norms and attention.

A decode step at batch 1 reads every weight once; what it does besides the GEMVs is a few dozen
small PyTorch ops per layer, each a dispatch from Python on caches the GEMVs have just flushed:
RMSNorm is 7 ops, rotary embedding 14, SDPA's CPU kernel ~150 us for 160 keys. Together they
take about a fifth of a small model's step. Here they are replaced, per module instance, by flexplan's native ops (``native_decode.c``,
through :func:`flexplan.executor.native.decode_status`):

- the decoder stack, when every layer is a :class:`FusedLayer` and the executor has put every
  layer of the step on the CPU: a decode step is one native call for all the layers, which also
  appends the new k and v to the KV cache (:class:`FusedStack`);
- a decoder layer whose linears are blocked (``cpu_linear``): a decode step is two native calls
  around the cache's own ``update`` (:class:`FusedLayer`);
- every ``*RMSNorm`` of the model (decoder layers and final norm): one call;
- the attention module of a decoder layer, for a decode step (one query position per
  sequence): q/k/v projections (the installed linears), rotary embedding in place, the cache
  update (the cache's own ``update``), one-query grouped-head attention reading the cache's
  view through its strides, the output projection.

Covered, per module and structurally (not by model_type): a decoder layer whose forward is Llama's
(the same bytecode: pre-norm residual blocks), with an attention block that has exactly q/k/v/o
projections, no parameters of its own (attention sinks), no QK-norm or logit soft-capping (its
forward names nothing Llama's does not, besides the sliding window it passes on), Llama's rotary
embedding (``rotate_half``); a sliding window is fine in decode, where the cache hands attention
only the window's keys and transformers' mask for them; a SwiGLU MLP (Llama's forward, SiLU), or a
routed mixture of experts with a top-k softmax router whose experts offer their GGUF blocks
(:func:`moe_norm_topk`: Qwen3-MoE's and Mixtral's blocks, flexplan.quant's QuantExperts) and
compute with their layer this step; RMSNorms whose forward is Llama's (Gemma's ``1 + weight`` is
not). A layer whose attention is covered but whose feed-forward is not (a shared expert, float
experts) keeps the fused attention and norms; the rest of it, and every layer not covered, runs
transformers' own forward. Float32 tensors on the CPU (linear weights
float32 or, blocked, 16-bit: computed in float32), no attention weights requested, a boolean
padding mask or none. Anything else (another
device or dtype: a layer on the accelerator; prefill; a float mask; ``FLEXPLAN_NATIVE=0``) runs
transformers' own forward, so the instance-level forward never changes what is computed, only
how. The class and other instances are untouched; :func:`uninstall` removes it.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import weakref

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast, MoeModelOutputWithPast

from flexplan.executor import cpu_attention, cpu_experts, native
from flexplan.executor.rebinds import rebinds
from flexplan.executor.families import CACHE_KWARG, CACHE_KWARGS, cache_in

# ---- which modules the native ops cover: compared with transformers' Llama, structurally -------------------
_ATTENTION_CHILDREN = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
# a QK-norm (Qwen3's): RMSNorms of q and k before the rotary embedding, per head or over the projection
# (each row of the norm's width), both or neither
_QK_NORMS = frozenset({"q_norm", "k_norm"})
_MLP_CHILDREN = frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"})
_LAYER_CHILDREN = frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"})
_MOE_CHILDREN = frozenset({"gate", "experts"})
_SHARED_EXPERT = frozenset({"shared_expert", "shared_expert_gate"})  # Qwen2-MoE's: a SwiGLU MLP, a [1, hidden] gate
# names a covered attention forward may use besides Llama's: Mistral/Qwen2 pass their (None) sliding window
_ATTENTION_EXTRA_NAMES = frozenset({"getattr", "sliding_window"})
# names a covered decoder stack forward may use besides Llama's: the sliding-window mask mapping (unused)
_STACK_EXTRA_NAMES = frozenset({"create_sliding_window_causal_mask", "sliding_window", "dict", "enumerate",
                                "has_sliding_layers", "isinstance", "layer_types", "MoeModelOutputWithPast"})


def _llama():
    from transformers.models.llama import modeling_llama

    return modeling_llama


@functools.cache
def _moe_forwards() -> tuple[tuple, dict]:
    """transformers' top-k softmax MoE blocks the native layer computes: (the block forwards, {router
    forward: whether it renormalises the kept probabilities, or None where its ``norm_topk_prob`` says}).
    Qwen3-MoE's and Mixtral's, and Qwen2-MoE's with its sigmoid-gated shared expert, compared by code,
    so a family that copies them is covered too."""
    from transformers.models.mixtral import modeling_mixtral as mixtral
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

    from transformers.models.qwen2_moe import modeling_qwen2_moe as qwen2_moe

    blocks = (qwen3_moe.Qwen3MoeSparseMoeBlock.forward, mixtral.MixtralSparseMoeBlock.forward,
              qwen2_moe.Qwen2MoeSparseMoeBlock.forward)
    return blocks, {qwen3_moe.Qwen3MoeTopKRouter.forward: None, mixtral.MixtralTopKRouter.forward: True,
                    qwen2_moe.Qwen2MoeTopKRouter.forward: None}


@functools.cache
def _layer_forwards() -> tuple:
    """Decoder layer forwards of Llama's structure (pre-norm residual attention and feed-forward
    blocks): Llama's, and Mixtral's (the same steps, its keyword arguments in another order)."""
    from transformers.models.mixtral import modeling_mixtral as mixtral

    return _llama().LlamaDecoderLayer.forward, mixtral.MixtralDecoderLayer.forward


def _code(f):
    return getattr(inspect.unwrap(f), "__code__", None)


def _same_code(f, g) -> bool:
    a, b = _code(f), _code(g)
    return a is not None and b is not None and (a.co_code, a.co_names) == (b.co_code, b.co_names)


def _extra_names(f, g) -> set[str]:
    a, b = _code(f), _code(g)
    return {"?"} if a is None or b is None else set(a.co_names) - set(b.co_names)


def _children(m: nn.Module) -> dict[str, nn.Module]:
    return {n: c for n, c in m.named_children() if not isinstance(c, nn.Dropout)}


def _is_linear(m: nn.Module) -> bool:
    """A plain ``nn.Linear``, or a linear on a GGUF file's blocks (``raw_blocks()``: flexplan.quant's
    QuantLinear, named by what it offers so this module does not import flexplan.quant)."""
    return type(m) is nn.Linear or callable(getattr(m, "raw_blocks", None))


def covered_norm(m: nn.Module) -> bool:
    """An RMSNorm that computes what Llama's does (weight x normalised, one weight)."""
    return (hasattr(m, "variance_epsilon") and set(n for n, _ in m.named_parameters()) == {"weight"}
            and _same_code(type(m).forward, _llama().LlamaRMSNorm.forward))


def covered_attention(a: nn.Module) -> bool:
    """Llama's attention block: q/k/v/o projections only (and a QK-norm of Llama's RMSNorm, Qwen3's),
    rotate-half rotary. A sliding window is
    covered in decode: the cache hands over only the window's keys (as transformers' sliding
    cache layers do) and the mask, if any, is the one transformers built for them."""
    kids = _children(a)
    norms = set(kids) & _QK_NORMS
    if norms and (norms != _QK_NORMS or not all(covered_norm(kids[n]) for n in norms)):
        return False
    linears = {n: c for n, c in kids.items() if n not in _QK_NORMS}
    if (set(linears) != _ATTENTION_CHILDREN or not all(_is_linear(c) for c in linears.values())
            or a._parameters or a._buffers
            or not all(hasattr(a, x) for x in ("head_dim", "scaling", "layer_idx"))
            or getattr(getattr(a, "config", None), "attn_logit_softcapping", None)
            or _extra_names(type(a).forward, _llama().LlamaAttention.forward) - _ATTENTION_EXTRA_NAMES - norms):
        return False
    g = inspect.unwrap(type(a).forward).__globals__
    L = _llama()
    return (_same_code(g.get("apply_rotary_pos_emb"), L.apply_rotary_pos_emb)
            and _same_code(g.get("rotate_half"), L.rotate_half))


def covered_mlp(m: nn.Module) -> bool:
    """A SwiGLU MLP: down(silu(gate(x)) * up(x)), as Llama's."""
    kids = _children(m)
    return (set(kids) == _MLP_CHILDREN and all(_is_linear(kids[n]) for n in _MLP_CHILDREN - {"act_fn"})
            and type(kids["act_fn"]).__name__ in _SILU and _same_code(type(m).forward, _llama().LlamaMLP.forward))


def moe_norm_topk(m: nn.Module) -> bool | None:
    """For a routed MoE block the native layer computes, whether its router renormalises the top-k
    probabilities; None where it is not one. Covered: a block whose forward is Qwen3-MoE's or
    Mixtral's (router, then experts), or Qwen2-MoE's (and a SwiGLU shared expert scaled by a one-row
    sigmoid gate), a router whose forward is one
    of theirs (softmax over the experts' logits, the top k kept) with a weight only, and experts that
    offer their blocks to the native layer (``native_layout``: flexplan.quant's QuantExperts, named by
    what it offers so this module does not import flexplan.quant)."""
    kids = _children(m)
    shared = set(kids) - _MOE_CHILDREN
    if not _MOE_CHILDREN <= set(kids) or shared not in (set(), _SHARED_EXPERT):
        return None
    if shared and not (covered_mlp(kids["shared_expert"]) and _is_linear(kids["shared_expert_gate"])
                       and kids["shared_expert_gate"].out_features == 1 and kids["shared_expert_gate"].bias is None):
        return None
    blocks, routers = _moe_forwards()
    gate, experts = kids["gate"], kids["experts"]
    norm = next((n for f, n in routers.items() if _same_code(type(gate).forward, f)), False)
    if (norm is False or not any(_same_code(type(m).forward, f) for f in blocks)
            or set(n for n, _ in gate.named_parameters()) != {"weight"} or not callable(getattr(experts, "native_layout", None))
            or not all(hasattr(gate, a) for a in ("top_k", "num_experts"))):
        return None
    return bool(gate.norm_topk_prob) if norm is None else norm


def covered_layer(layer: nn.Module) -> bool:
    """A whole decoder layer the native layer calls compute (:class:`FusedLayer`): its feed-forward
    a SwiGLU MLP or a routed MoE block (:func:`moe_norm_topk`)."""
    kids = _children(layer)
    return (set(kids) == _LAYER_CHILDREN and any(_same_code(type(layer).forward, f) for f in _layer_forwards())
            and covered_attention(kids["self_attn"])
            and (covered_mlp(kids["mlp"]) or moe_norm_topk(kids["mlp"]) is not None)
            and covered_norm(kids["input_layernorm"]) and covered_norm(kids["post_attention_layernorm"]))


def covered_stack(stack: nn.Module) -> bool:
    """A decoder stack the native stack call replaces: plain embedding, rotary, Llama's forward."""
    return (type(getattr(stack, "embed_tokens", None)) is nn.Embedding and hasattr(stack, "rotary_emb")
            and covered_norm(getattr(stack, "norm", None) or nn.Module())
            and not _extra_names(type(stack).forward, _llama().LlamaModel.forward) - _STACK_EXTRA_NAMES)


def _cpu_f32(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def _rmsnorm_forward(module: nn.Module, ops: native.NativeDecode, hidden_states: torch.Tensor) -> torch.Tensor:
    if _cpu_f32(hidden_states, module.weight) and hidden_states.is_contiguous():
        return ops.rmsnorm(hidden_states, module.weight, float(module.variance_epsilon))
    return type(module).forward(module, hidden_states)


def _decode_call(args: tuple, kwargs: dict, head_dim: int, training: bool):
    """(hidden [b, 1, h], (cos, sin) as [b, d], mask, cache) when this call is a decode step the
    native ops take (keyword arguments as transformers' layers pass them, float32 on the CPU, a
    cache, no attention weights asked for), else None."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    pe, cache = kwargs.get("position_embeddings"), cache_in(kwargs)
    if not (len(args) <= 1 and hidden is not None and hidden.dim() == 3 and hidden.shape[1] == 1
            and cache is not None and not getattr(cache, "kv_by_caller", False)  # paged pools: the caller attends
            and pe is not None and not training and not kwargs.get("output_attentions")
            and _cpu_f32(hidden, *pe) and pe[0].shape[-1] == head_dim and pe[0].shape == pe[1].shape
            and pe[0].numel() in (head_dim, hidden.shape[0] * head_dim)):
        return None
    return hidden, _rows(pe, hidden.shape[0], head_dim), kwargs.get("attention_mask"), cache


def _rows(pe: tuple[torch.Tensor, torch.Tensor], batch: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as contiguous [batch, head_dim] rows (one position shared by the batch is
    repeated)."""
    return tuple(t.reshape(-1, head_dim).expand(batch, head_dim).contiguous() for t in pe)


class RotaryRows:
    """The rotary embedding's cos and sin rows of one decode position, kept per position: a batch-1
    decode step asks transformers' rotary module for one position's, ~10 small torch ops a step
    (each started with cold caches after the weights' stream), and the next request asks for the
    same positions again. A kept pair is what the module itself returned for that position, so the
    step's numbers are the same. Kept only where the module's output depends on the position alone
    (:meth:`_static`) and with the same frequencies and scaling as when kept (a later ``inv_freq``
    write or reload starts afresh)."""

    MAX_POSITIONS = 4096  # kept pairs at most; then it starts afresh (a few MB at head_dim 128)

    def __init__(self, owner: nn.Module):
        self.owner = owner  # the module whose ``rotary_emb`` it asks (looked up per call: it may be replaced)
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # position -> (cos, sin) [1, head_dim]
        self._source: tuple = ()
        self.static = False

    @staticmethod
    def _static(rotary: nn.Module) -> bool:
        """Llama's rotary forward (any family's copy of it), and a rope type its transformers
        decorator (dynamic_rope_update) does not recompute the frequencies for by the length."""
        rope_type = str(getattr(rotary, "rope_type", "default"))
        return (_same_code(type(rotary).forward, _llama().LlamaRotaryEmbedding.forward)
                and "dynamic" not in rope_type and "longrope" not in rope_type)

    def __call__(self, x: torch.Tensor, pos: int, batch: int, head_dim: int):
        """(cos, sin) [batch, head_dim] of position ``pos`` for every row (x: the step's float32
        input on the CPU), or None where the module's rows are not head_dim wide float32."""
        rotary = self.owner.rotary_emb
        inv = getattr(rotary, "inv_freq", None)
        source = (id(rotary), id(inv), getattr(inv, "_version", None), getattr(rotary, "attention_scaling", None))
        if source != self._source or len(self.rows) >= self.MAX_POSITIONS:
            self.rows, self._source, self.static = {}, source, self._static(rotary)
        one = self.rows.get(pos)
        if one is None:
            cos, sin = rotary(x, torch.full((1, 1), pos, dtype=torch.long))
            if not (_cpu_f32(cos, sin) and cos.shape[-1] == head_dim and cos.numel() == head_dim):
                return None
            one = _rows((cos, sin), 1, head_dim)
            if self.static:
                self.rows[pos] = one
        return one if batch == 1 else _rows(one, batch, head_dim)


def _native_readable(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                     batch: int) -> tuple[bool, torch.Tensor | None]:
    """(whether the native attention can read this cache view and mask, the mask as [batch, keys]
    bool or None). A mask must be boolean and shared by the heads ([b or 1, 1, 1, keys])."""
    if not (keys.device.type == values.device.type == "cpu" and keys.dtype == values.dtype
            and keys.dtype in native.ATTENTION_KV_DTYPES and keys.stride() == values.stride() and keys.stride(-1) == 1):
        return False, None
    if mask is None:
        return True, None
    n = keys.shape[2]
    if (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:] != (1, 1, n) or mask.shape[0] not in (1, batch)
            or mask.device.type != "cpu"):
        return False, None
    return True, mask[:, 0, 0, :].expand(batch, n).contiguous()


def native_decode_attention(ops: native.NativeDecode | None, module: nn.Module, q: torch.Tensor, keys, values,
                            mask, kwargs: dict) -> torch.Tensor | None:
    """transformers' attention call ``(module, q, keys, values, mask, **kwargs)`` for one query
    per sequence on the CPU, q [b, heads, 1, d], by flexplan's native kernel: the output [b, 1,
    heads, d] in q's dtype, or None where it does not apply (no ops, not one query, dropout or
    weights asked for, a cache or mask it does not read). A bfloat16 cache is read as it is, q in
    float32: one pass over the cache with no converted copy, about twice as fast as transformers'
    masked SDPA at batch 1 and about as fast at batch 8 (``benchmarks/bench_cpu_attention_bf16.py``)."""
    if (ops is None or q.device.type != "cpu" or q.dim() != 4 or q.shape[2] != 1 or kwargs.get("dropout")
            or kwargs.get("output_attentions")):
        return None
    b, hq, _, d = q.shape
    readable, m = _native_readable(keys, values, mask, b)
    if not readable:
        return None
    scale = kwargs.get("scaling")
    out = ops.decode_attention(q.reshape(b, hq, d).to(torch.float32).contiguous(), keys, values, m,
                               float(module.scaling if scale is None else scale))
    return out.view(b, 1, hq, d).to(q.dtype)


def native_attention_handler(layer: int, module: nn.Module, inner, query, key, value, attention_mask, **kwargs):
    """A ``cpu_attention.install`` handler for layers that compute on the CPU: a decode step's
    attention by :func:`native_decode_attention` where it applies, else ``inner`` (what the
    module's attention implementation does)."""
    out = native_decode_attention(native.decode_status()[0], module, query, key, value, attention_mask, kwargs)
    return (out, None) if out is not None else inner(module, query, key, value, attention_mask, **kwargs)


def _attention_forward(module: nn.Module, ops: native.NativeDecode, *args, **kwargs):
    call = _decode_call(args, kwargs, module.head_dim, module.training)
    if call is None or cpu_attention.routed_now(module):  # the executor attends beside the KV cache
        return type(module).forward(module, *args, **kwargs)
    hidden, (cos, sin), mask, cache = call
    b, d = hidden.shape[0], module.head_dim
    q, k, v = module.q_proj(hidden), module.k_proj(hidden), module.v_proj(hidden)
    if getattr(module, "q_norm", None) is not None:  # the QK-norm, the module's own, before the rotary embedding
        q, k = (n(t.reshape(-1, n.weight.numel())).reshape(t.shape) for n, t in ((module.q_norm, q), (module.k_norm, k)))
    hq, hk = q.shape[-1] // d, k.shape[-1] // d
    q, k = q.contiguous().view(b, hq, d), k.contiguous().view(b, hk, d)
    ops.rope_(q, cos, sin)
    ops.rope_(k, cos, sin)
    keys, values = cache.update(k.view(b, 1, hk, d).transpose(1, 2), v.view(b, 1, hk, d).transpose(1, 2),
                                module.layer_idx)
    readable, m = _native_readable(keys, values, mask, b)
    if readable:
        out = ops.decode_attention(q, keys, values, m, float(module.scaling))
    else:
        out = _sdpa(q, keys, values, mask, module.scaling)
    return module.o_proj(out.reshape(b, 1, hq * d)), None


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """PyTorch's SDPA for q [b, hq, d] over a cache the native op does not read; [b, hq * d]."""
    b, hq, d = q.shape
    return torch.nn.functional.scaled_dot_product_attention(
        q.view(b, hq, 1, d), keys, values, attn_mask=mask, scale=scale, enable_gqa=hq != keys.shape[1]).reshape(b, -1)


_SILU = ("SiLU", "SiLUActivation")


def _scratch(have: dict[str, torch.Tensor], w: native.LayerWeights, batch: int) -> dict[str, torch.Tensor]:
    """The native layer calls' scratch rows for ``batch`` sequences (``have`` when it fits)."""
    if have and have["xn"].shape[0] == batch:
        return have
    sizes = dict(xn=w.hidden, tmp=w.hidden, y=w.hidden, q=w.hq * w.d, attn=w.hq * w.d, k=w.hk * w.d,
                 v=w.hk * w.d, g=w.inter, u=w.inter)
    return {n: torch.empty(batch, size) for n, size in sizes.items()}


def _blocked(*linears: nn.Module) -> bool:
    """Blocked weights on the CPU, all of one dtype the native GEMV reads (float32 or 16-bit),
    float32 biases."""
    dtypes = {m.weight.dtype for m in linears}
    return (len(dtypes) == 1 and dtypes <= set(native.WEIGHT_TYPES)
            and all(m.weight.dim() == 3 and m.weight.device.type == "cpu" and (m.bias is None or _cpu_f32(m.bias))
                    for m in linears))


def _layer_linears(linears: tuple[nn.Module, ...]) -> tuple[int, list[int], int, list[tuple[int, int]]] | None:
    """How the native layer calls read the seven linears (q k v o gate up down): (the blocked ones'
    :data:`native.WEIGHT_TYPES` code, each one's GGUF type or 0 for blocked, the quantised ones'
    float-activation flag, each one's (out, in)), or None where one is neither blocked for the
    native GEMV nor on raw blocks a kernel reads (dequantised at load), or their kinds disagree."""
    quant = [m.raw_blocks() if callable(getattr(m, "raw_blocks", None)) else None for m in linears]
    blocked = [m for m, q in zip(linears, quant) if q is None]
    if (blocked and not _blocked(*blocked)) or any(q is not None and q[0] is None for q in quant):
        return None
    flags = {bool(m.float_act) for m, q in zip(linears, quant) if q is not None}
    if len(flags) > 1 or not all(m.bias is None or _cpu_f32(m.bias) for m in linears):
        return None
    dims = [(m.out_features, m.in_features) if q is not None else (m.weight.shape[0] * m.weight.shape[2],
                                                                    m.weight.shape[1]) for m, q in zip(linears, quant)]
    wtype = native.WEIGHT_TYPES[blocked[0].weight.dtype] if blocked else 0
    return wtype, [0 if q is None else q[1] for q in quant], int(flags == {True}), dims


def _tensor_slots(lin: nn.Module) -> list[tuple[dict, str]]:
    """(dict, key) of what the native call reads for a linear, weight then bias: a GGUF linear's raw
    blocks (its ``blocks`` parameter) and bias buffer, else its weight and bias parameters."""
    if callable(getattr(lin, "raw_blocks", None)):
        return [(lin._parameters, "blocks"), (lin._buffers, "bias")]
    return [(lin._parameters, "weight"), (lin._parameters, "bias")]


class FusedLayer:
    """A whole decoder layer for one decode step in two native calls around the cache update
    (``flexplan_layer_pre/post_attention_f32``), when its linears are blocked for the native GEMV.
    Any other call goes to :func:`_attention_forward` / :func:`_rmsnorm_forward` through
    transformers' layer forward."""

    def __init__(self, layer: nn.Module, ops: native.NativeDecode):
        self.layer, self.ops = layer, ops
        a, m = layer.self_attn, layer.mlp
        self.attn, self.head_dim, self.layer_idx = a, a.head_dim, a.layer_idx
        self.norms = (layer.input_layernorm, layer.post_attention_layernorm)
        self.qk_norms = (a.q_norm, a.k_norm) if getattr(a, "q_norm", None) is not None else ()
        # a routed MoE block instead of the MLP: its router and experts (moe_norm_topk), the MLP's linears none
        self.norm_topk = moe_norm_topk(m)
        self.moe = (m.gate, m.experts) if self.norm_topk is not None else None
        # the SwiGLU in the gate/up/down slots: the MLP, or a MoE block's shared expert (with its one-row gate)
        mlp = m.shared_expert if self.moe and hasattr(m, "shared_expert") else (None if self.moe else m)
        self.shared_gate = m.shared_expert_gate if self.moe and mlp is not None else None
        self._sgate: tuple = ()  # (the shared gate's tensors' addresses, its row float32 [hidden])
        self.linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj) + (
            () if mlp is None else (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        self.silu = mlp is None or type(mlp.act_fn).__name__ in _SILU
        self.weights = native.LayerWeights()
        self._bound: tuple = ()  # (address, dtype) of the tensors the struct points at
        self._ok = False
        # where each tensor the struct points at is held (a module's own dicts: stable objects), so the
        # per-step check reads them without module attribute lookups
        self._slots = [slot for lin in self.linears for slot in _tensor_slots(lin)] + \
            [(n._parameters, "weight") for n in self.norms + self.qk_norms]
        if self.moe:
            gate, experts = self.moe
            self._slots += [(gate._parameters, "weight")] + [
                (d, f"{name}_{what}") for name in ("gate_up", "down")
                for d, what in ((experts._parameters, "blocks"), (experts._buffers, "bias"))]
            if self.shared_gate is not None:
                self._slots += _tensor_slots(self.shared_gate)
        self.scratch: dict[str, torch.Tensor] = {}

    def _fill(self) -> bool:
        """Point the weight struct at the layer's current tensors (again only when the executor has
        rebound them); False when a linear is neither blocked on the CPU in a dtype the GEMV reads
        (all blocked ones in one) nor on GGUF blocks a kernel reads (another kernel, or a layer on
        the accelerator)."""
        tensors = [d.get(k) for d, k in self._slots]
        # the executor rebinds a Parameter's .data in place: compare where the data is, not the object
        # (address and dtype: a new tensor of another shape or device is never at an address still held)
        try:
            bound = tuple(None if t is None else (t.data_ptr(), t.dtype) for t in tensors)
        except RuntimeError:  # an opaque oneDNN-packed weight has no data pointer: none the native calls read
            bound = ("opaque", tuple(id(t) for t in tensors))
        # and the count of rebinds: a switch that changes what the struct says without moving a tensor
        # (a linear's or the experts' float_act, the experts' fused) notes one
        bound += (rebinds(),)
        if bound == self._bound:
            return self._ok
        self._bound = bound
        kinds = _layer_linears(self.linears) if self.silu else None
        norms = self.norms + self.qk_norms
        self._ok = (kinds is not None and _cpu_f32(*(n.weight for n in norms))
                    and all(hasattr(n, "variance_epsilon") and n.weight.is_contiguous() for n in norms))
        if not self._ok:
            return False
        w, a, d = self.weights, self.attn, self.head_dim
        (w.ln1, w.ln2), (w.eps1, w.eps2) = (n.weight.data_ptr() for n in self.norms), \
            (float(n.variance_epsilon) for n in self.norms)
        for name, lin, t in zip("qkvogud", self.linears, tensors[0::2]):
            setattr(w, "w" + name, t.data_ptr())
            setattr(w, "b" + name, None if lin.bias is None else lin.bias.data_ptr())
        w.wtype, qtypes, w.float_act, dims = kinds
        w.qtype[:] = qtypes + [0] * (7 - len(qtypes))
        (q_out, _), (k_out, _), (o_out, _) = dims[0], dims[1], dims[3]
        w.hidden, w.hq, w.hk, w.d = o_out, q_out // d, k_out // d, d
        w.inter = dims[6][1] if len(dims) == 7 else 0
        if not self._fill_moe(w):
            self._ok = False
            return False
        w.scale = float(a.scaling)
        w.qn = w.kn = None
        if self.qk_norms:  # each norm's width divides its projection's rows (a head's d, or all of it)
            qn, kn = self.qk_norms
            if q_out % qn.weight.numel() or k_out % kn.weight.numel():
                self._ok = False
                return False
            w.qn, w.kn = qn.weight.data_ptr(), kn.weight.data_ptr()
            w.qn_width, w.kn_width = qn.weight.numel(), kn.weight.numel()
            w.eps_q, w.eps_k = float(qn.variance_epsilon), float(kn.variance_epsilon)
        return True

    def _fill_moe(self, w: native.LayerWeights) -> bool:
        """The struct's routed experts (n_experts 0 for an MLP layer); False where the experts do not
        offer their blocks on the host (``native_layout``) or the router is not float32 [E, hidden]
        on the CPU."""
        w.n_experts, w.sgate = 0, None
        if self.moe is None:
            return True
        if self.shared_gate is not None:
            row = self._shared_gate_row(w.hidden)
            if row is None:
                return False
            w.sgate = row.data_ptr()
        gate, experts = self.moe
        layout = experts.native_layout()
        r = gate.weight
        if (layout is None or not _cpu_f32(r) or not r.is_contiguous() or tuple(r.shape) != (gate.num_experts, w.hidden)
                or not 0 < gate.top_k <= gate.num_experts or experts.num_experts != gate.num_experts
                or experts.hidden != w.hidden):
            return False
        gu, gu_type, dn, dn_type, b_gu, b_dn = layout
        w.router, w.egu, w.ed = r.data_ptr(), gu.data_ptr(), dn.data_ptr()
        w.begu, w.bed = (None if b is None else b.data_ptr() for b in (b_gu, b_dn))
        w.egu_type, w.ed_type, w.egu_stride, w.ed_stride = gu_type, dn_type, gu.stride(0), dn.stride(0)
        w.n_experts, w.top_k, w.norm_topk = gate.num_experts, gate.top_k, int(self.norm_topk)
        w.moe_inter, w.moe_float_act = experts.intermediate, int(experts.float_act)
        return True

    def _shared_gate_row(self, hidden: int) -> torch.Tensor | None:
        """The shared expert's gate as one float32 row [hidden], asked of the module (a packed float
        linear holds no plain weight): the identity through it, exact (a QuantLinear's blocks
        dequantised as gguf does); kept while the gate's own tensors stay where they are, since the
        layer's other checks run again after every rebind. None where it is not a [1, hidden] gate on
        the CPU."""
        g = self.shared_gate
        try:
            key = tuple(None if t is None else t.data_ptr() for d, k in _tensor_slots(g) for t in [d.get(k)])
        except RuntimeError:  # an opaque packed weight: known by the objects
            key = tuple(id(d.get(k)) for d, k in _tensor_slots(g))
        if self._sgate[:1] != (key,):
            eye = torch.eye(g.in_features)
            with torch.no_grad():
                row = g.forward_dequantised(eye) if callable(getattr(g, "raw_blocks", None)) else g(eye)
            if row.device.type != "cpu" or tuple(row.shape) != (hidden, 1):
                return None
            self._sgate = (key, row.float().reshape(-1).contiguous())
        return self._sgate[1]

    def dims(self) -> tuple[int, ...]:
        w = self.weights
        return w.hidden, w.inter, w.hq, w.hk, w.d

    def _buffers(self, batch: int) -> dict[str, torch.Tensor]:
        self.scratch = _scratch(self.scratch, self.weights, batch)
        return self.scratch

    def __call__(self, *args, **kwargs):
        layer = self.layer
        call = _decode_call(args, kwargs, self.head_dim, layer.training)
        if (call is None or not self._fill()
                or (self.moe is not None and not cpu_experts.with_its_layer(self.moe[1]))):  # experts placed apart
            return type(layer).forward(layer, *args, **kwargs)
        hidden, (cos, sin), mask, cache = call
        w, b = self.weights, hidden.shape[0]
        s = self._buffers(b)
        x = hidden.reshape(b, w.hidden).contiguous()
        self.ops.layer_pre_attention(w, x, cos, sin, s["xn"], s["q"], s["k"], s["v"])
        k4, v4 = (s[n].view(b, 1, w.hk, w.d).transpose(1, 2) for n in ("k", "v"))
        keys, values = cache.update(k4, v4, self.layer_idx)
        readable, m = _native_readable(keys, values, mask, b)
        if not readable:  # attention by SDPA; the native call does the rest of the layer
            s["attn"].copy_(_sdpa(s["q"].view(b, w.hq, w.d), keys, values, mask, w.scale))
            keys = values = m = None
        y = torch.empty(b, 1, w.hidden)
        self.ops.layer_post_attention(w, x, y, s["q"], keys, values, m, s)
        return y


_STACK_KWARGS = frozenset({"input_ids", "inputs_embeds", "attention_mask", "position_ids", *CACHE_KWARGS,
                           "use_cache", "return_dict", "output_attentions", "output_hidden_states",
                           "output_router_logits"})  # a MoE stack's (not asked: the step computes none)


class FusedStack:
    """The decoder stack (embedding, every decoder layer, final norm) for one decode step with one
    native call for all the layers (``flexplan_decode_stack_f32``), which writes each layer's new
    k and v straight into its KV cache, and where their tables are float32 on the CPU also looks
    the embedding rows up and applies the final norm. Nothing runs in Python between the layers:
    no module calls, no hooks (the embedding's and the final norm's included where the call does
    them), no cache ``update()``, no per-layer mask or rotary handling.

    It runs only while :attr:`armed`, which the executor sets for a decode step whose every layer
    computes on the CPU, after putting their weights and KV caches there (what its per-layer
    hooks would do); and only when every layer is a :class:`FusedLayer` with blocked weights
    (float32, or 16-bit computed in float32), the cache's buffers are float32 on the host (:meth:`FlexKVLayer.cpu_f32_buffers`),
    the mask is a 2-D padding mask, and no sliding window cuts the keys. Anything else runs the
    stack's own forward, layer by layer (where the layers' fused forwards still apply)."""

    def __init__(self, stack: nn.Module, layers: list[FusedLayer], ops: native.NativeDecode):
        self.stack, self.layers, self.ops = stack, layers, ops
        self.n = len(layers)
        self.weight_ptrs = (ctypes.POINTER(native.LayerWeights) * self.n)(*(ctypes.pointer(f.weights) for f in layers))
        self.window = getattr(stack.config, "sliding_window", None)
        self.armed = False
        self.rotary_rows = RotaryRows(stack)
        self.steps = 0  # decode steps run natively
        self.scratch: dict[str, torch.Tensor] = {}
        self._cache_ptrs: tuple = ()  # (key, k pointer array, v pointer array)
        # the last step that passed the per-layer checks: (rebinds count, batch, weak references to
        # each layer's k and v buffers, the smallest window, the pointer arrays); the next step with the
        # same count, batch and buffer objects skips those checks (nothing they read can have changed)
        self._checked: tuple | None = None

    def _kv_pointers(self, buffers: list) -> tuple:
        key = tuple(t.data_ptr() for kv in buffers for t in kv)
        if self._cache_ptrs[:1] != (key,):
            arr = ctypes.c_void_p * self.n
            self._cache_ptrs = (key, arr(*key[0::2]), arr(*key[1::2]))
        return self._cache_ptrs[1:]

    def _checked_pointers(self, layers: list, b: int) -> tuple | None:
        """(the smallest attention window or None, k and v pointer arrays) for a step of ``b``
        sequences over ``layers``' caches, or None where a layer's weights or cache are not ones the
        native stack reads. The per-layer checks run again only where a parameter was rebound
        (:mod:`rebinds`), the batch changed or a layer's cache holds other buffers."""
        last = self._checked
        if (last is not None and last[0] == rebinds() and last[1] == b
                and all((a := kv.active) is not None and r() is a[0] and rv() is a[1]
                        for (r, rv), kv in zip(last[2], layers))):
            return last[3:]
        self._checked = None
        buffers = [kv.cpu_f32_buffers() for kv in layers]
        if (any(buf is None or buf[0].shape[1] != b for buf in buffers)
                or not all(f._fill() for f in self.layers) or len({f.dims() for f in self.layers}) != 1):
            return None
        windows = [w for w in [self.window] + [getattr(kv, "window", None) for kv in layers] if w]
        k_ptrs, v_ptrs = self._kv_pointers(buffers)
        self._checked = (rebinds(), b, [(weakref.ref(k), weakref.ref(v)) for k, v in buffers],
                         min(windows, default=None), k_ptrs, v_ptrs)
        return self._checked[3:]

    def _run(self, kwargs: dict):
        """The step's output, or None when this call is not one the native stack takes."""
        cache, ids, embeds = cache_in(kwargs), kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        config = self.stack.config
        if (self.stack.training or not _STACK_KWARGS.issuperset(kwargs) or kwargs.get("return_dict") is False
                or kwargs.get("output_attentions") or kwargs.get("output_hidden_states") or kwargs.get("output_router_logits")
                or getattr(config, "output_attentions", False) or getattr(config, "output_hidden_states", False)
                or (ids is None) == (embeds is None) or len(getattr(cache, "layers", ())) != self.n
                or config.num_hidden_layers != self.n):
            return None
        given = ids if embeds is None else embeds
        b = given.shape[0]
        layers = cache.layers
        pos = layers[0].length
        if (given.dim() != (2 if embeds is None else 3) or given.shape[1] != 1
                or any(kv.length != pos for kv in layers) or pos + 1 > layers[0].capacity):
            return None
        checked = self._checked_pointers(layers, b)
        if checked is None:
            return None  # checked before the embedding lookup: a declined step does not pay for it twice
        window, k_ptrs, v_ptrs = checked
        if window and pos + 1 > window:
            return None
        embed = self._embedding_rows(ids) if embeds is None else None
        if embed is not None:  # looked up in the native call
            h = torch.empty(b, self.layers[0].weights.hidden)
        else:
            x = self.stack.embed_tokens(ids) if embeds is None else embeds
            if not _cpu_f32(x):
                return None
            h = x.reshape(b, -1).clone()
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if mask.dim() != 2 or tuple(mask.shape) != (b, pos + 1) or mask.device.type != "cpu":
                return None
            mask = None if bool(mask.all()) else mask.to(torch.bool).contiguous()
        position_ids = kwargs.get("position_ids")
        d = self.layers[0].head_dim
        x = h.view(b, 1, -1)  # what the rotary module reads of its input: device and dtype
        if position_ids is None:  # every row at the cache's position: its rows, kept per position
            pe = self.rotary_rows(x, pos, b, d)
            if pe is None:
                return None
            cos, sin = pe
        else:
            cos, sin = self.stack.rotary_emb(x, position_ids)
            if not (_cpu_f32(cos, sin) and cos.shape[-1] == d and cos.numel() in (d, b * d)):
                return None
            cos, sin = _rows((cos, sin), b, d)
        self.scratch = _scratch(self.scratch, self.layers[0].weights, b)
        norm = self.stack.norm
        folded = _cpu_f32(norm.weight) and norm.weight.is_contiguous()  # else the head's placement runs it
        out = torch.empty_like(h) if folded else None
        if not self.ops.decode_stack(self.weight_ptrs, self.n, k_ptrs, v_ptrs, pos, h, cos, sin, mask, self.scratch,
                                     embed=embed, norm=(norm.weight, float(norm.variance_epsilon), out) if folded
                                     else None):
            return None  # an id the embedding has no row for: nothing done, the stack's forward says so
        for kv in cache.layers:
            kv.advance(1, views=False)  # the native step attended by itself: views only if read
        self.steps += 1
        hidden = out.view(b, 1, -1) if folded else norm(h.view(b, 1, -1))
        # what the stack's own forward returns: a MoE stack's output names its (unasked) router logits
        output = MoeModelOutputWithPast if "output_router_logits" in kwargs else BaseModelOutputWithPast
        return output(last_hidden_state=hidden, **{CACHE_KWARG: cache})

    def _embedding_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the embedding's weight, the ids as int64 [batch]) where the native call can look the rows
        up as ``nn.Embedding`` would: a plain float32 [vocab, hidden] table on the CPU (no blocked
        layout put in by the executor, no max_norm, which rewrites rows); else None."""
        e = self.stack.embed_tokens
        w = e.weight
        if ("forward" in e.__dict__ or e.max_norm is not None or not _cpu_f32(w) or w.dim() != 2
                or not w.is_contiguous() or w.shape[1] != self.layers[0].weights.hidden
                or ids.dtype != torch.long or ids.device.type != "cpu"):
            return None
        return w, ids.reshape(-1).contiguous()

    def __call__(self, *args, **kwargs):
        out = self._run(kwargs) if self.armed and not args else None
        return out if out is not None else type(self.stack).forward(self.stack, *args, **kwargs)


def install_stack(stack: nn.Module, layers: nn.ModuleList) -> FusedStack | None:
    """Give the decoder stack the native whole-stack decode step (:class:`FusedStack`) when
    every decoder layer has a :class:`FusedLayer` (installed by :func:`install`) and the stack
    is Llama's, else None. :func:`uninstall` ([stack]) removes it."""
    fused = [layer.__dict__.get("forward") for layer in layers]
    if (not layers or not all(isinstance(f, FusedLayer) for f in fused)
            or not all(hasattr(stack, a) for a in ("embed_tokens", "rotary_emb", "norm", "config"))
            or not covered_stack(stack)):
        return None
    stack.forward = FusedStack(stack, fused, fused[0].ops)
    return stack.forward


def install(layers: nn.ModuleList, norms: list[nn.Module]) -> tuple[list[nn.Module], list[int], list[int]]:
    """Give each covered decoder layer (:func:`covered_layer`) the fused layer forward, each
    covered attention block and RMSNorm in ``layers`` and ``norms`` (final norms) the fused
    forward; (the modules changed, for :func:`uninstall`; the indices of the fused layers; the
    indices of the layers whose attention the native ops compute). Nothing when the native ops
    are unavailable."""
    ops = native.decode_status()[0]
    if ops is None:
        return [], [], []
    changed, fused = [], []
    for i, layer in enumerate(layers):
        if covered_layer(layer):
            layer.forward = FusedLayer(layer, ops)
            changed.append(layer)
            fused.append(i)
    native_attention = set(fused)
    for i, layer in enumerate(layers):
        for a in layer.children():
            if not isinstance(a, nn.ModuleList) and covered_attention(a):
                a.forward = functools.partial(_attention_forward, a, ops)
                changed.append(a)
                native_attention.add(i)
    for module in [m for layer in layers for m in layer.modules()] + list(norms):
        if covered_norm(module):
            module.forward = functools.partial(_rmsnorm_forward, module, ops)
            changed.append(module)
    return changed, fused, sorted(native_attention)


def uninstall(modules: list[nn.Module]) -> None:
    for m in modules:
        m.__dict__.pop("forward", None)


def describe(fused_layers: int | None = None, num_layers: int | None = None) -> str:
    """What the CPU's decoder layers run besides the linears (for run statistics)."""
    ops, why = native.decode_status()
    if ops is None:
        return f"transformers' ops ({why})"
    if fused_layers is not None and fused_layers < (num_layers or 0):
        return (f"native fused decode for {fused_layers} of {num_layers} layers (the others: transformers' layer "
                "forward, with native RMSNorm and attention where they cover them)")
    return ("native fused decode (all layers in one call when every layer is on the CPU, else per layer; "
            "RMSNorm, rotary, attention)")
