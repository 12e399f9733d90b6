"""``QuantLinear``: an ``nn.Linear`` stand-in that holds a GGUF tensor's raw blocks and runs the
native kernel on them (:mod:`flexplan.quant.kernels`: the GEMV for one row, the batched GEMM for a
prefill), never a float copy of the weight. An input on another device (an accelerator) is computed
there from the blocks dequantised by torch ops (:meth:`QuantLinear.forward_dequantised`; untested
on a GPU).

Formats without a kernel (the float types, Q2_K, Q3_K, the IQ types, ...: ``formats.DEQUANTISED_AT_LOAD``)
are dequantised once at construction into a float32 weight (:attr:`QuantLinear.dense`): the file
still loads, the line saying so is printed by the model loader, which knows the tensor's name.

``float_act``: False (the default) quantises the activation to int8 as llama.cpp does (per 32-block,
per 256-block for the K-quants); True dequantises exactly and sums in double: the reference path
the tests compare tokens with.
"""

from __future__ import annotations

import torch
from torch import nn

from flexplan.quant import fused_dequant, interleave, kernels
from flexplan.quant.activation_switch import FloatActivationSwitch
from flexplan.quant.gguf_weights import QuantTensor
from flexplan.quant.quant_experts import QuantExperts


class QuantLinear(FloatActivationSwitch, nn.Module):
    """``y = x W^T (+ bias)`` with W the raw blocks of ``qt`` ([out, in] in torch order)."""

    weight = None  # no float weight: code that asks (tied-head checks) sees none, not an AttributeError

    def __init__(self, qt: QuantTensor, bias: torch.Tensor | None = None, float_act: bool = False):
        super().__init__()
        if len(qt.shape) != 2:
            raise ValueError(f"{qt.name}: a linear weight is 2-D, not {qt.shape}")
        self.out_features, self.in_features = qt.shape
        self.format = qt.format  # the GGUF block format (the blocks are held below, not the QuantTensor:
        self.tensor_name = qt.name  # the executor re-places them and the file's copy is then freed)
        self._float_act = bool(float_act)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous(), persistent=False)
        # a kernel format runs on its blocks; anything else is dequantised once (exact, as gguf does)
        runs = kernels.status()[0] is not None and qt.format.name in kernels.NATIVE_FORMATS
        self.register_buffer("dense", None if runs else qt.dequantize().contiguous(), persistent=False)
        # the raw blocks [out, row bytes] uint8, a Parameter (never trained): the executor places them
        # as it places any weight, so pinned memory, the link and an accelerator hold the file's bytes;
        # interleaved for the CPU's kernels where they have that layout (the same bytes, 8 rows' blocks side by side)
        run = None if self.dense is not None else kernels.status()[0].x8_layout(qt.format)
        self.interleaved = run is not None and self.out_features >= interleave.GROUP_ROWS
        blocks = kernels.status()[0].x8_pack(qt.data, qt.format) if self.interleaved else qt.data.contiguous()
        self.blocks = nn.Parameter(blocks, requires_grad=False) if self.dense is None else None

    @property
    def native(self):
        """The quantised kernels (kernels.status: built once per process) where they read these
        blocks, else None; looked up, not held, so the module deep-copies (flexplan.load's own tree)."""
        return kernels.status()[0] if self.dense is None else None

    @property
    def nbytes(self) -> int:
        """Bytes of weight held: the raw blocks, or the float32 copy of a format without a kernel."""
        return self.blocks.numel() if self.dense is None else self.dense.numel() * 4

    def raw_blocks(self) -> tuple[torch.Tensor | None, int]:
        """(the raw blocks [out, row bytes] and the type id the kernels take for them: ggml's, flagged
        when interleaved) that the native decoder layer calls read (flexplan.executor.cpu_decode), or
        (None, 0) when no kernel reads them: a format dequantised at load, or blocks the executor
        placed off the CPU (an accelerator layer)."""
        if self.native is None or self.blocks.device.type != "cpu":
            return None, 0
        return self.blocks, kernels.wtype(self.format, self.interleaved)

    def file_blocks(self) -> torch.Tensor | None:
        """The blocks in the file's layout, on the blocks' device (a copy where they are interleaved);
        None for a format dequantised at load."""
        if self.dense is not None:
            return None
        return self._file_layout(self.blocks) if self.interleaved else self.blocks

    def _file_layout(self, blocks: torch.Tensor) -> torch.Tensor:
        """Interleaved ``blocks`` (on any device) back in the file's layout: natively on the host,
        by torch's indexed copy elsewhere."""
        native = kernels.status()[0]
        if blocks.device.type == "cpu":
            return native.x8_pack(blocks, self.format, unpack=True)
        return interleave.unpack(blocks, native.x8_layout(self.format))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or (self.dense is None and self.blocks.device.type != "cpu"):
            return self.forward_dequantised(x)  # the native kernels read host memory only
        if self.native is None:
            return nn.functional.linear(x.float(), self.dense, self.bias)
        x2d = x.reshape(-1, self.in_features).float().contiguous()
        y = self.native.gemm(self.blocks, self.format, x2d, self.bias, self.float_act, self.interleaved)
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_dequantised(self, x: torch.Tensor) -> torch.Tensor:
        """``y = x W^T (+ bias)`` on x's device and in x's dtype, W dequantised there from the blocks
        (:mod:`flexplan.quant.torch_dequant`'s torch ops, as gguf's reference, compiled into one kernel
        on CUDA by :mod:`flexplan.quant.fused_dequant`, whose rule says when): the path of an
        input on an accelerator, where the blocks are what crosses the link (the executor places
        them there: a resident layer's stay, a streamed layer's arrive in its slot; blocks held
        elsewhere are copied for the call). A format without a kernel uses its dequantised copy."""
        dtype = x.dtype if x.dtype.is_floating_point else torch.float32
        if self.dense is not None:
            w = self.dense.to(x.device, dtype)
        else:
            blocks = self.blocks.to(x.device, non_blocking=True)
            if self.interleaved:  # back to the file's layout, on the accelerator (a permutation of the bytes)
                blocks = self._file_layout(blocks)
            w = fused_dequant.dequantize(blocks, self.format.ggml_type, self.in_features, dtype)
        bias = None if self.bias is None else self.bias.to(x.device, dtype)
        return nn.functional.linear(x.to(dtype), w, bias)

    def extra_repr(self) -> str:
        how = "native" if self.native is not None else "dequantised at load"
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format.name} "
                f"({how}{', interleaved' if self.interleaved else ''}), float_act={self.float_act}")


def set_float_activation(model: nn.Module, on: bool) -> None:
    """Every QuantLinear and QuantExperts of ``model`` on the exact float-activation path (True) or
    llama.cpp's int8-activation path (False)."""
    for m in model.modules():
        if isinstance(m, (QuantLinear, QuantExperts)):
            m.float_act = on
