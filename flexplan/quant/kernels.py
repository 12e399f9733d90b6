"""CPU linear layers on compressed weights: ``quant_gemv.c``, compiled, checked, optional.

``quant_gemv.c`` computes ``y = x W^T (+ bias)`` with W [out, in] in Q4_0 / Q4_1 / Q8_0 blocks as
a GGUF file holds them: the decode GEMV (one row of x) and the prefill GEMM (several rows, a tile
of 4 activation rows per decoded weight block, their dots reduced together), the activation quantised per 32-block to int8 as
llama.cpp does, integer dot products (AVX-512 VNNI / AVX-VNNI, else AVX2, else portable C, chosen
by ``-march=native``: :attr:`NativeQuant.isa` names it), OpenMP over output rows. A float-activation
path (``float_act=True``) dequantises exactly and sums in double: the reference the tests use.

It is compiled, cached and loaded exactly as the executor's native kernels are (the same
``flexplan.executor.native._load``: system compiler, ``-O3 -march=native -fopenmp``, the user
cache keyed by source, compiler and CPU flags, ``FLEXPLAN_NATIVE=0`` disables), and checked against
dequantise-then-float64 matmul before first use. When it is unavailable, :func:`linear` falls
back to dequantising (bit for bit as ``gguf``) and ``F.linear``.

What the int8 activation costs (the stated bound :data:`ACT_QUANT_REL_ERROR`, on the RMS error:
``rms(y - ref) / rms(ref)``, ref = dequantise-then-float64): <= 1e-2 for Gaussian activations.
Measured on all 210 linear weights of SmolLM2's Q4_1 file and of llama-quantize's Q4_0 and Q8_0
files from it, 4 Gaussian rows each: 5.3e-3 median, 6.0e-3 worst (theory: rounding noise of
max|x| / 127 / sqrt(12) per value, ~4.8e-3 of the RMS for a 32-block of Gaussians); the largest
error relative to max|ref| reached 1.6e-2. With 4 channels scaled x20 (outliers, as LLM hidden
states have), the RMS error reached 1.5e-2 and the max-relative one 3.6e-2: the block holding the
outlier quantises its other values coarsely.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import gguf
import numpy as np
import torch

from flexplan.errors import InvalidInputError
from flexplan.executor.native import _load
from flexplan.quant.formats import Q4_0, Q4_1, Q8_0, BlockFormat
from flexplan.quant.gguf_weights import QuantTensor

SOURCE = Path(__file__).with_name("quant_gemv.c")
NATIVE_FORMATS = {f.name: f for f in (Q4_0, Q4_1, Q8_0)}  # the blocks quant_gemv.c reads as they are
ACT_QUANT_REL_ERROR = 1e-2  # the stated bound of the int8 activation path (Gaussian x): rms(y - ref) / rms(ref)
FLOAT_ACT_REL_ERROR = 1e-6  # the float-activation path, max |y - ref| / max |ref|: one float32 rounding


class NativeQuant:
    """The loaded ``quant_gemv.c``: :meth:`gemm` and :meth:`dequantize` on raw blocks."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        lib.flexplan_quant_isa.restype = ctypes.c_char_p
        self.isa = lib.flexplan_quant_isa().decode()
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._gemm = lib.flexplan_quant_gemm
        self._gemm.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
        self._gemm.restype = ctypes.c_int
        self._dequantize = lib.flexplan_quant_dequantize
        self._dequantize.argtypes = [ptr, i64, ptr, i64, i64]
        self._dequantize.restype = ctypes.c_int
        self._list = lib.flexplan_quant_gemv_list
        self._list.argtypes = [i64] + [ptr] * 6
        self._list.restype = ctypes.c_int
        self._lib = lib  # keeps the library loaded

    def gemv_list(self, items: list[tuple[torch.Tensor, BlockFormat, torch.Tensor]]) -> GemvList:
        """Independent GEMVs (raw blocks [out, row_bytes], format, x [in] float32 contiguous) run
        in one native call by :meth:`GemvList.run`, each output as :meth:`gemm` gives it for one row."""
        return GemvList(self._list, items)

    def gemm(self, data: torch.Tensor, fmt: BlockFormat, x2d: torch.Tensor, bias: torch.Tensor | None = None,
             float_act: bool = False) -> torch.Tensor:
        """x2d [batch, in] float32 contiguous times W^T, W the raw blocks ``data`` [out, row_bytes]
        (uint8, contiguous) of a :data:`NATIVE_FORMATS` format; bias [out] float32 or None.
        Returns a new [batch, out] float32 tensor."""
        out, k = data.shape[0], x2d.shape[1]
        y = torch.empty(x2d.shape[0], out, dtype=torch.float32)
        rc = self._gemm(data.data_ptr(), fmt.ggml_type, x2d.data_ptr(), y.data_ptr(),
                        None if bias is None else bias.data_ptr(), out, k, x2d.shape[0], int(float_act))
        if rc == 2:
            raise MemoryError(f"quantised GEMM: out of memory for {x2d.shape[0]} quantised activation rows")
        if rc:
            raise InvalidInputError(f"quantised GEMM: {fmt.name} is not a kernel format or in={k} is not a "
                                    "multiple of 32")
        return y

    def dequantize(self, data: torch.Tensor, fmt: BlockFormat, in_features: int) -> torch.Tensor:
        """[out, in_features] float32 from the raw blocks, exactly as gguf's reference."""
        out = torch.empty(data.shape[0], in_features, dtype=torch.float32)
        if self._dequantize(data.data_ptr(), fmt.ggml_type, out.data_ptr(), data.shape[0], in_features):
            raise InvalidInputError(f"dequantise: {fmt.name} is not a kernel format or in={in_features} is not "
                                    "a multiple of 32")
        return out


