"""``QuantExperts``: a MoE layer's routed experts on a GGUF file's own blocks.

Routed experts are most of a MoE model's bytes (Qwen3-30B-A3B: 29 of its 30 B weights; Mixtral
8x7B: 45 of 47 B). Dequantised at load they take 4 bytes a weight, seven times a 4-bit file, so a
file that fits the machine as stored would not once loaded. ``QuantExperts`` replaces transformers'
experts module (its interface: ``experts(hidden_states, top_k_index, top_k_weights)``, each [tokens,
k]) and holds each projection's blocks as the file stores them, one matrix per expert, [experts,
rows, row bytes]: gate and up stacked on the rows in the order the replaced module's gate reads its
output (halves, or alternate rows where the converter split them so: gpt-oss).

For the tokens routed to each selected expert it computes ``x W_e^T (+ bias_e)`` with the quantised
kernels on the CPU (:meth:`~flexplan.quant.kernels.NativeQuant.gemm` on that expert's rows: the
activation quantised as llama.cpp does, or exactly with ``float_act``), or, where the blocks or the
input are on another device (an accelerator), with that expert's blocks dequantised there by torch
ops. Between the projections runs the replaced module's own ``_apply_gate`` (the module kept as a
child without its parameters), so Mixtral's and Qwen's SiLU gate and gpt-oss's clamped SwiGLU are
transformers' own; the routing weights and the sum over choices follow transformers' eager loop
(experts in ascending id, each expert's tokens in order, ``index_add_``).

Rule: where the gate is transformers' default SiLU(gate) * up and everything is on the host, the
whole layer is one native call (``native_decode.c``'s ``flexplan_quant_moe_silu``: routing, the same
quantised GEMMs per expert, SiLU within an ulp or two of torch's, the weighted scatter), since a
Python loop of small GEMMs and torch ops per selected expert costs more than the GEMMs themselves
(``benchmarks/bench_quant_experts.py``); ``fused = False`` keeps the loop.
"""

from __future__ import annotations

import torch
from torch import nn

from flexplan.executor import cpu_experts, native
from flexplan.executor.rebinds import note_rebind
from flexplan.quant import fused_dequant, interleave, kernels
from flexplan.quant.activation_switch import FloatActivationSwitch
from flexplan.quant.formats import BlockFormat

