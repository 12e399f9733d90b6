"""Dequantise GGUF blocks with plain torch ops, on whatever device holds them.

This is the GPU path of compressed weights: the PCIe link carries the file's bytes (a Q4_K
weight is 4.5 bits, not 16), and the GPU turns them into float weights with ordinary torch
element-wise ops, so no custom kernel is written or shipped. The same code runs on the CPU. Run
eagerly each op is its own kernel; :mod:`flexplan.quant.fused_dequant` compiles these same
functions into one kernel a format (what an accelerator's QuantLinear runs).

The rule: each format's function is the ``gguf`` package's numpy reference
(``gguf/quants.py``: ``Q4_0.dequantize_blocks`` ... ``Q6_K.dequantize_blocks`` and
``Q4_K.get_scale_min``) ported operation for operation: float16 fields are read as float16 and
converted to float32, integer fields are unpacked with exact bit ops, and the float32 products
and sums are taken in the same order, each its own op (no fused multiply-add). Every float op
is therefore correctly rounded in the same sequence, and the float32 result equals
``gguf.quants.dequantize`` bit for bit (tests/test_quant_torch_dequant.py checks it on the CPU,
and a CUDA run against the CPU run where a GPU exists). A cast to the requested dtype comes last.

Formats (ggml type ids): Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), MXFP4 (39) in 32-weight
blocks; Q4_K (12), Q5_K (13), Q6_K (14) in 256-weight super-blocks. Anything else, or a shape that is
not whole blocks, raises :class:`~flexplan.errors.InvalidInputError`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flexplan.errors import InvalidInputError
from flexplan.quant.formats import GGUF_FORMATS

QK_K = 256  # weights in a K-quant super-block


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 field at byte ``offset`` of each block, as float32 [n, 1]."""
    # a fresh contiguous copy: a dtype view needs an even storage offset and unit stride
    raw = blocks[:, offset:offset + 2].clone(memory_format=torch.contiguous_format)
    return raw.view(torch.float16).float()


