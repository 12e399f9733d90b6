"""A GGUF file's tensors as the file holds them: raw blocks, never a float copy.

:func:`read_gguf` opens the file with the ``gguf`` package's reader (a copy-on-write memory map:
nothing is read until used, nothing is written back) and gives each tensor as a
:class:`QuantTensor`: its raw block bytes as a torch uint8 tensor [..., rows, row_bytes], its
torch-order shape ([out, in] for a linear weight: GGUF lists the dimensions the other way round)
and its :class:`~flexplan.quant.formats.BlockFormat`.

:meth:`QuantTensor.dequantize` equals ``gguf.quants.dequantize`` bit for bit: the eight kernel
formats through :mod:`flexplan.quant.torch_dequant` (its float32 operations in the reference's
order, one rounding each), the float types by a dtype view, the types without a kernel (Q2_K,
Q3_K, IQ*, ...: ``formats.DEQUANTISED_AT_LOAD``) through the reference itself. A
type the installed ``gguf`` cannot dequantise is refused at :func:`read_gguf`, naming it.

Llama's q/k rows: llama.cpp's converter permutes the rows of q_proj / k_proj (rotary pairs
interleaved, ``convert_hf_to_gguf.py``'s ``permute``) and transformers undoes it on load
(``LlamaTensorProcessor._reverse_permute_weights``). :func:`hf_rows` does the same permutation on
the raw blocks: a row of blocks moves as a unit, so the blocks stay as the file has them.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
import torch

from flexplan.errors import InvalidInputError
from flexplan.quant import torch_dequant
from flexplan.quant.formats import BF16, F16, F32, GGUF_FORMATS, BlockFormat, gguf_format

PERMUTED_ARCHITECTURES = ("llama",)  # transformers' TENSOR_PROCESSORS: the file's architecture "llama" (mistral too)


@dataclass(frozen=True)
class QuantTensor:
    """One tensor's raw blocks: ``data`` uint8 [..., rows, row_bytes], ``shape`` in torch order."""

    name: str
    data: torch.Tensor
    shape: tuple[int, ...]
    format: BlockFormat

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))

    def dequantize(self) -> torch.Tensor:
        """float32 [*shape], bit for bit ``gguf.quants.dequantize`` of the same bytes."""
        blocks = self.data.reshape(-1, self.format.block_bytes)
        out = _DEQUANTIZE.get(self.format.name, _reference)(blocks, self.format)
        return out.reshape(self.shape)


def _dequantize_float(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[fmt.name]
    return blocks.contiguous().view(dtype).float()


def _reference(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Every other format: the ``gguf`` package's own dequantiser (numpy), bit for bit by construction."""
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(fmt.ggml_type)))


@functools.lru_cache(maxsize=None)
def _gguf_dequantises(fmt: BlockFormat) -> bool:
    """Whether the installed ``gguf`` package dequantises ``fmt`` (older versions lack some types)."""
    try:
        gguf.quants.dequantize(np.zeros((1, fmt.block_bytes), np.uint8), gguf.GGMLQuantizationType(fmt.ggml_type))
    except (NotImplementedError, ValueError):
        return False
    return True


def _dequantize_blocks(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The eight kernel formats: torch_dequant's ports of the reference (the accelerator's path too)."""
    return torch_dequant.DEQUANTIZERS[fmt.ggml_type](blocks, torch.float32)


_DEQUANTIZE = {**{GGUF_FORMATS[t].name: _dequantize_blocks for t in torch_dequant.DEQUANTIZERS},
               F32.name: _dequantize_float, F16.name: _dequantize_float, BF16.name: _dequantize_float}


def hf_rows(t: QuantTensor, n_head: int) -> QuantTensor:
    """``t`` with its rows in transformers' order: rows [n_head, 2, dim] become [n_head, dim, 2]
    (``_reverse_permute_weights``: pass the kv head count for k_proj), whole rows of raw blocks moved."""
    rows = t.data.shape[-2]
    if t.data.dim() != 2 or rows % (2 * n_head):
        raise InvalidInputError(f"{t.name}: {rows} rows do not split into {n_head} heads of rotary pairs")
    data = t.data.reshape(n_head, rows // n_head // 2, 2, -1).transpose(1, 2).reshape(t.data.shape)
    return replace(t, data=data.contiguous())


@dataclass
class GGUFWeights:
    """A GGUF file's metadata and raw tensors (:func:`read_gguf`)."""

    path: Path
    architecture: str
    metadata: dict[str, object]
    tensors: dict[str, QuantTensor]

    def field(self, key: str, default=None):
        """A metadata value; ``{arch}`` in ``key`` stands for the architecture (``"{arch}.block_count"``)."""
        return self.metadata.get(key.format(arch=self.architecture), default)

    def formats(self) -> dict[str, int]:
        """How many tensors of each format the file holds."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.format.name] = out.get(t.format.name, 0) + 1
        return out

    def hf_tensor(self, name: str) -> QuantTensor:
        """Tensor ``name`` with rows as transformers loads them: Llama's q/k rows permuted back."""
        t = self.tensors[name]
        if self.architecture in PERMUTED_ARCHITECTURES and re.search(r"\.attn_[qk]\.", name):
            heads = self.field("{arch}.attention.head_count")
            kv_heads = self.field("{arch}.attention.head_count_kv", heads)
            t = hf_rows(t, heads if ".attn_q." in name else kv_heads)
        return t


def gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"gguf {version('gguf')}"
    except PackageNotFoundError:
        return "gguf, version unknown"


def _field_value(field) -> object:
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - a metadata value this gguf version cannot decode is left out
        return None


def read_gguf(path: str | Path) -> GGUFWeights:
    """Open ``path`` and describe every tensor as it is stored; refuses (naming it) a tensor
    whose type flexplan does not read."""
    path = Path(path)
    try:
        reader = gguf.GGUFReader(path, "c")  # copy-on-write map: torch gets writable views, the file stays as it is
    except Exception as e:  # noqa: BLE001 - a corrupt or cut-short file fails anywhere in gguf's parser
        if "GGMLQuantizationType" in str(e):  # a type id newer than the installed gguf package
            raise InvalidInputError(f"{path} holds a tensor type the installed gguf package ({gguf_version()}) does "
                                    f"not know ({e}); upgrade gguf (pip install -U gguf)") from None
        raise InvalidInputError(f"{path} is not a readable GGUF file, corrupt or cut short ({type(e).__name__}: "
                                f"{e}); pass a whole .gguf file written by llama.cpp's convert_hf_to_gguf.py or "
                                "llama-quantize") from None
    metadata = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {}
    for t in reader.tensors:
        fmt = gguf_format(int(t.tensor_type), t.name)
        if fmt.name not in _DEQUANTIZE and not _gguf_dequantises(fmt):
            raise InvalidInputError(f"{path}: tensor {t.name} is {fmt.name}, which the installed gguf package "
                                    f"({gguf_version()}) cannot dequantise; upgrade gguf (pip install -U gguf) or "
                                    "requantise the file with llama-quantize (e.g. to Q8_0 or Q4_K_M)")
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF's ne[0] (the row) comes first
        raw = np.asarray(t.data).view(np.uint8).reshape(*shape[:-1], fmt.row_bytes(shape[-1]))
        tensors[t.name] = QuantTensor(t.name, torch.from_numpy(raw), shape, fmt)
    return GGUFWeights(path, str(metadata.get("general.architecture", "")), metadata, tensors)
