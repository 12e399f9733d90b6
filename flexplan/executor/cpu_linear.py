"""Packed weights for the linear layers the CPU computes: flexplan's blocked layout, or oneDNN's.

Decode on the CPU is a GEMV per weight matrix: it should stream the weights at memory bandwidth.
Stock ``F.linear`` does not: at batch 1 it reads an fp32 weight at about half the STREAM triad,
and less at batch 8, because its kernel is built for GEMMs rather than one long sequential read.
Two packed layouts, each REPLACING the dense weight (it is the ``weight`` Parameter of the
``nn.Linear``), so a CPU layer holds one copy:

- ``flexplan-blocked`` (the default where the native kernel builds, ``native``): weights with
  ``out`` a multiple of 64 are held as [out/64, in, 64] and computed in float32 by
  ``native_gemv.c``, one sequential stream per thread, for decode and prefill alike. They are
  float32, or bfloat16 / float16 when the model's weights are 16-bit and the CPU computes in
  float32 (``flexplan.hardware.spec.cpu_weight_dtype``): the kernel widens each weight as it reads
  it, so the result is the float32 one bit for bit at half the bytes. Other weights (bf16
  compute on AMX, odd shapes) take oneDNN's layout below.
- ``onednn-packed``: oneDNN's inner product on a weight reordered once into its layout
  (``torch.ops.mkldnn._reorder_linear_weight``, the kernel torch.compile's CPU freezing pass
  uses), an opaque tensor of the same shape; batch-1 decode plans use batch hint 1.

``python benchmarks/bench_cpu_linear.py`` measures both layouts against F.linear and the STREAM
triad (GB/s of weights at batch 1 and 8, GFLOP/s at 512 tokens).

Calling stock ``F.linear`` on a packed weight raises (a 3-D or an opaque tensor; it never
silently computes garbage); ``install`` gives each linear a forward that uses the kernel of its
weight's layout, so the same module also runs with dense weights on any device.

bf16 oneDNN results are bit-identical to ``F.linear`` (both are oneDNN); fp32 ones differ in the
last bits (other summation orders).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from flexplan.executor import native
from flexplan.executor.rebinds import note_rebind
from flexplan.memory import BLOCK, blocked_rows  # noqa: F401 - blocked_rows is part of this module's interface

KERNEL_BLOCKED = "flexplan-blocked"
KERNEL_PACKED = "onednn-packed"
KERNEL_PLAIN = "F.linear"
KERNELS = (KERNEL_BLOCKED, KERNEL_PACKED, KERNEL_PLAIN)
PACKING_KERNELS = (KERNEL_BLOCKED, KERNEL_PACKED)


@functools.lru_cache(maxsize=None)
def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build has oneDNN and the prepacked linear ops, and they work here for
    ``dtype`` (oneDNN's bf16/fp16 packing needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only
    CPU it raises, and such weights stay dense for F.linear)."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 8, dtype=dtype))
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), w, None, "none", [None], "")
        return bool(torch.allclose(y.float(), torch.full((2, 4), 8.0)))
    except Exception:  # noqa: BLE001 - any failure means: compute with F.linear
        return False


def blocking_available() -> bool:
    """Whether flexplan's native GEMV compiled and passed its check here (``native``)."""
    return native.available()


def default_kernel() -> str:
    if blocking_available():
        return KERNEL_BLOCKED
    return KERNEL_PACKED if packing_available() else KERNEL_PLAIN


def kernel_unavailable(kernel: str) -> str | None:
    """Why ``kernel`` cannot run here (None: it can)."""
    if kernel not in KERNELS:
        return f"unknown CPU linear kernel {kernel!r}; use one of {', '.join(KERNELS)}"
    if kernel == KERNEL_BLOCKED and not blocking_available():
        return f"{native.status()[1]}; use linear_kernel='{KERNEL_PACKED}' or '{KERNEL_PLAIN}'"
    if kernel == KERNEL_PACKED and not packing_available():
        return f"this torch build has no oneDNN prepacked linear; use linear_kernel='{KERNEL_PLAIN}'"
    return None


def pack_batch_hint(decode_batch: int) -> int | None:
    """The batch size oneDNN is told when it picks the packed layout: 1 for batch-1 decode, else
    none: the layout packed for batch 1 streams a batch-1 GEMV ~10% faster than the generic one,
    but slows batch 8 by about a third; bf16 barely differs (``benchmarks/bench_cpu_linear.py``)."""
    return 1 if int(decode_batch) == 1 else None


BLOCKED_WEIGHT_DTYPES = tuple(native.WEIGHT_TYPES)  # what native_gemv.c reads


