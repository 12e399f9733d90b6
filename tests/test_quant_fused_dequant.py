"""flexplan.quant.fused_dequant: torch_dequant's functions compiled by torch.compile, equal to the eager ones.

On the CPU inductor compiles C++; measured here (2 cores, empty inductor cache, torch 2.13): the
process's first compile ~9 s (inductor's own start-up), then 1.3-3.9 s a format and dtype, ~61 s for
the eight formats in three dtypes. The compiled results equal the eager ones bit for bit (max
difference 0 ulp) for every format in float32, bfloat16 and float16, so the tests ask for equality.
The default run compiles Q4_0 only; the other formats are marked slow.
"""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch

from flexplan.quant import fused_dequant, kernels
from flexplan.quant.formats import BY_NAME
from flexplan.quant.quant_linear import QuantLinear
from flexplan.quant.torch_dequant import dequantize as eager

NAMES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CPU = ("cpu",)  # compile on the CPU too (the default compiles on CUDA only)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Each test starts with fusion on and no failure recorded, and leaves the process's state as it was."""
    monkeypatch.delenv(fused_dequant.ENV_VAR, raising=False)
    monkeypatch.setattr(fused_dequant, "_off_why", None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "bf16 and fp16 are mixed", UserWarning)  # inductor's C++ codegen
        yield


def _blocks(name: str, out: int, in_features: int, seed: int) -> torch.Tensor:
    return kernels.random_blocks(BY_NAME[name], out, in_features, torch.Generator().manual_seed(seed)).data


def _check_equal(name: str, data: torch.Tensor, in_features: int, dtype: torch.dtype) -> None:
    t = BY_NAME[name].ggml_type
    got = fused_dequant.dequantize(data, t, in_features, dtype, device_types=CPU)
    want = eager(data, t, in_features, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want), f"{name} {dtype}: compiled differs from eager"


def _compiled_all(name: str, dtypes) -> None:
    # random blocks of two shapes (one compile serves both: dynamic shapes) and a row slice
    for dtype in dtypes:
        for seed, (out, in_features) in enumerate([(7, 512), (13, 1024)]):
            _check_equal(name, _blocks(name, out, in_features, seed), in_features, dtype)
    data = _blocks(name, 5, 768, 9)
    _check_equal(name, data[1:4], 768, dtypes[-1])
    assert fused_dequant.off_reason() is None


def test_q4_0_compiled_equals_eager_bit_for_bit():
    _compiled_all("Q4_0", [torch.bfloat16])  # the plan's usual dtype; one compile (~10 s cold, ~4 s cached)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_every_format_compiled_equals_eager_bit_for_bit(name):
    _compiled_all(name, DTYPES)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_gguf_quantised_weights_compiled_equal_gguf(name):
    fmt = BY_NAME[name]
    w = np.random.default_rng(3).standard_normal((6, 256)).astype(np.float32)
    data = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType(fmt.ggml_type)))
    got = fused_dequant.dequantize(data, fmt.ggml_type, 256, device_types=CPU)
    ref = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
    assert torch.equal(got, torch.from_numpy(ref.copy()))


def _failing_compile(fn):
    def compiled(*args):
        raise RuntimeError("no working compiler here\nsecond line of detail")
    return compiled


def test_a_failed_compile_falls_back_to_eager_for_the_process_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(fused_dequant, "_compile", _failing_compile)
    monkeypatch.setattr(fused_dequant, "_compiled", {})
    data = _blocks("Q8_0", 4, 64, 0)
    got = fused_dequant.dequantize(data, 8, 64, torch.bfloat16, device_types=CPU)
    assert torch.equal(got, eager(data, 8, 64, torch.bfloat16))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "fused dequantisation off" in err and "Q8_0" in err and "RuntimeError: no working compiler here" in err
    assert not fused_dequant.enabled() and "Q8_0 (cpu)" in fused_dequant.off_reason()
    fused_dequant.dequantize(data, 8, 64, device_types=CPU)  # eager now: no second line
    assert capsys.readouterr().err == ""


def test_out_of_memory_is_raised_not_a_fallback(monkeypatch):
    def oom_compile(fn):
        def compiled(*args):
            raise torch.OutOfMemoryError("CUDA out of memory")
        return compiled
    monkeypatch.setattr(fused_dequant, "_compile", oom_compile)
    monkeypatch.setattr(fused_dequant, "_compiled", {})
    with pytest.raises(torch.OutOfMemoryError):
        fused_dequant.dequantize(_blocks("Q8_0", 4, 64, 0), 8, 64, device_types=CPU)
    assert fused_dequant.enabled()


@pytest.mark.parametrize("case", ["env var 0", "cpu by default", "one block"])
def test_eager_where_the_rule_says(monkeypatch, case):
    monkeypatch.setattr(fused_dequant, "_compile", _failing_compile)  # a compile attempt would turn fusion off
    monkeypatch.setattr(fused_dequant, "_compiled", {})
    data, kw = _blocks("Q4_K", 3, 512, 1), {"device_types": CPU}
    if case == "env var 0":
        monkeypatch.setenv(fused_dequant.ENV_VAR, "0")
    elif case == "cpu by default":
        kw = {}
    else:
        data = data[:1, :144]
    got = fused_dequant.dequantize(data, 12, data.shape[1] // 144 * 256, **kw)
    assert torch.equal(got, eager(data, 12, data.shape[1] // 144 * 256))
    assert fused_dequant._compiled == {} and fused_dequant.off_reason() is None


def test_no_rows_and_bad_input_as_torch_dequant():
    empty = torch.empty(0, 144, dtype=torch.uint8)
    assert fused_dequant.dequantize(empty, 12, 256, device_types=CPU).shape == (0, 256)
    with pytest.raises(Exception, match="Q4_K.*multiple of 256"):
        fused_dequant.dequantize(torch.zeros(2, 144, dtype=torch.uint8), 12, 128, device_types=CPU)


def test_quant_linear_dequantises_through_the_fused_module(monkeypatch):
    calls = []
    real = fused_dequant.dequantize

    def spy(*args, **kw):
        calls.append(args[1])
        return real(*args, **kw)
    monkeypatch.setattr(fused_dequant, "dequantize", spy)
    qt = kernels.random_blocks(BY_NAME["Q5_0"], 8, 64, torch.Generator().manual_seed(2))
    lin = QuantLinear(qt)
    x = torch.randn(3, 64)
    y = lin.forward_dequantised(x)
    assert calls == [6]
    assert torch.equal(y, torch.nn.functional.linear(x, eager(qt.data, 6, 64)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_compiled_equals_cpu_eager(name):
    """Triton's kernel against the CPU's eager ops, float32 and bfloat16: bit for bit (the same float32
    ops in the same order, FMA contraction off: fused_dequant._compile; not yet run on a GPU)."""
    t = BY_NAME[name].ggml_type
    data = _blocks(name, 7, 512, 5)
    for dtype in (torch.float32, torch.bfloat16):
        got = fused_dequant.dequantize(data.cuda(), t, 512, dtype)
        assert got.device.type == "cuda" and fused_dequant.off_reason() is None, fused_dequant.off_reason()
        assert torch.equal(got.cpu(), eager(data, t, 512, dtype)), f"{name} {dtype}"
