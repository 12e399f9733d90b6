"""Weight formats as data: how many bytes a weight costs, in which blocks, under which GGML id.

Two families:

- GGUF block formats, read as the file holds them (ggml-common.h's ``block_*`` structs): Q4_0,
  Q4_1, Q8_0, Q5_0, Q5_1, MXFP4 (32 weights a block) and the K-quants Q4_K, Q5_K, Q6_K (256 a
  super-block), each with a native kernel (``native_kernel``); the plain float types F32 / F16 /
  BF16 a file carries for norms and small tensors; and the other types the ``gguf`` package can
  dequantise (Q2_K, Q3_K, the IQ and TQ types, NVFP4: :data:`DEQUANTISED_AT_LOAD`), read
  as blocks and dequantised to float32 at load, where a kernel would run them;
- flexplan's own group-wise int8 / int4 (FlexGen's compression: groups of 64 consecutive weights
  along the input dimension, asymmetric, a float16 scale and a float16 minimum a group; groups of
  32 to 128 allowed).

Everything here is torch-free and numpy-free, so the planner and estimator can price a format
(bytes per weight, Park & Egger's Eq. 8-12) without loading a kernel. Any other GGML type a file
holds (Q8_1, Q8_K: activation formats; the integer types; F64) is refused with
:class:`~flexplan.errors.InvalidInputError` naming it and what would work.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexplan.errors import InvalidInputError


@dataclass(frozen=True)
class BlockFormat:
    """One weight format: ``block_weights`` weights stored in ``block_bytes`` bytes."""

    name: str
    ggml_type: int | None  # GGML's type id (ggml.h's ``enum ggml_type``); None for flexplan's own formats
    block_weights: int
    block_bytes: int
    bits: int  # bits of one quantised value (32/16 for the float types)
    native_kernel: bool = False  # quant_gemv.c / quant_kquants.c read these blocks as they are
    description: str = ""

    @property
    def bytes_per_weight(self) -> float:
        return self.block_bytes / self.block_weights

    @property
    def is_float(self) -> bool:
        return self.block_weights == 1

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one row of ``in_features`` weights; rows hold whole blocks (GGUF's rule)."""
        if in_features % self.block_weights:
            raise InvalidInputError(f"{self.name}: a row of {in_features} weights is not a whole number of "
                                    f"{self.block_weights}-weight blocks")
        return in_features // self.block_weights * self.block_bytes

    def tensor_bytes(self, out_features: int, in_features: int) -> int:
        return out_features * self.row_bytes(in_features)


# ggml-common.h: block_q4_0 {fp16 d; u8 qs[16]}, block_q4_1 {fp16 d, m; u8 qs[16]},
# block_q8_0 {fp16 d; i8 qs[32]}; block_q5_0 {fp16 d; u8 qh[4]; u8 qs[16]},
# block_q5_1 {fp16 d, m; u8 qh[4]; u8 qs[16]}; block_q4_K {fp16 d, dmin; u8 scales[12]; u8 qs[128]},
# block_q5_K {fp16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]},
# block_q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; fp16 d}
F32 = BlockFormat("F32", 0, 1, 4, 32, description="float32")
F16 = BlockFormat("F16", 1, 1, 2, 16, description="float16")
BF16 = BlockFormat("BF16", 30, 1, 2, 16, description="bfloat16")
Q4_0 = BlockFormat("Q4_0", 2, 32, 18, 4, True, "32 weights: float16 scale d, 4-bit q; w = d * (q - 8)")
Q4_1 = BlockFormat("Q4_1", 3, 32, 20, 4, True, "32 weights: float16 scale d and min m, 4-bit q; w = d * q + m")
Q8_0 = BlockFormat("Q8_0", 8, 32, 34, 8, True, "32 weights: float16 scale d, int8 q; w = d * q")
Q5_0 = BlockFormat("Q5_0", 6, 32, 22, 5, True, "32 weights: float16 scale d, 5-bit q; w = d * (q - 16)")
Q5_1 = BlockFormat("Q5_1", 7, 32, 24, 5, True, "32 weights: float16 scale d and min m, 5-bit q; w = d * q + m")
Q4_K = BlockFormat("Q4_K", 12, 256, 144, 4, True, "256 weights: 8 sub-blocks of 32 with 6-bit scales and mins")
Q5_K = BlockFormat("Q5_K", 13, 256, 176, 5, True, "256 weights: 8 sub-blocks of 32 with 6-bit scales and mins")
Q6_K = BlockFormat("Q6_K", 14, 256, 210, 6, True, "256 weights: 16 sub-blocks of 16 with int8 scales")
MXFP4 = BlockFormat("MXFP4", 39, 32, 17, 4, True, "32 weights: E8M0 scale, FP4 (E2M1) values (gpt-oss's experts)")