def blockable(weight: torch.Tensor, compute_dtype: torch.dtype | None = None) -> bool:
    """An [out, in] weight with ``out`` a multiple of the native block (64) that the native GEMV
    computes as ``compute_dtype`` (default: the weight's) asks: float32, or 16-bit weights read
    into a float32 computation."""
    return _blockable(tuple(weight.shape), weight.dtype, compute_dtype or weight.dtype)


def _blockable(shape: tuple[int, ...], dtype: torch.dtype, compute_dtype: torch.dtype, padded: bool = False) -> bool:
    """``padded``: the last block may be zero-filled (a tied embedding's, :func:`pack_embedding`)."""
    return (len(shape) == 2 and (padded or shape[0] % BLOCK == 0) and compute_dtype == torch.float32
            and dtype in BLOCKED_WEIGHT_DTYPES)


def stored_dtype(shape: tuple[int, ...], weight_dtype: torch.dtype, compute_dtype: torch.dtype,
                 kernel: str | None, embedding: bool = False) -> torch.dtype:
    """The dtype :func:`pack` (``embedding``: :func:`pack_embedding`) gives a weight of ``shape``
    asked for in ``weight_dtype`` for a CPU computing in ``compute_dtype``: ``weight_dtype`` where
    the blocked kernel reads it, else the compute dtype (oneDNN and F.linear take one dtype)."""
    if (kernel == KERNEL_BLOCKED and blocking_available()
            and _blockable(tuple(shape), weight_dtype, compute_dtype, padded=embedding)):
        return weight_dtype
    return compute_dtype


def block(weight: torch.Tensor) -> torch.Tensor:
    """A dense [out, in] weight as [ceil(out/64), in, 64] (``P[k, i, c] = W[64 k + c, i]``, zero past
    ``out``), a new tensor."""
    out, k = weight.shape
    w = weight.detach()
    if blocked_rows(out) != out:
        w = F.pad(w, (0, 0, 0, blocked_rows(out) - out))
    return w.reshape(-1, BLOCK, k).transpose(1, 2).contiguous()


def is_blocked(t: torch.Tensor | None) -> bool:
    return t is not None and not t.is_mkldnn and t.dim() == 3


def layout_name(t: torch.Tensor) -> str:
    return "blocked" if is_blocked(t) else "oneDNN-packed" if t.is_mkldnn else "dense"


