"""A GGUF file's header, read without its tensors: the metadata and the tensor table.

The layout (llama.cpp's ``docs/gguf.md``, little-endian): the magic ``GGUF``, a u32 version (2 or
3), a u64 tensor count and a u64 metadata count; then each metadata entry (a key string, a u32
value type, the value) and each tensor's entry (a name string, a u32 dimension count, that many
u64 dimensions with the row first, a u32 GGML type id, a u64 data offset). A string is a u64
length and UTF-8 bytes.

Read with ``struct`` over a memory map, stepping over string arrays (a vocabulary and its merges:
about 100k strings in SmolLM2) unless asked for: tens of milliseconds where the ``gguf`` package's
reader, which builds a numpy view per string, takes seconds. Torch-free and numpy-free: the
planner reads it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from flexplan.errors import InvalidInputError

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # version 1 counted in 32 bits; llama.cpp has written v3 since 2023
# GGUF's metadata value types with a fixed width (docs/gguf.md: gguf_metadata_value_type)
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header lists it: ``shape`` in torch order ([out, in] for a linear)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata (string arrays not asked for are left as their length) and tensors."""

    path: Path
    metadata: dict[str, object]
    tensors: tuple[TensorEntry, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)


def is_gguf_path(model: object) -> bool:
    """Whether ``model`` names a GGUF file (by its suffix: the file may not exist yet)."""
    return isinstance(model, (str, Path)) and str(model).lower().endswith(".gguf")


class _Cursor:
    """Reads little-endian values from a buffer, moving on as it reads."""

    def __init__(self, buf, pos: int = 0):
        self.buf, self.pos = buf, pos

    def unpack(self, fmt: str):
        out = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return out

    def string(self) -> str:
        (n,) = self.unpack("Q")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def skip_string(self) -> None:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.pos += 8 + n

    def value(self, vtype: int, keep_strings: bool):
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])[0]
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("IQ")
            if etype in _SCALAR_FORMATS:
                return list(self.unpack(f"{count}{_SCALAR_FORMATS[etype]}"))
            if etype == _STRING and keep_strings:
                return [self.string() for _ in range(count)]
            if etype == _STRING:  # a vocabulary: stepped over, its length kept
                for _ in range(count):
                    self.skip_string()
                return count
            return [self.value(etype, keep_strings) for _ in range(count)]
        raise ValueError(f"metadata value type {vtype} is not one GGUF defines")


def read_header(path: str | Path, string_arrays: tuple[str, ...] = ()) -> GGUFHeader:
    """The header of GGUF file ``path``; string-array keys in ``string_arrays`` are read in full,
    other string arrays are left as their length. Reads no tensor data."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InvalidInputError(f"{path}: no such GGUF file; pass the path of a .gguf file")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(path, buf, string_arrays)
    except (struct.error, ValueError, UnicodeDecodeError, OSError) as e:
        raise InvalidInputError(f"{path} is not a readable GGUF file ({e}); pass a .gguf file written by "
                                "llama.cpp's convert_hf_to_gguf.py or llama-quantize") from None


def _parse(path: Path, buf, string_arrays: tuple[str, ...]) -> GGUFHeader:
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError("it does not start with the GGUF magic bytes")
    cur = _Cursor(buf, 4)
    version, n_tensors, n_kv = cur.unpack("IQQ")
    if version not in GGUF_VERSIONS:
        raise ValueError(f"GGUF version {version}; flexplan reads versions {', '.join(map(str, GGUF_VERSIONS))}")
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key = cur.string()
        (vtype,) = cur.unpack("I")
        metadata[key] = cur.value(vtype, key in string_arrays)
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = cur.unpack("I")
        dims = cur.unpack(f"{n_dims}Q")
        ggml_type, _offset = cur.unpack("IQ")
        tensors.append(TensorEntry(name, tuple(int(d) for d in reversed(dims)), int(ggml_type)))
    return GGUFHeader(path, metadata, tuple(tensors))