# ggml-common.h's other weight types the gguf package dequantises (gguf/quants.py): no kernel runs
# them, so a file holding them is dequantised to float32 at load (4 bytes a weight in memory, not these)
DEQUANTISED_AT_LOAD = (
    BlockFormat("Q2_K", 10, 256, 84, 2, description="256 weights: 16 sub-blocks of 16, 4-bit scales and mins"),
    BlockFormat("Q3_K", 11, 256, 110, 3, description="256 weights: 16 sub-blocks of 16, 6-bit scales"),
    BlockFormat("IQ2_XXS", 16, 256, 66, 2, description="256 weights: 2-bit lattice codes"),
    BlockFormat("IQ2_XS", 17, 256, 74, 2, description="256 weights: 2-bit lattice codes, 4-bit scales"),
    BlockFormat("IQ3_XXS", 18, 256, 98, 3, description="256 weights: 3-bit lattice codes"),
    BlockFormat("IQ1_S", 19, 256, 50, 1, description="256 weights: 1.5-bit lattice codes"),
    BlockFormat("IQ4_NL", 20, 32, 18, 4, description="32 weights: float16 scale, 4-bit non-linear codes"),
    BlockFormat("IQ3_S", 21, 256, 110, 3, description="256 weights: 3-bit lattice codes, signs, scales"),
    BlockFormat("IQ2_S", 22, 256, 82, 2, description="256 weights: 2-bit lattice codes, signs, scales"),
    BlockFormat("IQ4_XS", 23, 256, 136, 4, description="256 weights: 4-bit non-linear codes, 6-bit scales"),
    BlockFormat("IQ1_M", 29, 256, 56, 1, description="256 weights: 1.75-bit lattice codes"),
    BlockFormat("TQ1_0", 34, 256, 54, 2, description="256 weights: ternary, base-3 packed"),
    BlockFormat("TQ2_0", 35, 256, 66, 2, description="256 weights: ternary, 2 bits each"),
    BlockFormat("NVFP4", 40, 64, 36, 4, description="64 weights: FP4 (E2M1) values, FP8 scales per 16"),
)

GGUF_FORMATS: dict[int, BlockFormat] = {
    f.ggml_type: f for f in (F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4, *DEQUANTISED_AT_LOAD)}
BY_NAME: dict[str, BlockFormat] = {f.name: f for f in GGUF_FORMATS.values()}

# ggml.h's enum ggml_type names for the ids flexplan refuses, so the refusal names the type
GGML_TYPE_NAMES = {9: "Q8_1", 15: "Q8_K", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 41: "Q1_0"}

GROUP_SIZES = range(32, 129)  # FlexGen's groups: 64 by default, 32 to 128 allowed
DEFAULT_GROUP_SIZE = 64
GROUP_HEADER_BYTES = 4  # a float16 scale and a float16 minimum per group (asymmetric)


def group_format(bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> BlockFormat:
    """flexplan's group-wise int``bits`` (8 or 4), asymmetric: each group of ``group_size``
    consecutive weights of a row keeps a float16 scale and minimum, w = scale * q + min."""
    if bits not in (4, 8):
        raise InvalidInputError(f"group-wise weights are int8 or int4, not int{bits}")
    if group_size not in GROUP_SIZES or group_size % 2:
        raise InvalidInputError(f"group size {group_size}: use an even size from {GROUP_SIZES.start} to "
                                f"{GROUP_SIZES.stop - 1} (FlexGen's default is {DEFAULT_GROUP_SIZE})")
    return BlockFormat(f"int{bits}-g{group_size}", None, group_size, group_size * bits // 8 + GROUP_HEADER_BYTES,
                       bits, False, f"group-wise int{bits}: {group_size} weights, float16 scale and min")


INT8 = group_format(8)
INT4 = group_format(4)


# what a refusal says flexplan reads instead
READ_NOTE = (f"flexplan runs {', '.join(f.name for f in GGUF_FORMATS.values() if f.native_kernel)} on their blocks "
             f"and reads {', '.join(f.name for f in GGUF_FORMATS.values() if not f.native_kernel)} dequantised to "
             "float32 at load")


def gguf_format(ggml_type: int, tensor_name: str = "") -> BlockFormat:
    """The format of GGML type id ``ggml_type``; a clear refusal for any type flexplan does not read."""
    fmt = GGUF_FORMATS.get(int(ggml_type))
    if fmt is None:
        what = GGML_TYPE_NAMES.get(int(ggml_type), f"type id {int(ggml_type)}")
        where = f" (tensor {tensor_name})" if tensor_name else ""
        raise InvalidInputError(f"GGUF type {what}{where} is not supported; {READ_NOTE} (requantise the file with "
                                "llama-quantize, e.g. to Q8_0 or Q4_K_M, whose blocks run natively)")
    return fmt


def format_named(name: str) -> BlockFormat:
    """A format by name: a GGUF one (``"Q4_1"``) or ``"int8"`` / ``"int4"`` (group 64) /
    ``"int4-g128"``."""
    key = name.strip()
    if key.upper() in BY_NAME:
        return BY_NAME[key.upper()]
    low = key.lower()
    if low.startswith(("int8", "int4")):
        bits, _, group = low[3:].partition("-g")
        try:
            return group_format(int(bits), int(group) if group else DEFAULT_GROUP_SIZE)
        except ValueError:
            pass
    raise InvalidInputError(f"unknown weight format {name!r}; known: {', '.join(BY_NAME)}, int8, int4, int4-g128")
