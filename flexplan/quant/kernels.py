"""CPU linear layers on compressed weights: ``quant_gemv.c`` + ``quant_kquants.c``, compiled, checked, optional.

The library computes ``y = x W^T (+ bias)`` with W [out, in] in the blocks a GGUF file holds
(:data:`NATIVE_FORMATS`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 in 32-weight blocks, ``quant_gemv.c``; Q4_K,
Q5_K, Q6_K in 256-weight super-blocks, ``quant_kquants.c``): the decode GEMV (one row of x) and
the prefill GEMM (several rows, a tile of 4 activation rows per decoded weight block), on the
file's layout or, with AVX2, on 8 rows' blocks interleaved (:meth:`NativeQuant.x8_layout`,
:mod:`flexplan.quant.interleave`: what QuantLinear holds where it can; each row's result the same
whatever the batch), the
activation quantised to int8 as llama.cpp does (per 32-block for the 32-blocks, Q8_0's rule; per
256-block with sums of each 16 for the K-quants, Q8_K's), integer dot products (the 32-blocks:
AVX-512 VNNI / AVX-VNNI, else AVX2, else portable C; the K-quants: AVX2 on any of those, else
portable C; chosen by ``-march=native``: :attr:`NativeQuant.isa` names it), OpenMP over output rows.
A float-activation path (``float_act=True``) dequantises exactly and sums in double: the
reference the tests use.

It is compiled, cached and loaded exactly as the executor's native kernels are (the same
``flexplan.executor.native._load``: system compiler, ``-O3 -march=native -fopenmp``, the user
cache keyed by source, compiler and CPU flags, ``FLEXPLAN_NATIVE=0`` disables), and checked before
first use (:func:`_self_check`: every format's dequantiser bit for bit as gguf's, both paths against
float64). When it is unavailable, :func:`linear` falls back to dequantising (bit for bit as
``gguf``) and ``F.linear``.

What the int8 activation costs (the stated bound :data:`ACT_QUANT_REL_ERROR`, on the RMS error:
``rms(y - ref) / rms(ref)``, ref = dequantise-then-float64, over a sample of activation rows):
<= 1e-2 for Gaussian activations. Theory: rounding noise of max|x| / 127 / sqrt(12) per value,
~4.8e-3 of the RMS for a 32-block of Gaussians, ~6.6e-3 for the K-quants' 256-blocks (their max|x|
is larger). Outlier channels coarsen the block that holds them (256 values in a K-quant, 32
otherwise), and one row's error rests on its few blocks' maxima: the bound holds over several rows.
The measured figures are in the commit history (affb4b6, 775fb05) and tests/test_quant_kernels.py.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import gguf
import numpy as np
import torch

from flexplan.errors import InvalidInputError
from flexplan.executor.native import _load
from flexplan.quant import interleave
from flexplan.quant.formats import GGUF_FORMATS, BlockFormat
from flexplan.quant.gguf_weights import QuantTensor

SOURCES = (Path(__file__).with_name("quant_gemv.c"), Path(__file__).with_name("quant_kquants.c"))  # one library
NATIVE_FORMATS = {f.name: f for f in GGUF_FORMATS.values() if f.native_kernel}  # the blocks the kernels read as they are
# where each kernel format's block keeps its float16 fields (ggml-common.h): every other bit pattern is a value
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,), "MXFP4": ()}
ACT_QUANT_REL_ERROR = 1e-2  # the stated bound of the int8 activation path (Gaussian x): rms(y - ref) / rms(ref)
FLOAT_ACT_REL_ERROR = 1e-6  # the float-activation path, max |y - ref| / max |ref|: one float32 rounding
# the int8 path against float64 of the same quantised activation (int8_activation_reference), max norm:
# the integer dots are exact, only the float32 scaling and sums round
INT8_PATH_REL_ERROR = 1e-5
X8_MAX_RUN_BYTES = 8 * 210  # quant_gemv.c's X8_MAX_RUN: the longest interleaved run, 8 Q6_K super-blocks


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
        self._list.argtypes = [i64] + [ptr] * 7
        self._list.restype = ctypes.c_int
        self._shared = lib.flexplan_quant_gemv_shared
        self._shared.argtypes = [i64, ptr, ptr, ptr, i64, ptr, ptr, ptr]
        self._shared.restype = ctypes.c_int
        self._x8_layout = lib.flexplan_quant_x8_layout
        self._x8_layout.argtypes = [i64, ptr]
        self._x8_layout.restype = i64
        self._x8_pack = lib.flexplan_quant_x8_pack
        self._x8_pack.argtypes = [ptr, ptr, i64, i64, i64, i64]
        self._x8_pack.restype = ctypes.c_int
        self._lib = lib  # keeps the library loaded

    @functools.lru_cache(maxsize=None)
    def x8_layout(self, fmt: BlockFormat) -> torch.Tensor | None:
        """The interleaved layout's run for ``fmt`` (:mod:`flexplan.quant.interleave`: int64 [8 *
        block bytes], byte j of a group's run is byte src[j] of its 8 rows' blocks end to end), or None
        where this build has no interleaved kernel for the format (then its blocks stay as the file holds them)."""
        src = (ctypes.c_int32 * X8_MAX_RUN_BYTES)()
        n = self._x8_layout(fmt.ggml_type, src) if fmt.ggml_type is not None else 0
        return torch.tensor(src[:n], dtype=torch.int64) if n else None

    def x8_pack(self, data: torch.Tensor, fmt: BlockFormat, unpack: bool = False) -> torch.Tensor:
        """Host blocks [out, row bytes] in the interleaved layout (or, ``unpack``, back in the file's;
        :mod:`flexplan.quant.interleave` unpacks on other devices): the layout's pieces copied whole,
        in parallel (a loader packs a whole model)."""
        data = data.contiguous()
        out = torch.empty_like(data)
        if self._x8_pack(data.data_ptr(), out.data_ptr(), fmt.ggml_type, data.shape[0], data.shape[1], int(unpack)):
            raise InvalidInputError(f"{fmt.name} has no interleaved layout here, or its rows are not whole blocks")
        return out

    def gemv_list(self, items: list[tuple[torch.Tensor, BlockFormat, torch.Tensor]]) -> GemvList:
        """Independent GEMVs (raw blocks [out, row_bytes], format, x [in] float32 contiguous) run
        in one native call by :meth:`GemvList.run`, each output as :meth:`gemm` gives it for one row."""
        return GemvList(self._list, items)

    def gemv_shared(self, items: list[tuple[torch.Tensor, BlockFormat, torch.Tensor | None]],
                    x: torch.Tensor, interleaved: bool = False) -> list[torch.Tensor]:
        """GEMVs of several matrices (raw blocks [out, row_bytes], format, bias [out] or None) on one
        input x [in] (float32, contiguous) in one native call, x quantised once per activation kind:
        what the native decoder layer runs for q/k/v and gate/up (all ``interleaved`` or none). Each
        output as :meth:`gemm` gives it for one row."""
        n = len(items)
        ys = [torch.empty(w.shape[0], dtype=torch.float32) for w, _, _ in items]
        rc = self._shared(n, (ctypes.c_void_p * n)(*(w.data_ptr() for w, _, _ in items)),
                          (ctypes.c_int64 * n)(*(wtype(f, interleaved) for _, f, _ in items)), x.data_ptr(), x.numel(),
                          (ctypes.c_void_p * n)(*(y.data_ptr() for y in ys)),
                          (ctypes.c_void_p * n)(*(None if b is None else b.data_ptr() for _, _, b in items)),
                          (ctypes.c_int64 * n)(*(w.shape[0] for w, _, _ in items)))
        if rc:
            raise (MemoryError if rc == 2 else InvalidInputError)(
                "quantised shared-input GEMVs: " + ("out of memory" if rc == 2 else "a format is not a kernel "
                                                    "format or the input width is not a multiple of its blocks"))
        return ys

    def gemm(self, data: torch.Tensor, fmt: BlockFormat, x2d: torch.Tensor, bias: torch.Tensor | None = None,
             float_act: bool = False, interleaved: bool = False, y: torch.Tensor | None = None) -> torch.Tensor:
        """x2d [batch, in] float32 contiguous times W^T, W the raw blocks ``data`` [out, row_bytes]
        (uint8, contiguous) of a :data:`NATIVE_FORMATS` format, in the file's layout or (``interleaved``)
        :mod:`~flexplan.quant.interleave`'s; bias [out] float32 or None. Returns y: a new [batch, out]
        float32 tensor, or the one given (contiguous, that shape: the caller's, written over)."""
        out, k = data.shape[0], x2d.shape[1]
        if y is None:
            y = torch.empty(x2d.shape[0], out, dtype=torch.float32)
        elif y.shape != (x2d.shape[0], out) or y.dtype != torch.float32 or not y.is_contiguous() or y.device.type != "cpu":
            raise InvalidInputError(f"quantised GEMM: the output given is {tuple(y.shape)} {y.dtype} on {y.device}"
                                    f"{'' if y.is_contiguous() else ', not contiguous'}; it takes a contiguous "
                                    f"float32 [{x2d.shape[0]}, {out}] tensor on the CPU")
        rc = self._gemm(data.data_ptr(), wtype(fmt, interleaved), x2d.data_ptr(), y.data_ptr(),
                        None if bias is None else bias.data_ptr(), out, k, x2d.shape[0], int(float_act))
        if rc == 2:
            raise MemoryError(f"quantised GEMM: out of memory for {x2d.shape[0]} quantised activation rows")
        if rc:
            raise InvalidInputError(f"quantised GEMM: {fmt.name} is not a kernel format or in={k} is not a "
                                    f"multiple of its {fmt.block_weights}-weight blocks")
        return y

    def dequantize(self, data: torch.Tensor, fmt: BlockFormat, in_features: int, interleaved: bool = False) -> torch.Tensor:
        """[out, in_features] float32 from the raw blocks (the file's layout, or ``interleaved``),
        exactly as gguf's reference."""
        out = torch.empty(data.shape[0], in_features, dtype=torch.float32)
        if self._dequantize(data.data_ptr(), wtype(fmt, interleaved), out.data_ptr(), data.shape[0], in_features):
            raise InvalidInputError(f"dequantise: {fmt.name} is not a kernel format or in={in_features} is not "
                                    f"a multiple of its {fmt.block_weights}-weight blocks")
        return out


def wtype(fmt: BlockFormat, interleaved: bool = False) -> int:
    """The type id the kernels take: ggml's, with :data:`~flexplan.quant.interleave.X8_FLAG` for the interleaved layout."""
    return fmt.ggml_type | (interleave.X8_FLAG if interleaved else 0)


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
                      (ctypes.c_int64 * n)(*(x.numel() for _, _, x in items)), None)

    def run(self) -> list[torch.Tensor]:
        rc = self._fn(self._n, *self._args)
        if rc:
            raise (MemoryError if rc == 2 else InvalidInputError)(
                "quantised GEMV list: " + ("out of memory" if rc == 2 else "a format is not a kernel format or an "
                                           "input width is not a multiple of its format's blocks"))
        return self.ys


