"""flexplan.quant.formats: bytes per weight, block sizes and GGML ids as data, checked against the
gguf package's own table; a clear refusal naming any other type."""

import gguf
import numpy as np
import pytest

from flexplan.errors import InvalidInputError
from flexplan.quant import formats as F


@pytest.mark.parametrize("fmt", list(F.GGUF_FORMATS.values()), ids=lambda f: f.name)
def test_gguf_formats_match_the_gguf_package_table(fmt):
    qtype = gguf.GGMLQuantizationType(fmt.ggml_type)
    assert qtype.name == fmt.name
    assert gguf.GGML_QUANT_SIZES[qtype] == (fmt.block_weights, fmt.block_bytes)


@pytest.mark.parametrize("fmt", F.DEQUANTISED_AT_LOAD, ids=lambda f: f.name)
def test_formats_without_a_kernel_are_ones_gguf_dequantises(fmt):
    assert not fmt.native_kernel
    qtype = gguf.GGMLQuantizationType(fmt.ggml_type)
    try:
        out = gguf.quants.dequantize(np.zeros((2, fmt.block_bytes), np.uint8), qtype)
    except NotImplementedError:
        pytest.skip(f"the installed gguf package cannot dequantise {fmt.name} (read_gguf refuses it, naming it)")
    assert out.shape == (2, fmt.block_weights)


def test_bytes_per_weight():
    # 4.5 / 5 / 8.5 bits for the 32-blocks (MXFP4 4.25: one byte of exponent), 4.5 / 5.5 / 6.5625 for the K-quants (ggml-common.h's
    # block_q4_K: 2 + 2 + 12 + 128 bytes; block_q5_K: + 32 of high bits; block_q6_K: 128 + 64 + 16 + 2)
    bits = {f.name: f.bytes_per_weight * 8 for f in F.GGUF_FORMATS.values() if f not in F.DEQUANTISED_AT_LOAD}
    assert bits == {"F32": 32, "F16": 16, "BF16": 16, "Q4_0": 4.5, "Q4_1": 5, "Q8_0": 8.5, "Q5_0": 5.5,
                    "Q5_1": 6, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625, "MXFP4": 4.25}
    assert (F.Q4_K.block_bytes, F.Q5_K.block_bytes, F.Q6_K.block_bytes) == (144, 176, 210)
    assert F.BY_NAME["Q2_K"].bytes_per_weight * 8 == 2.625 and F.BY_NAME["IQ4_XS"].bytes_per_weight * 8 == 4.25
    assert F.Q4_1.tensor_bytes(1536, 576) == 552960  # SmolLM2's ffn_gate, as the file holds it
    # FlexGen's group-wise formats: a float16 scale and min per group of 64
    assert F.INT4.bytes_per_weight == 0.5 + 4 / 64 and F.INT8.bytes_per_weight == 1 + 4 / 64
    assert F.group_format(4, 128).bytes_per_weight == 0.5 + 4 / 128
    assert {f.name for f in F.GGUF_FORMATS.values() if f.native_kernel} == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                                                             "Q4_K", "Q5_K", "Q6_K", "MXFP4"}


def test_refusals_name_the_type_and_what_works():
    with pytest.raises(InvalidInputError, match=r"Q8_K \(tensor blk\.0\.attn_q\.weight\) is not supported; "
                                                r"flexplan runs Q4_0.*Q6_K, MXFP4 on their blocks and reads F32.*Q2_K.*at load"):
        F.gguf_format(15, "blk.0.attn_q.weight")
    with pytest.raises(InvalidInputError, match="I32 is not supported.*llama-quantize"):
        F.gguf_format(26)
    assert F.gguf_format(10) is F.BY_NAME["Q2_K"] and F.gguf_format(23).name == "IQ4_XS"  # dequantised at load
    with pytest.raises(InvalidInputError, match="type id 99"):
        F.gguf_format(99)
    with pytest.raises(InvalidInputError, match="whole number of 32-weight blocks"):
        F.Q4_0.row_bytes(48)
    with pytest.raises(InvalidInputError, match="even size from 32 to 128"):
        F.group_format(4, 256)
    with pytest.raises(InvalidInputError, match="int8 or int4"):
        F.group_format(3)


def test_format_named():
    assert F.format_named("q4_1") is F.Q4_1 and F.format_named("Q6_K") is F.Q6_K
    assert F.format_named("int4") == F.INT4 and F.format_named("int8-g32").block_weights == 32
    with pytest.raises(InvalidInputError, match="unknown weight format 'q3'"):
        F.format_named("q3")
