"""flexplan.quant.formats: bytes per weight, block sizes and GGML ids as data, checked against the
gguf package's own table; a clear refusal naming any other type."""

import gguf
import pytest

from flexplan.errors import InvalidInputError
from flexplan.quant import formats as F


@pytest.mark.parametrize("fmt", list(F.GGUF_FORMATS.values()), ids=lambda f: f.name)
def test_gguf_formats_match_the_gguf_package_table(fmt):
    qtype = gguf.GGMLQuantizationType(fmt.ggml_type)
    assert qtype.name == fmt.name
    assert gguf.GGML_QUANT_SIZES[qtype] == (fmt.block_weights, fmt.block_bytes)


def test_bytes_per_weight():
    # 4.5 / 5 / 8.5 bits for the 32-blocks, 4.5 / 5.5 / 6.5625 for the K-quants
    bits = {f.name: f.bytes_per_weight * 8 for f in F.GGUF_FORMATS.values()}
    assert bits == {"F32": 32, "F16": 16, "BF16": 16, "Q4_0": 4.5, "Q4_1": 5, "Q8_0": 8.5, "Q5_0": 5.5,
                    "Q5_1": 6, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625}
    assert F.Q4_1.tensor_bytes(1536, 576) == 552960  # SmolLM2's ffn_gate, as the file holds it
    # FlexGen's group-wise formats: a float16 scale and min per group of 64
    assert F.INT4.bytes_per_weight == 0.5 + 4 / 64 and F.INT8.bytes_per_weight == 1 + 4 / 64
    assert F.group_format(4, 128).bytes_per_weight == 0.5 + 4 / 128
    assert {f.name for f in F.GGUF_FORMATS.values() if f.native_kernel} == {"Q4_0", "Q4_1", "Q8_0"}


def test_refusals_name_the_type():
    with pytest.raises(InvalidInputError, match=r"Q2_K \(tensor blk\.0\.attn_q\.weight\)"):
        F.gguf_format(10, "blk.0.attn_q.weight")
    with pytest.raises(InvalidInputError, match="IQ4_XS"):
        F.gguf_format(23)
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
