"""flexplan.quant.torch_dequant: bit for bit gguf's numpy dequantisation, on any device."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from flexplan.errors import InvalidInputError
from flexplan.quant import kernels
from flexplan.quant.formats import BY_NAME
from flexplan.quant.torch_dequant import SUPPORTED, dequantize

NAMES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]
BLOCKS_32 = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"]  # gguf quantises these
SHAPES = [(7, 512), (3, 256)]
SEEDS = [0, 1, 2]


def reference(data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(ggml_type)).copy())


def raw_blocks(name: str, out: int, in_features: int, seed: int) -> torch.Tensor:
    """Random bytes with finite float16 scale fields (every format)."""
    g = torch.Generator().manual_seed(seed)
    return kernels.random_blocks(BY_NAME[name], out, in_features, g).data


def test_supported_is_the_nine_formats():
    assert SUPPORTED == {BY_NAME[n].ggml_type for n in NAMES}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_blocks_match_gguf_bit_for_bit(name, shape, seed):
    fmt = BY_NAME[name]
    data = raw_blocks(name, *shape, seed)
    got = dequantize(data, fmt.ggml_type, shape[1])
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, reference(data, fmt.ggml_type))


@pytest.mark.parametrize("name", BLOCKS_32)
@pytest.mark.parametrize("seed", SEEDS)
def test_gguf_quantised_weights_match_bit_for_bit(name, seed):
    fmt = BY_NAME[name]
    w = np.random.default_rng(seed).standard_normal((7, 512)).astype(np.float32)
    data = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType(fmt.ggml_type)))
    got = dequantize(data, fmt.ggml_type, 512)
    assert torch.equal(got, reference(data, fmt.ggml_type))
    # it is the weights, roughly (FP4's widest step, between 4 and 6 of a block scaled to its max, ~1/6 of it)
    assert torch.allclose(got, torch.from_numpy(w), atol=1.0 if name == "MXFP4" else 0.5)


def test_accepts_gguf_enum_and_a_row_slice():
    data = raw_blocks("Q4_K", 4, 512, 3)
    t = gguf.GGMLQuantizationType.Q4_K
    assert torch.equal(dequantize(data[1:3], t, 512), reference(data[1:3].contiguous(), int(t)))


@pytest.mark.parametrize("name", ["Q5_0", "Q6_K"])
def test_dtype_is_the_float32_result_cast(name):
    fmt = BY_NAME[name]
    data = raw_blocks(name, 3, 256, 4)
    got = dequantize(data, fmt.ggml_type, 256, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, dequantize(data, fmt.ggml_type, 256).to(torch.bfloat16))


def test_no_rows():
    data = torch.empty(0, 144, dtype=torch.uint8)
    assert dequantize(data, 12, 256).shape == (0, 256)


def test_unknown_type_is_refused_naming_it():
    with pytest.raises(InvalidInputError, match="Q2_K.*Q4_0"):
        dequantize(torch.zeros(2, 84, dtype=torch.uint8), 10, 256)
    with pytest.raises(InvalidInputError, match="ggml type 99"):
        dequantize(torch.zeros(2, 84, dtype=torch.uint8), 99, 256)


def test_in_features_not_whole_blocks_is_refused():
    with pytest.raises(InvalidInputError, match="Q4_K.*multiple of 256"):
        dequantize(torch.zeros(2, 144, dtype=torch.uint8), 12, 128)
    with pytest.raises(InvalidInputError, match="Q8_0.*multiple of 32"):
        dequantize(torch.zeros(2, 34, dtype=torch.uint8), 8, 48)


def test_wrong_row_bytes_is_refused():
    with pytest.raises(InvalidInputError, match="Q4_0.*36 bytes"):
        dequantize(torch.zeros(2, 18, dtype=torch.uint8), 2, 64)


def test_wrong_dtype_or_rank_is_refused():
    with pytest.raises(InvalidInputError, match="uint8"):
        dequantize(torch.zeros(2, 18, dtype=torch.int8), 2, 32)
    with pytest.raises(InvalidInputError, match="2-D"):
        dequantize(torch.zeros(36, dtype=torch.uint8), 2, 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_matches_cpu_bit_for_bit(name):
    fmt = BY_NAME[name]
    data = raw_blocks(name, 7, 512, 5)
    got = dequantize(data.cuda(), fmt.ggml_type, 512)
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), dequantize(data, fmt.ggml_type, 512))