def pack(weight: torch.Tensor, batch_hint: int | None = None, kernel: str = KERNEL_PACKED,
         compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A dense [out, in] CPU weight in the layout ``kernel`` computes from, for a CPU computing
    in ``compute_dtype`` (default: the weight's dtype), a new tensor: blocked for
    ``flexplan-blocked`` where the weight is blockable (``out`` a multiple of 64; float32, or
    16-bit kept as it is for a float32 computation), else oneDNN's layout in the compute dtype,
    for the decode batch ``batch_hint`` (None: the generic one), or dense in the compute dtype
    where oneDNN cannot pack that dtype on this CPU."""
    compute = compute_dtype or weight.dtype
    with torch.no_grad():
        w = weight.detach().contiguous()
        if kernel == KERNEL_BLOCKED and blockable(w, compute) and blocking_available():
            return block(w)
        w = w.to(compute)
        if not packing_available(compute):
            return w
        if batch_hint:
            return torch.ops.mkldnn._reorder_linear_weight(w, int(batch_hint))
        return torch.ops.mkldnn._reorder_linear_weight(w)


def dense(t: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """The dense tensor behind ``t`` (a packed or blocked weight is reordered back, exactly; a
    blocked one to its first ``rows`` rows, past which its last block is zero-filled)."""
    if t.is_mkldnn:
        return t.to_dense()
    if is_blocked(t):
        return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1])[:rows]
    return t


def is_packed(t: torch.Tensor | None) -> bool:
    return t is not None and (t.is_mkldnn or is_blocked(t))


BF16_PAD_MAX_ROWS = 2  # a bf16 input of at most this many rows ...
BF16_PADDED_ROWS = 4  # ... is zero-padded to this many for oneDNN ...
BF16_PAD_MIN_WEIGHT_BYTES = 4 << 20  # ... where the weight holds at least this much


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's inner product on a packed weight. A bf16 ``x`` of up to ``BF16_PAD_MAX_ROWS`` rows is
    zero-padded to ``BF16_PADDED_ROWS`` for a weight of ``BF16_PAD_MIN_WEIGHT_BYTES`` or more: oneDNN
    takes a slower bf16 GEMV at 1-2 rows than at 3-6, so the padded call is 10-25% faster for
    weights of a few MB and up (``python benchmarks/bench_bf16_gemv_rows.py`` times both); a small
    weight costs as much either way and is left alone.
    Besides the speed, the cost then never falls as the batch grows, which the estimator's fits
    assume. The result is the unpadded one bit for bit (rows are independent)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (x.dtype != torch.bfloat16 or not 0 < rows <= BF16_PAD_MAX_ROWS
            or weight.shape[0] * weight.shape[1] * 2 < BF16_PAD_MIN_WEIGHT_BYTES):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")
    padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, BF16_PADDED_ROWS - rows))
    y = torch.ops.mkldnn._linear_pointwise(padded, weight, bias, "none", [None], "")[:rows]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   out_features: int | None = None) -> torch.Tensor:
    """``F.linear`` on a blocked weight with the native kernel (float32 ``x``, any token count:
    decode GEMVs and prefill GEMMs alike; the weight float32 or 16-bit, widened as it is read);
    ``torch.matmul`` on the blocks, in ``x``'s dtype, for anything else. ``out_features``: the
    weight's rows where its last block is zero-filled (the result keeps those columns)."""
    n_blocks, k, block_cols = weight.shape
    if out_features is not None and out_features < n_blocks * block_cols:
        y = blocked_linear(x, weight, None)[..., :out_features].contiguous()
        return y if bias is None else y.add_(bias)
    out = n_blocks * block_cols
    x2 = x.reshape(-1, k)
    gemv = native.status()[0]
    # float32 x; or a tied head blocked for a 16-bit CPU (_head_blockable): the float32 GEMV, cast back
    half_head = x2.dtype == weight.dtype and x2.dtype in (torch.bfloat16, torch.float16)
    if gemv is not None and (half_head or x2.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)):
        y = gemv.gemv(weight, x2.float().contiguous(), None if bias is None else bias.float().contiguous()).to(x2.dtype)
    else:
        y = torch.matmul(x2, weight.to(x2.dtype)).permute(1, 0, 2).reshape(x2.shape[0], out)
        if bias is not None:
            y.add_(bias)
    return y.reshape(*x.shape[:-1], out)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_features: int | None = None) -> torch.Tensor:
    """``F.linear`` for a weight in any of the layouts (oneDNN-packed, blocked or dense);
    ``out_features``: its rows (a blocked weight's last block may be zero-filled past them)."""
    if weight.is_mkldnn:
        return packed_linear(x, weight, bias)
    if weight.dim() == 3:
        return blocked_linear(x, weight, bias, out_features)
    return F.linear(x, weight, bias)


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias, module.out_features)