FUSED_PARAMETERS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def replaceable(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' fused experts a QuantExperts stands in for: gate_up and
    down (biases allowed) and nothing else of its own, its own ``_apply_gate`` between them, called
    as ``forward(hidden_states, top_k_index, top_k_weights)``."""
    params = {n for n, p in module._parameters.items() if p is not None}
    return ({"gate_up_proj", "down_proj"} <= params <= set(FUSED_PARAMETERS)
            and callable(getattr(module, "_apply_gate", None)) and cpu_experts.routed_interface(module))


def kernel_reads(fmt: BlockFormat) -> bool:
    """Whether the CPU's kernels read ``fmt``'s blocks here (else the experts are dequantised at load)."""
    return kernels.status()[0] is not None and fmt.name in kernels.NATIVE_FORMATS


class QuantExperts(FloatActivationSwitch, nn.Module):
    """Routed experts whose projections are raw blocks (see the module docstring)."""

    def __init__(self, gate: nn.Module, gate_up: tuple[torch.Tensor, BlockFormat], down: tuple[torch.Tensor, BlockFormat],
                 hidden: int, intermediate: int, gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, float_act: bool = False):
        """``gate``: the experts module replaced (its ``_apply_gate`` and whatever that reads; its
        parameters are dropped); ``gate_up`` and ``down``: (uint8 blocks [E, rows, row bytes] in the
        file's layout, their format), gate_up's rows the 2 x ``intermediate`` outputs the gate takes,
        down's the ``hidden`` ones; biases [E, rows] or None."""
        super().__init__()
        gate._parameters.clear()
        self.gate = gate
        self._float_act, self._fused = bool(float_act), True
        # fixed with the module: transformers' default SiLU gate (the one call computes it), kernel formats
        self._silu_gate = cpu_experts.default_silu_gate(gate)
        self._kernels = kernel_reads(gate_up[1]) and kernel_reads(down[1])
        self.num_experts, self.hidden, self.intermediate = gate_up[0].shape[0], hidden, intermediate
        quant = kernels.status()[0]
        for name, (blocks, fmt), bias in (("gate_up", gate_up, gate_up_bias), ("down", down, down_bias)):
            e, rows, row_bytes = blocks.shape
            run = quant.x8_layout(fmt) if kernel_reads(fmt) else None
            interleaved = run is not None and rows % interleave.GROUP_ROWS == 0
            flat = blocks.reshape(e * rows, row_bytes).contiguous()
            # packed 8 rows at a time: an expert's rows are whole groups, so each expert's slice is its own matrix
            packed = quant.x8_pack(flat, fmt) if interleaved else flat
            setattr(self, f"{name}_blocks", nn.Parameter(packed.view(e, rows, row_bytes), requires_grad=False))
            setattr(self, f"{name}_format", fmt)
            setattr(self, f"{name}_interleaved", interleaved)
            self.register_buffer(f"{name}_bias", None if bias is None else bias.float().contiguous(), persistent=False)

    @property
    def fused(self) -> bool:
        """Whether the layer runs in one native call where it applies (False: per expert, in Python;
        the native decoder layer then leaves the experts to this module)."""
        return self._fused

    @fused.setter
    def fused(self, value: bool) -> None:
        self._fused = bool(value)
        note_rebind()  # the native decode stack's checks of this layer (native_layout) are stale

    @property
    def nbytes(self) -> int:
        return self.gate_up_blocks.numel() + self.down_blocks.numel()

    def dequantized(self, name: str) -> torch.Tensor:
        """Projection ``name`` ("gate_up" or "down") of every expert, float32 [E, rows, in], as gguf
        dequantises the file's blocks (on the host)."""
        blocks, fmt = getattr(self, f"{name}_blocks"), getattr(self, f"{name}_format")
        e, rows, row_bytes = blocks.shape
        flat = blocks.detach().to("cpu").reshape(e * rows, row_bytes)
        if getattr(self, f"{name}_interleaved"):
            flat = kernels.status()[0].x8_pack(flat, fmt, unpack=True)
        in_features = self.hidden if name == "gate_up" else self.intermediate
        return fused_dequant.dequantize(flat, fmt.ggml_type, in_features, torch.float32).reshape(e, rows, in_features)

    def _project(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        blocks, fmt = getattr(self, f"{name}_blocks")[e], getattr(self, f"{name}_format")
        bias = getattr(self, f"{name}_bias")
        bias = None if bias is None else bias[e]
        interleaved = getattr(self, f"{name}_interleaved")
        in_features = self.hidden if name == "gate_up" else self.intermediate
        if self._native_here(x, blocks):
            x2d = x.reshape(-1, in_features).float().contiguous()
            return kernels.status()[0].gemm(blocks, fmt, x2d, bias, self.float_act, interleaved)
        # elsewhere: this expert's blocks dequantised on x's device (the file's layout first)
        blocks = blocks.to(x.device, non_blocking=True)
        if interleaved:
            blocks = interleave.unpack(blocks, kernels.status()[0].x8_layout(fmt))
        dtype = x.dtype if x.dtype.is_floating_point else torch.float32
        w = fused_dequant.dequantize(blocks, fmt.ggml_type, in_features, dtype)
        return nn.functional.linear(x.to(dtype), w, None if bias is None else bias.to(x.device, dtype))

    def _native_here(self, x: torch.Tensor, blocks: torch.Tensor) -> bool:
        """Whether the CPU's kernels compute on ``blocks`` for input ``x`` (both on the host, formats
        they read); else the blocks are dequantised on x's device."""
        return self._kernels and x.device.type == "cpu" and blocks.device.type == "cpu"

    def _one_call(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor | None:
        """The layer in one native call (NativeDecode.quant_moe_silu) where it applies: transformers'
        default SiLU gate, blocks and float32 input on the host, formats the kernels read; else None."""
        if not (self._silu_gate and x.dtype == torch.float32 and self._native_here(x, self.gate_up_blocks)):
            return None
        ops = native.decode_status()[0]
        if ops is None:
            return None
        bias = [None if b is None else b.contiguous() for b in (self.gate_up_bias, self.down_bias)]
        return ops.quant_moe_silu(
            self.gate_up_blocks, kernels.wtype(self.gate_up_format, self.gate_up_interleaved), self.down_blocks,
            kernels.wtype(self.down_format, self.down_interleaved), bias[0], bias[1],
            top_k_index.to(torch.int64).contiguous(), top_k_weights.float().contiguous(), x.contiguous(),
            self.intermediate, self.float_act)

    def native_layout(self) -> tuple | None:
        """(gate_up blocks, their kernel type, down blocks, their type, gate_up bias, down bias) as
        the native decoder layer's routed experts read them (``native_decode.c``'s moe_ffn), where the
        layer's one native call applies: transformers' default SiLU gate, formats the kernels read,
        blocks on the host, ``fused``; else None."""
        if not (self.fused and self._silu_gate and self._native_here(self.gate_up_blocks, self.down_blocks)):
            return None
        return (self.gate_up_blocks, kernels.wtype(self.gate_up_format, self.gate_up_interleaved), self.down_blocks,
                kernels.wtype(self.down_format, self.down_interleaved), self.gate_up_bias, self.down_bias)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = self._one_call(hidden_states, top_k_index, top_k_weights) if self.fused else None
        if out is not None:
            return out.to(hidden_states.dtype)
        out = torch.zeros_like(hidden_states)
        for e, tok, choice in cpu_experts.expert_rows(top_k_index, self.num_experts):  # eager's order
            h = self.gate._apply_gate(self._project("gate_up", e, hidden_states[tok]))
            h = self._project("down", e, h)
            h = h * top_k_weights[tok, choice, None]
            out.index_add_(0, tok, h.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, formats="
                f"{self.gate_up_format.name}/{self.down_format.name}, float_act={self.float_act}")
