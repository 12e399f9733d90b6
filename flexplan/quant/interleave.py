"""The CPU's interleaved layout of a matrix's blocks (``quant_gemv.c``'s X8), back to the file's on any device.

The GEMV on the file's layout decodes one row's block at a time and is bound by its own arithmetic
on AVX2 cores; interleaved, one step decodes 8 rows' block b and scales their 8 dots as one vector.
``quant_gemv.c`` states the layout (``flexplan_quant_x8_layout``: which byte of the 8 rows' blocks
each byte of a group's run holds), reads it, and packs host matrices into it
(:meth:`flexplan.quant.kernels.NativeQuant.x8_pack`). Here the inverse permutation runs with torch
ops, where the blocks are on a device the native code cannot read (an accelerator dequantising
them: :func:`unpack`). Rows past the last group of 8 keep the file's layout, so a packed matrix
has the shape and bytes of the file's, each row's bytes in its own offset range, 8 rows at a time.
"""
from __future__ import annotations

import torch

X8_FLAG = 0x100  # quant_gemv.c's X8: a ggml type id with it names the interleaved layout of that format
GROUP_ROWS = 8


# (device, row bytes, the layout's run) -> _group_index's answer: an accelerator dequantises a layer's
# blocks every call, and building the index there each time cost a host-to-device copy and four kernels
_INDEX_CACHE: dict[tuple, tuple[int, torch.Tensor]] = {}
_INDEX_CACHE_MAX = 64  # distinct (format, width, device) triples of a model: a handful; more is a leak


def _group_index(run_src: torch.Tensor, row_bytes: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """(groups' bytes, index): byte i of a packed group (its runs for blocks 0, 1, ...) is byte
    index[i] of the group's 8 rows in the file's layout; built once per device, width and layout."""
    key = (str(device), row_bytes, tuple(run_src.tolist()))
    hit = _INDEX_CACHE.get(key)
    if hit is None:
        if len(_INDEX_CACHE) >= _INDEX_CACHE_MAX:
            _INDEX_CACHE.clear()
        hit = _INDEX_CACHE[key] = _build_group_index(run_src, row_bytes, device)
    return hit


def _build_group_index(run_src: torch.Tensor, row_bytes: int, device: torch.device) -> tuple[int, torch.Tensor]:
    run = run_src.numel()
    block_bytes = run // GROUP_ROWS
    src = run_src.to(device)
    index = ((src // block_bytes) * row_bytes)[None, :] + (src % block_bytes)[None, :] \
        + (torch.arange(row_bytes // block_bytes, device=device) * block_bytes)[:, None]
    return GROUP_ROWS * row_bytes, index.reshape(-1)


def unpack(data: torch.Tensor, run_src: torch.Tensor) -> torch.Tensor:
    """The file's layout of interleaved blocks ``data`` [out, row bytes] (uint8, on any device): one
    indexed copy into the output, no intermediate the size of the matrix."""
    data = data.contiguous()
    g = data.shape[0] // GROUP_ROWS
    width, index = _group_index(run_src, data.shape[1], data.device)
    out = torch.empty_like(data)
    out[:g * GROUP_ROWS].view(g, width).index_copy_(1, index, data[:g * GROUP_ROWS].view(g, width))
    out[g * GROUP_ROWS:] = data[g * GROUP_ROWS:]
    return out