def _shifts(values: list[int], like: torch.Tensor) -> torch.Tensor:
    """Shift amounts [1, 1, len(values), 1] on ``like``'s device and dtype, for broadcasting."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).reshape(1, 1, len(values), 1)


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """Low then high nibbles of each run of ``width`` bytes: [n, 2 * qs.shape[1]] uint8.

    ggml's order: in a run, byte j holds value j (low nibble) and value j + width (high nibble)."""
    n = qs.shape[0]
    q = qs.reshape(n, qs.shape[1] // width, 1, width) >> _shifts([0, 4], qs)
    return (q & 0x0F).reshape(n, 2 * qs.shape[1])


def _qh32(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's little-endian uint32 ``qh`` (4 bytes) as 32 bits, bit i for value i: [n, 32] uint8 of 0/1."""
    q = qh.reshape(qh.shape[0], 4, 1) >> _shifts(list(range(8)), qh).reshape(1, 1, 8)
    return (q & 0x01).reshape(qh.shape[0], 32)


def _bit_planes(qh: torch.Tensor) -> torch.Tensor:
    """Q5_K's 32 bytes ``qh``: value i of 256 is bit i // 32 of byte i % 32: [n, 256] uint8 of 0/1."""
    q = qh.reshape(qh.shape[0], 1, 1, 32) >> _shifts(list(range(8)), qh)
    return (q & 0x01).reshape(qh.shape[0], QK_K)


# --- the 32-weight blocks ------------------------------------------------------------------------

def _q4_0(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # block_q4_0: fp16 d, 16 bytes of nibbles; w = d * (q - 8)
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:], 16).to(torch.int8) - 8
    return (d * q.float()).to(dtype)


def _q4_1(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # block_q4_1: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:], 16).float()
    return ((d * q) + m).to(dtype)


def _q5_0(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # block_q5_0: fp16 d, uint32 qh (5th bits), 16 bytes of nibbles; w = d * (q - 16)
    d = _f16(blocks, 0)
    qh = _qh32(blocks[:, 2:6])
    ql = _nibbles(blocks[:, 6:], 16)
    q = (ql | (qh << 4)).to(torch.int8) - 16
    return (d * q.float()).to(dtype)


def _q5_1(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # block_q5_1: fp16 d, fp16 m, uint32 qh, 16 bytes of nibbles; w = d * q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    qh = _qh32(blocks[:, 4:8])
    ql = _nibbles(blocks[:, 8:], 16)
    q = (ql | (qh << 4)).float()
    return ((d * q) + m).to(dtype)


def _q8_0(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # block_q8_0: fp16 d, 32 int8; w = q * d (gguf's operand order)
    d = _f16(blocks, 0)
    x = blocks[:, 2:].view(torch.int8).float()
    return (x * d).to(dtype)


_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # E2M1, doubled (gguf's kvalues)


def _mxfp4(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # block_mxfp4: E8M0 e, 16 bytes of nibbles; w = d * K[q], d = 2^(e - 127) / 2 as float32 bits
    # (gguf's e8m0_to_fp32_half: e < 2 a subnormal 0x00200000 << e, else (e - 1) << 23)
    e = blocks[:, :1].to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    values = torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=blocks.device)
    q = values[_nibbles(blocks[:, 1:], 16).long()]
    return (d * q).to(dtype)


# --- the K-quants (256-weight super-blocks) ------------------------------------------------------

def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins: ([n, 8], [n, 8]) uint8 (gguf's get_scale_min).

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    s = scales.reshape(scales.shape[0], 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q45_k(blocks: torch.Tensor, fifth_bit: bool) -> torch.Tensor:
    # block_q4_K: fp16 d, fp16 dmin, 12 bytes scales, 128 bytes nibbles; block_q5_K the same with 32
    # bytes qh (each value's 5th bit) before the nibbles. 8 sub-blocks of 32: w = (d * sc) * q - (dmin * m)
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = _scale_min_k4(blocks[:, 4:16])
    d = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * m.float()).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 48:176], 32) | (_bit_planes(blocks[:, 16:48]) << 4) if fifth_bit \
        else _nibbles(blocks[:, 16:144], 32)
    return (d * q.reshape(n, 8, 32).float() - dm).reshape(n, QK_K)


def _q4_k(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _q45_k(blocks, fifth_bit=False).to(dtype)


def _q5_k(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _q45_k(blocks, fifth_bit=True).to(dtype)


def _q6_k(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # block_q6_K: 128 bytes ql (low 4 bits), 64 bytes qh (2 high bits each), 16 int8 scales, fp16 d;
    # w = (d * scale) * (q - 32) per sub-block of 16
    n = blocks.shape[0]
    scales = blocks[:, 192:208].view(torch.int8).float()
    d = _f16(blocks, 208)
    d = (d * scales).reshape(n, QK_K // 16, 1)
    ql = _nibbles(blocks[:, :128], 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], blocks)
    qh = (qh & 0x03).reshape(n, 256)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    q = q.reshape(n, QK_K // 16, 16).float()
    return (d * q).reshape(n, QK_K).to(dtype)


# ggml type id -> function of (uint8 blocks [n, block_bytes], dtype) giving [n, block_weights] of dtype,
# computed in float32 and cast last. One function (one code object) per format: torch.compile caches
# its compiled graphs per code object (flexplan.quant.fused_dequant), so formats never share a cache.
DEQUANTIZERS: dict[int, Callable[[torch.Tensor, torch.dtype], torch.Tensor]] = {
    2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 8: _q8_0, 12: _q4_k, 13: _q5_k, 14: _q6_k, 39: _mxfp4,
}
SUPPORTED = frozenset(DEQUANTIZERS)


def _supported_names() -> str:
    return ", ".join(f"{GGUF_FORMATS[t].name} ({t})" for t in sorted(SUPPORTED))


def as_blocks(data: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    """data: uint8 [rows, row_bytes] (rows of whole blocks, as a GGUF file stores a 2-D tensor in
    torch order [out, in]) of a :data:`SUPPORTED` type, checked, as blocks [rows x blocks a row,
    block_bytes] (a view where data is contiguous); anything else raises InvalidInputError."""
    ggml_type = int(ggml_type)
    if ggml_type not in DEQUANTIZERS:
        fmt = GGUF_FORMATS.get(ggml_type)
        name = fmt.name if fmt is not None else f"ggml type {ggml_type}"
        raise InvalidInputError(f"torch dequantisation does not handle {name}; it handles {_supported_names()} "
                                f"(dequantise other types at load with the gguf package)")
    fmt = GGUF_FORMATS[ggml_type]
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 2:
        got = f"{data.dtype} {tuple(data.shape)}" if isinstance(data, torch.Tensor) else type(data).__name__
        raise InvalidInputError(f"{fmt.name}: data must be a 2-D uint8 tensor [rows, row_bytes] of raw blocks, got {got}")
    if in_features <= 0 or in_features % fmt.block_weights:
        raise InvalidInputError(f"{fmt.name}: in_features={in_features} is not a positive multiple of its "
                                f"{fmt.block_weights}-weight block; use a multiple of {fmt.block_weights}")
    row_bytes = in_features // fmt.block_weights * fmt.block_bytes
    if data.shape[1] != row_bytes:
        raise InvalidInputError(f"{fmt.name}: rows of {data.shape[1]} bytes do not match in_features={in_features}; "
                                f"{in_features} weights take {row_bytes} bytes ({fmt.block_bytes} per "
                                f"{fmt.block_weights}-weight block)")
    return data.reshape(data.shape[0] * (row_bytes // fmt.block_bytes), fmt.block_bytes)


def dequantize(data: torch.Tensor, ggml_type: int, in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data: uint8 [rows, row_bytes] (:func:`as_blocks`), on any device; returns [rows, in_features]
    of dtype on data's device.

    Computed in float32 (bit for bit ``gguf.quants.dequantize``), then cast to ``dtype``."""
    blocks = as_blocks(data, ggml_type, in_features)
    if data.shape[0] == 0:
        return torch.empty(0, in_features, dtype=dtype, device=data.device)
    return DEQUANTIZERS[int(ggml_type)](blocks, dtype).reshape(data.shape[0], in_features)