def quantize_reference(w: torch.Tensor, fmt: BlockFormat) -> QuantTensor:
    """float32 [out, in] to raw blocks with the ``gguf`` package's reference quantiser (numpy;
    seconds for tens of millions of weights): for tests, the self-check and benchmarks. gguf has
    none for the K-quants: :func:`random_blocks` (or llama-quantize) makes those."""
    raw = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
    return QuantTensor("", torch.from_numpy(np.ascontiguousarray(raw)), tuple(w.shape), fmt)


def random_blocks(fmt: BlockFormat, out: int, in_features: int, generator: torch.Generator | None = None,
                  scale: float = 1e-2) -> QuantTensor:
    """[out, in_features] raw blocks of ``fmt`` (a :data:`NATIVE_FORMATS` format): uniform random
    bytes, every float16 field (:data:`FP16_FIELDS`: scales, minimums) uniform in [-scale, scale]
    (subnormals included), MXFP4's exponent such that its weights stay within about ``scale``: valid
    blocks whatever the bytes, for the tests, the self-check and the
    benchmarks of formats gguf cannot quantise."""
    blocks = out * fmt.row_bytes(in_features) // fmt.block_bytes
    raw = torch.randint(0, 256, (blocks, fmt.block_bytes), dtype=torch.uint8, generator=generator)
    for offset in FP16_FIELDS[fmt.name]:
        value = ((torch.rand(blocks, generator=generator) * 2 - 1) * scale).half()
        raw[:, offset:offset + 2] = value.view(torch.uint8).reshape(blocks, 2)
    if fmt.name == "MXFP4":  # its E8M0 exponent: a block's largest weight (6 x 2^(e - 127)) up to ~scale
        top = 127 + int(math.floor(math.log2(scale / 6)))
        raw[:, 0] = torch.randint(top - 3, top + 1, (blocks,), dtype=torch.uint8, generator=generator)
    return QuantTensor("", raw.reshape(out, -1), (out, in_features), fmt)