class GemvList:
    """A fixed set of GEMVs on fixed input buffers: :meth:`run` computes every ``ys[i] = W_i x_i``
    in one parallel region (no Python call or thread fork per matrix; ``x`` may be refilled in place)."""

    def __init__(self, fn, items: list[tuple[torch.Tensor, BlockFormat, torch.Tensor]]):
        n = len(items)
        self.items = items
        self.ys = [torch.empty(w.shape[0], dtype=torch.float32) for w, _, _ in items]
        self._fn, self._n = fn, n
        self._args = ((ctypes.c_void_p * n)(*(w.data_ptr() for w, _, _ in items)),
                      (ctypes.c_int64 * n)(*(f.ggml_type for _, f, _ in items)),
                      (ctypes.c_void_p * n)(*(x.data_ptr() for _, _, x in items)),
                      (ctypes.c_void_p * n)(*(y.data_ptr() for y in self.ys)),
                      (ctypes.c_int64 * n)(*(w.shape[0] for w, _, _ in items)),
                      (ctypes.c_int64 * n)(*(x.numel() for _, _, x in items)))

    def run(self) -> list[torch.Tensor]:
        rc = self._fn(self._n, *self._args)
        if rc:
            raise (MemoryError if rc == 2 else InvalidInputError)(
                "quantised GEMV list: " + ("out of memory" if rc == 2 else "a format is not a kernel format or an "
                                           "input width is not a multiple of 32"))
        return self.ys


def quantize_reference(w: torch.Tensor, fmt: BlockFormat) -> QuantTensor:
    """float32 [out, in] to raw blocks with the ``gguf`` package's reference quantiser (numpy;
    seconds for tens of millions of weights): for tests, the self-check and benchmarks."""
    raw = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
    return QuantTensor("", torch.from_numpy(np.ascontiguousarray(raw)), tuple(w.shape), fmt)


def rms_rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``rms(y - ref) / rms(ref)`` in float64: the measure of :data:`ACT_QUANT_REL_ERROR`."""
    ref = ref.double()
    return float((y.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def _self_check(native: NativeQuant) -> None:
    """Each format on odd sizes (1, 4 and 7 rows of x: the tile and its remainder, with and without
    bias) against dequantise-then-float64 matmul: the C dequantiser bit for bit, the float path to
    :data:`FLOAT_ACT_REL_ERROR` (max norm), the int8 path to :data:`ACT_QUANT_REL_ERROR` (RMS);
    raises if one is off."""
    g = torch.Generator().manual_seed(0)
    for fmt in NATIVE_FORMATS.values():
        for out, k, batch, with_bias in ((13, 64, 1, True), (40, 96, 4, False), (9, 160, 7, True)):
            qt = quantize_reference(torch.randn(out, k, generator=g), fmt)
            w = qt.dequantize()
            if not torch.equal(native.dequantize(qt.data, fmt, k).view(torch.int32), w.view(torch.int32)):
                raise RuntimeError(f"self-check failed: {fmt.name} dequantisation differs from gguf's")
            x = torch.randn(batch, k, generator=g)
            b = torch.randn(out, generator=g) if with_bias else None
            ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
            for float_act, bound in ((True, FLOAT_ACT_REL_ERROR), (False, ACT_QUANT_REL_ERROR)):
                y = native.gemm(qt.data, fmt, x, b, float_act).double()
                err = float(rms_rel_error(y, ref) if not float_act else (y - ref).abs().max() / ref.abs().max())
                if not err < bound:
                    raise RuntimeError(f"self-check failed ({fmt.name}, float_act={float_act}): relative error "
                                       f"{err:.2e} at out={out} in={k} batch={batch}")


@functools.lru_cache(maxsize=None)
def status() -> tuple[NativeQuant | None, str]:
    """(the checked quantised kernels or None, a one-line reason)."""
    return _load("native quantised GEMV", "quant", (SOURCE,), NativeQuant, _self_check)


def linear(t: QuantTensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for W = ``t`` [out, in], x [..., in] float32: the native kernel on its
    formats (activation quantised per block), else dequantise (exact) + ``F.linear``."""
    native, _ = status()
    if native is None or t.format.name not in NATIVE_FORMATS or t.data.dim() != 2:
        return torch.nn.functional.linear(x.float(), t.dequantize(), bias)
    x2d = x.reshape(-1, x.shape[-1]).float().contiguous()
    y = native.gemm(t.data.contiguous(), t.format, x2d, None if bias is None else bias.float().contiguous())
    return y.reshape(*x.shape[:-1], t.shape[0])
