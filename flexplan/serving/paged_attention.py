"""Decode attention on the CPU read straight from a paged KV pool (``paged_attention.c``): one
query per request against the blocks its table names, no gathered copy of its past.

Compiled, cached and loaded as the executor's native kernels are (:mod:`flexplan.executor.native`:
the system C compiler on first use, keyed by the source and the CPU), and checked against
PyTorch's SDPA before first use; where anything fails (no compiler, ``FLEXPLAN_NATIVE=0``, a
failed check) :func:`status` says why and the model runner gathers the past and attends with
flexplan's strided decode kernel or SDPA instead.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from flexplan.executor import native

SOURCE = Path(__file__).with_name("paged_attention.c")
KV_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # pools the kernel reads: its suffix


class PagedDecode:
    """The loaded kernel (float32 queries and outputs; a float32 or bfloat16 pool)."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._fn = {}
        for dtype, name in KV_DTYPES.items():
            fn = getattr(lib, f"flexplan_paged_decode_{name}")
            fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr] + [i64] * 7 + [f32]
            fn.restype = ctypes.c_int
            self._fn[dtype] = fn

    def __call__(self, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, tables: torch.Tensor,
                 kv_len: torch.Tensor, kv_lo: torch.Tensor, block_size_tokens: int, scale: float) -> torch.Tensor:
        """softmax(q k^T * scale) v per request: q [n, hq, d] float32 contiguous; k_slots / v_slots
        one layer's pool ``[slots, kv_heads, d]`` (same strides, the last dimension contiguous);
        tables [n, max_blocks], kv_len and kv_lo [n], int64 contiguous. Returns [n, hq, d]."""
        n, hq, d = q.shape
        out = torch.empty_like(q)
        rc = self._fn[k_slots.dtype](q.data_ptr(), k_slots.data_ptr(), v_slots.data_ptr(), tables.data_ptr(),
                                     tables.shape[1], kv_len.data_ptr(), kv_lo.data_ptr(), out.data_ptr(), n, hq,
                                     k_slots.shape[1], d, block_size_tokens, k_slots.stride(0), k_slots.stride(1),
                                     scale)
        if rc != 0:
            raise MemoryError(f"paged decode attention could not allocate the partials of {n} requests")
        return out


def reference(q, k_slots, v_slots, tables, kv_len, kv_lo, block_size_tokens: int, scale: float) -> torch.Tensor:
    """The same attention by PyTorch's SDPA on a gathered past (what the self-check compares)."""
    outs = []
    for r in range(q.shape[0]):
        t = int(kv_len[r])
        slots = (tables[r][:, None] * block_size_tokens + torch.arange(block_size_tokens)).flatten()[:t]
        k, v = (s.index_select(0, slots).float().transpose(0, 1)[None] for s in (k_slots, v_slots))
        mask = (torch.arange(t) >= kv_lo[r])[None, None, None]
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[r][None, :, None], k, v, attn_mask=mask, scale=scale, enable_gqa=True)[0, :, 0])
    return torch.stack(outs)


def _self_check(ops: PagedDecode) -> None:
    """Grouped heads (6 query heads on 2), blocks of 4 in shuffled order, a partial last block,
    a window start and a one-key request, in both pool dtypes; raises if one is off by 1e-5."""
    g = torch.Generator().manual_seed(0)
    bs, blocks = 4, 12
    k, v = torch.randn(blocks * bs, 2, 8, generator=g), torch.randn(blocks * bs, 2, 8, generator=g)
    tables = torch.randperm(blocks, generator=g)[:9].view(3, 3)
    kv_len, kv_lo = torch.tensor([10, 1, 12]), torch.tensor([0, 0, 5])
    q = torch.randn(3, 6, 8, generator=g)
    for dtype in KV_DTYPES:
        ks, vs = k.to(dtype), v.to(dtype)
        ref = reference(q, ks, vs, tables, kv_len, kv_lo, bs, 0.3)
        err = float((ops(q, ks, vs, tables, kv_len, kv_lo, bs, 0.3) - ref).abs().max() / ref.abs().max())
        if not err < 1e-5:
            raise RuntimeError(f"self-check failed: relative error {err:.2e} ({dtype} pool)")


@functools.cache
def status() -> tuple[PagedDecode | None, str]:
    """(the checked kernel or None, a one-line reason)."""
    if not SOURCE.exists():
        return None, f"{SOURCE.name} is not installed beside {__name__}"
    return native._load("native paged attention", "paged", (SOURCE,), PagedDecode, _self_check)