def test_blocks(fmt: BlockFormat, out: int, in_features: int, generator: torch.Generator | None = None) -> QuantTensor:
    """Gaussian weights quantised by gguf where it can (the 32-blocks), random blocks otherwise (the K-quants)."""
    if fmt.block_weights == 256:
        return random_blocks(fmt, out, in_features, generator)
    return quantize_reference(torch.randn(out, in_features, generator=generator), fmt)


def _activation_blocks(x: torch.Tensor, block_weights: int):
    """(q, id, amax) of x [rows, in] per block as the kernels quantise it, llama.cpp's rule (its x86
    and ARM quantisers): id = 127 / max|x| in one float32 rounding, q = x * id (float32) rounded to
    nearest, ties to even; float64 q, [rows, blocks, block_weights]."""
    xb = x.float().reshape(x.shape[0], -1, block_weights)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax == 0, torch.zeros_like(amax), 127 / amax)
    return torch.round((xb * inv).double()), inv, amax  # torch.round: half to even


def quantized_activation(x: torch.Tensor, block_weights: int) -> torch.Tensor:
    """float64 values d * q the kernels' int8 activation holds for x [rows, in]: per block of
    ``block_weights`` (32: Q8_0's blocks, d = max|x| / 127 rounded to float16; 256: Q8_K's, d = 1 / id
    in float32), q as :func:`_activation_blocks` rounds it."""
    q, inv, amax = _activation_blocks(x, block_weights)
    if block_weights == 256:
        d = torch.where(amax == 0, torch.zeros_like(amax), 1 / inv)
    else:
        d = (amax / 127).half()
    return (q * d.double()).reshape(x.shape)