def pack_embedding(weight: torch.Tensor, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tied embedding / LM head weight [vocab, hidden] for the host, for a CPU computing in
    ``compute_dtype`` (default: the weight's dtype): blocked where it can be, the last block
    zero-filled past a vocabulary that is not a multiple of 64 (the head's GEMV then streams like
    the other linears and the lookup reads rows out of the blocks), else a dense copy in the compute
    dtype (oneDNN's opaque layout cannot be indexed for the lookup)."""
    compute = compute_dtype or weight.dtype
    with torch.no_grad():
        w = weight.detach().contiguous()
        if embedding_blockable(tuple(w.shape), w.dtype, compute):
            return block(w)
        return w.to(compute, copy=True)


def embedding_blockable(shape: tuple[int, ...], dtype: torch.dtype, compute_dtype: torch.dtype) -> bool:
    """Whether :func:`pack_embedding` blocks a tied weight of ``shape`` held in ``dtype`` for a CPU
    computing in ``compute_dtype`` (any vocabulary: the last block is zero-filled)."""
    return blocking_available() and (_blockable(tuple(shape), dtype, compute_dtype, padded=True)
                                     or _head_blockable(tuple(shape), dtype, compute_dtype))


def _head_blockable(shape: tuple[int, ...], dtype: torch.dtype, compute_dtype: torch.dtype) -> bool:
    """A tied head's 16-bit weight for a CPU computing in that 16-bit dtype: blocked too, the native
    kernel reading it into a float32 GEMV whose result is cast back (:func:`blocked_linear`; the
    lookup's rows likewise, :func:`embedding_rows`). Left dense, such a head runs as a dense bf16
    ``aten::mm``, which streams it at a fraction of the bandwidth the calibrated GEMV prices."""
    return (compute_dtype in (torch.bfloat16, torch.float16) and dtype == compute_dtype
            and _blockable(tuple(shape), dtype, torch.float32, padded=True))


def embedding_rows(ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``F.embedding(ids, W)`` for W in the blocked layout: row r is ``P[r // 64, :, r % 64]``,
    in ``dtype``, what the CPU computes in (float32 where it holds 16-bit blocked weights for a
    float32 computation; the 16-bit dtype itself for a tied head blocked for a 16-bit CPU)."""
    block_cols = weight.shape[2]
    return weight.permute(0, 2, 1)[torch.div(ids, block_cols, rounding_mode="floor"), ids % block_cols].to(dtype)


ROWS_DTYPE_ATTR = "_flexplan_rows_dtype"  # set on a blocked embedding: the dtype its lookups return


class _BlockedLookup(torch.overrides.TorchFunctionMode):
    """Answers ``F.embedding`` on one blocked weight with :func:`embedding_rows`, for an embedding
    subclass's own forward (Gemma's scaled embedding: ``super().forward(ids) * embed_scale``)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.weight, self.dtype = weight, dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and (args[1] if len(args) > 1 else kwargs.get("weight")) is self.weight:
            return embedding_rows(args[0] if args else kwargs["input"], self.weight, self.dtype)
        return func(*args, **kwargs)


def _embedding_forward(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """The module's own forward (its class's: a subclass may scale the rows), its lookups read out
    of the blocks where the weight is blocked."""
    if not is_blocked(module.weight):
        return type(module).forward(module, ids)
    dtype = getattr(module, ROWS_DTYPE_ATTR, torch.float32)
    if type(module).forward is nn.Embedding.forward:
        return embedding_rows(ids, module.weight, dtype)
    with _BlockedLookup(module.weight, dtype):
        return type(module).forward(module, ids)


def install_embedding(module: nn.Embedding) -> None:
    """Let ``module`` look rows up in a blocked weight (an instance-level forward)."""
    module.forward = functools.partial(_embedding_forward, module)


def packable(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` (subclasses such as quantised linears keep their own forward)."""
    return type(module) is nn.Linear


def install(module: nn.Linear) -> None:
    """Let ``module`` compute from a packed weight (an instance-level forward)."""
    module.forward = functools.partial(_forward, module)


def uninstall(module: nn.Linear) -> None:
    module.__dict__.pop("forward", None)


def pack_module(root: nn.Module, batch_hint: int | None = None, kernel: str = KERNEL_PACKED) -> int:
    """Pack every plain CPU linear under ``root`` in place for ``kernel`` (its weight replaced;
    one packed for another hint or kernel is repacked); the count packed. For code that owns a
    CPU-only module outright (calibration's layers)."""
    n = 0
    for m in root.modules():
        if not packable(m) or m.weight.device.type != "cpu":
            continue
        if is_packed(m.weight) and getattr(m, "_flexplan_pack_key", None) == (kernel, batch_hint):
            continue
        install(m)
        m._parameters["weight"] = nn.Parameter(pack(dense(m.weight, m.out_features), batch_hint, kernel),
                                               requires_grad=False)
        m._flexplan_pack_key = (kernel, batch_hint)
        n += 1
    if n:
        note_rebind()
    return n


class LinearKernel:
    """``F.linear`` with the CPU executor's kernel, for benchmarks: ``prepare(w, batch)`` turns
    a dense weight into what ``__call__`` takes (packed for that decode batch, or as is)."""

    def __init__(self, kernel: str | None = None, device: str = "cpu"):
        self.name = KERNEL_PLAIN if device != "cpu" else (kernel or default_kernel())

    @property
    def packed(self) -> bool:
        return self.name in PACKING_KERNELS

    def prepare(self, weight: torch.Tensor, batch: int = 1) -> torch.Tensor:
        return pack(weight, pack_batch_hint(batch), self.name) if self.packed else weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return linear(x, weight)


class TiedHeadKernel(LinearKernel):
    """A tied embedding / LM head as the executor holds it (:func:`pack_embedding`), for benchmarks:
    on a CPU computing in 16 bits it is blocked in that dtype and read by the native float32 GEMV
    (:func:`_head_blockable`), where an untied head of the same shape is oneDNN-packed. The two
    kernels stream differently (which is faster depends on the rows), so calibration times both."""

    def __init__(self):
        super().__init__(kernel="tied-head")

    @staticmethod
    def differs(weight: torch.Tensor) -> bool:
        """Whether a tied head of this weight (in the dtype the CPU computes in) runs another
        kernel than an untied one."""
        return blocking_available() and _head_blockable(tuple(weight.shape), weight.dtype, weight.dtype)

    def prepare(self, weight: torch.Tensor, batch: int = 1) -> torch.Tensor:
        return pack_embedding(weight, weight.dtype)
