"""One decoder layer as a sequence of operators: Park & Egger's array O (section 4.2).

The operators are the units a split point can fall between, in the order a transformers decoder
layer calls them, named after its modules: the Linear children of ``self_attn`` before the attention
core (``q_proj``, ``k_proj``, ``v_proj``), the attention core itself (``attention``: rotary, scores,
softmax, weighted values over the KV cache), the output projection (``o_proj``), then the Linear
children of ``mlp`` (``gate_proj``, ``up_proj``, ``down_proj``; ``up_proj``, ``down_proj`` without a
gate). An MoE layer's ``mlp`` (router, routed and shared experts) is one operator. Norms, residual
adds, rotary and the MLP's activation are glue between operators, not operators: they run beside the
layer's hidden state (on the host for a split layer; ``executor.split_layer``).

Everything here is derived from the same :class:`ModelSpec` fields as ``costs.py`` and obeys its
conventions (one layer, one step, means over layers; 2 k n FLOPs per row of a k x n GEMM), so that
the operators' weights sum to the layer's linear weights (tests check it). Layouts the list cannot
describe (MLA's low-rank projections, parallel attention + MLP blocks) are refused by
:func:`why_not_split`.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexplan.workload.model import ModelSpec

LINEAR, ATTENTION, MLP = "linear", "attention", "mlp"


@dataclass(frozen=True)
class Operator:
    """One operator of a decoder layer, per row (token) of its input."""

    name: str
    kind: str  # LINEAR | ATTENTION (the core over the KV cache) | MLP (an MoE block as one unit)
    in_elems: int  # elements of its input per row
    out_elems: int  # elements of its output per row
    weight_params: float  # parameters it reads from its weights (an MoE block: all experts, mean over layers)
    flops_per_row: float  # 2 k n for a GEMM (the attention core: 0 here, it depends on the context)
    shares_input: bool = False  # reads the same tensor as the operator before it (k/v after q, up after gate)


def why_not_split(m: ModelSpec) -> str:
    """Why a layer of ``m`` cannot be cut into the operators below; "" when it can."""
    if m.kv_lora_rank:
        return "its MLA attention has low-rank projections the operator list does not describe"
    if m.parallel_block:
        return "its attention and MLP read the same input in parallel (no sequence to split)"
    return ""


def _moe_mlp(m: ModelSpec) -> tuple[float, float]:
    """(parameters, FLOPs per row) of the ``mlp`` operator of an MoE model, mean over layers (a dense
    layer of an MoE model counts its dense MLP)."""
    w = (3 if m.gated_mlp else 2) * m.hidden_size
    params = sum(m.mlp_params(i) for i in range(m.num_layers)) / m.num_layers
    active = []
    for i in range(m.num_layers):
        if m.moe_layers[i]:
            active.append(m.num_experts * m.hidden_size + w * m.experts_per_token * m.expert_intermediate_size
                          + w * m.shared_expert_intermediate_size + (m.hidden_size if m.shared_expert_gate else 0))
        else:
            active.append(w * m.intermediate_size)
    return float(params), 2.0 * sum(active) / m.num_layers


def layer_operators(m: ModelSpec) -> tuple[Operator, ...]:
    """The operators of one decoder layer of ``m``, in call order (see the module docstring)."""
    h, q, kv, v = m.hidden_size, m.q_dim, m.kv_dim, m.num_kv_heads * m.v_head_dim
    o_in = m.num_heads * m.v_head_dim
    b = 1 if m.qkv_bias else 0

    def lin(name, k, n, bias, shares=False):
        return Operator(name, LINEAR, k, n, float(k * n + (n if bias else 0)), 2.0 * k * n, shares)

    ops = [lin("q_proj", h, q, b), lin("k_proj", h, kv, b, True), lin("v_proj", h, v, b, True),
           Operator("attention", ATTENTION, q, o_in, 0.0, 0.0),
           lin("o_proj", o_in, h, m.o_bias)]
    if m.is_moe:
        params, flops = _moe_mlp(m)
        ops.append(Operator("mlp", MLP, h, h, params, flops))
    elif m.gated_mlp:
        i = m.intermediate_size
        ops += [lin("gate_proj", h, i, m.mlp_bias), lin("up_proj", h, i, m.mlp_bias, True),
                lin("down_proj", i, h, m.mlp_bias)]
    else:
        i = m.intermediate_size
        ops += [lin("up_proj", h, i, m.mlp_bias), lin("down_proj", i, h, m.mlp_bias)]
    return tuple(ops)