def int8_activation_reference(t: QuantTensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``x W^T (+ bias)`` with x quantised as the kernels quantise it and W dequantised exactly:
    what the int8 path computes, up to float32 rounding (:data:`INT8_PATH_REL_ERROR`). Q4_1 / Q5_1
    take their minimum times Q8_1's s, fp16(d sum q), as llama.cpp does, not d16 sum q."""
    bw = t.format.block_weights
    y = quantized_activation(x, bw) @ t.dequantize().double().t()
    if t.format.name in ("Q4_1", "Q5_1"):
        q, _, amax = _activation_blocks(x, bw)
        sums = q.sum(-1, keepdim=True)
        d = amax / 127
        s = (d * sums.float()).half().double()  # float32 product, then float16
        delta = (s - d.half().double() * sums)[..., 0]  # [rows, blocks]
        m = t.data.reshape(t.shape[0], -1, t.format.block_bytes)[..., 2:4].contiguous().view(torch.float16)
        y = y + delta @ m[..., 0].double().t()
    return y if bias is None else y + bias.double()


def rms_rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``rms(y - ref) / rms(ref)`` in float64: the measure of :data:`ACT_QUANT_REL_ERROR`."""
    ref = ref.double()
    return float((y.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def _self_check(native: NativeQuant) -> None:
    """Each format on odd sizes (1, 4 and 7 rows of x: the tile and its remainder, with and without
    bias): the C dequantiser bit for bit as gguf's, the float path to :data:`FLOAT_ACT_REL_ERROR` of
    dequantise-then-float64 matmul, the int8 path to :data:`INT8_PATH_REL_ERROR` of the same with x
    quantised as the kernel does (:func:`int8_activation_reference`; the error the quantisation
    itself adds is statistical, checked by the tests on larger samples); raises if one is off."""
    g = torch.Generator().manual_seed(0)
    for fmt in NATIVE_FORMATS.values():
        for out, blocks, batch, with_bias in ((13, 2, 1, True), (40, 3, 4, False), (9, 5, 7, True)):
            k = blocks * fmt.block_weights
            qt = test_blocks(fmt, out, k, g)
            w = qt.dequantize()
            if not torch.equal(native.dequantize(qt.data, fmt, k).view(torch.int32), w.view(torch.int32)):
                raise RuntimeError(f"self-check failed: {fmt.name} dequantisation differs from gguf's")
            x = torch.randn(batch, k, generator=g)
            b = torch.randn(out, generator=g) if with_bias else None
            ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
            run = native.x8_layout(fmt)
            layouts = [(qt.data, False)] + ([] if run is None else [(native.x8_pack(qt.data, fmt), True)])
            if run is not None and not torch.equal(native.dequantize(layouts[1][0], fmt, k, True).view(torch.int32),
                                                   w.view(torch.int32)):
                raise RuntimeError(f"self-check failed: {fmt.name} interleaved dequantisation differs from gguf's")
            for float_act, bound in ((True, FLOAT_ACT_REL_ERROR), (False, INT8_PATH_REL_ERROR)):
                if not float_act:
                    ref = int8_activation_reference(qt, x, b)
                for data, interleaved in layouts:
                    y = native.gemm(data, fmt, x, b, float_act, interleaved).double()
                    err = float((y - ref).abs().max() / ref.abs().max())
                    if not err < bound:
                        raise RuntimeError(f"self-check failed ({fmt.name}, float_act={float_act}, interleaved="
                                           f"{interleaved}): relative error {err:.2e} at out={out} in={k} batch={batch}")


@functools.lru_cache(maxsize=None)
def status() -> tuple[NativeQuant | None, str]:
    """(the checked quantised kernels or None, a one-line reason)."""
    return _load("native quantised GEMV", "quant", SOURCES, NativeQuant, _self_check)


def linear(t: QuantTensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for W = ``t`` [out, in], x [..., in] float32: the native kernel on its
    formats (activation quantised per block), else dequantise (exact) + ``F.linear``."""
    native, _ = status()
    if native is None or t.format.name not in NATIVE_FORMATS or t.data.dim() != 2:
        return torch.nn.functional.linear(x.float(), t.dequantize(), bias)
    x2d = x.reshape(-1, x.shape[-1]).float().contiguous()
    y = native.gemm(t.data.contiguous(), t.format, x2d, None if bias is None else bias.float().contiguous())
    return y.reshape(*x.shape[:-1], t.shape[0])
