"""The CPU's interleaved layout of a matrix's blocks: 8 rows' block b side by side (``quant_gemv.c``'s X8).

The GEMV on the file's layout decodes one row's block at a time and is bound by its own arithmetic
on AVX2 cores; interleaved, one step decodes 8 rows' block b and scales their 8 dots as one vector.
``quant_gemv.c`` states the layout (``flexplan_quant_x8_layout``: which byte of the 8 rows' blocks
each byte of a group's run holds) and reads it; here the same permutation is applied to whole
tensors with torch ops, to pack a matrix for the CPU (:func:`pack`) and to give it back in the
file's layout where something else reads it (:func:`unpack`: an accelerator's dequantisation, the
tests). Rows past the last group of 8 keep the file's layout, so a packed matrix has the shape and
bytes of the file's, each row's bytes in its own offset range, 8 rows at a time.
"""

from __future__ import annotations

import torch

X8_FLAG = 0x100  # quant_gemv.c's X8: a ggml type id with it names the interleaved layout of that format
GROUP_ROWS = 8


def _groups(data: torch.Tensor, run_src: torch.Tensor) -> tuple[int, int, int]:
    """(groups, blocks a row, block bytes) of ``data`` [out, row bytes] under a run of ``run_src``."""
    block_bytes = run_src.numel() // GROUP_ROWS
    return data.shape[0] // GROUP_ROWS, data.shape[1] // block_bytes, block_bytes


def pack(data: torch.Tensor, run_src: torch.Tensor) -> torch.Tensor:
    """The file's blocks ``data`` [out, row bytes] (uint8) in the interleaved layout: each group's
    block b is one run whose byte j is byte ``run_src[j]`` of the group's 8 blocks b end to end."""
    g, nb, bb = _groups(data, run_src)
    head = data[:g * GROUP_ROWS].reshape(g, GROUP_ROWS, nb, bb).transpose(1, 2).reshape(g, nb, GROUP_ROWS * bb)
    runs = head[:, :, run_src.to(data.device)].reshape(g * GROUP_ROWS, -1)
    return torch.cat([runs, data[g * GROUP_ROWS:]]) if data.shape[0] % GROUP_ROWS else runs


def unpack(data: torch.Tensor, run_src: torch.Tensor) -> torch.Tensor:
    """:func:`pack`'s inverse: the file's layout of interleaved blocks ``data`` (on any device)."""
    g, nb, bb = _groups(data, run_src)
    inv = torch.argsort(run_src).to(data.device)
    head = data[:g * GROUP_ROWS].reshape(g, nb, GROUP_ROWS * bb)[:, :, inv]
    rows = head.reshape(g, nb, GROUP_ROWS, bb).transpose(1, 2).reshape(g * GROUP_ROWS, -1)
    return torch.cat([rows, data[g * GROUP_ROWS:]]) if data.shape[0] % GROUP_ROWS else rows
