"""flexplan.quant.kernels (quant_gemv.c): the GEMV / batched GEMM on raw Q4_0 / Q4_1 / Q8_0 blocks.

- the float-activation path is exact: one-hot rows give the dequantised weights bit for bit, and
  any x gives float64 matmul of the dequantised weights to one float32 rounding;
- the int8-activation path (llama.cpp's per-block activation quantisation) stays within the
  stated bound ACT_QUANT_REL_ERROR (RMS error over the RMS of y) of dequantise-then-float64, and
  equals a Python model of the same arithmetic to float32 summation order;
- each row of the batched kernel equals the GEMV of that row to float32 summation order (the same
  integer dots, the tile's scaled sums in another order), bit for bit for rows past the tiles;
- without the library, linear() is dequantise (bit for bit as gguf) + F.linear."""

import pytest
import torch

from conftest import needs_gguf
from flexplan.errors import InvalidInputError
from flexplan.quant import kernels
from flexplan.quant.formats import Q4_0, Q4_1, Q8_0, Q4_K

NATIVE, WHY = kernels.status()
needs_native = pytest.mark.skipif(NATIVE is None, reason=f"no native quantised kernels: {WHY}")
FORMATS = [Q4_0, Q4_1, Q8_0]


def _weights(fmt, out=24, k=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    return kernels.quantize_reference(torch.randn(out, k, generator=g), fmt)


def _rel(y, ref):
    return float((y.double() - ref).abs().max() / ref.abs().max())


@needs_native
def test_isa_is_named_and_matches_the_cpu_flags():
    flags = open("/proc/cpuinfo").read()
    want = "avx512vnni" if " avx512_vnni" in flags and " avx512vl" in flags else \
        "avxvnni" if " avx_vnni" in flags else "avx2" if " avx2" in flags and " fma" in flags else "portable"
    assert NATIVE.isa == want


@needs_native
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_float_activation_path_is_exact(fmt):
    qt = _weights(fmt)
    w = qt.dequantize()
    assert torch.equal(NATIVE.dequantize(qt.data, fmt, 160).view(torch.int32), w.view(torch.int32))
    eye = torch.eye(160)  # y = W e_j: column j exactly (a sum from +0 gives +0 where W holds -0: equal values)
    assert torch.equal(NATIVE.gemm(qt.data, fmt, eye, float_act=True), w.t())
    x, b = torch.randn(5, 160), torch.randn(24)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert torch.equal(NATIVE.gemm(qt.data, fmt, x, b, float_act=True), ref.float())  # one rounding of a double sum


def _model_of_the_int8_path(qt, x):
    """The kernel's arithmetic in Python: activation per 32-block d = max|x| / 127, q = round half
    away from zero of x / d (computed as x * (1 / d)), the block dot exact in integers."""
    w_int = qt.dequantize().double()  # per block, w = d_w * q_w (+ m_w): the same values the integers encode
    xb = x.reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = xb * inv
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return (q * d).reshape(x.shape).double() @ w_int.t()


@needs_native
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("batch", [1, 4, 7])
def test_int8_activation_path_within_the_stated_bound(fmt, batch):
    qt = _weights(fmt, seed=batch)
    w = qt.dequantize()
    x, b = torch.randn(batch, 160), torch.randn(24)
    y = NATIVE.gemm(qt.data, fmt, x, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert kernels.rms_rel_error(y, ref) < kernels.ACT_QUANT_REL_ERROR
    assert _rel(y, _model_of_the_int8_path(qt, x) + b.double()) < 1e-5  # the same arithmetic, float32 sums


@needs_native
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_batched_rows_equal_the_gemv(fmt):
    qt = _weights(fmt, out=33, k=96)
    x = torch.randn(9, 96)  # two tiles of 4 and one row left over
    y = NATIVE.gemm(qt.data, fmt, x)
    for r in range(9):
        one = NATIVE.gemm(qt.data, fmt, x[r:r + 1].contiguous())[0]
        assert torch.equal(y[r], one) if r == 8 else _rel(y[r], one.double()) < 1e-6, r


@needs_native
def test_zero_activation_block_and_bad_sizes():
    qt = _weights(Q4_1, k=64)
    x = torch.zeros(1, 64)
    x[0, 40] = 3.0  # the first block all zero: d = 0, its q all zero
    ref = qt.dequantize()[:, 40].double() * 3.0
    assert _rel(NATIVE.gemm(qt.data, Q4_1, x)[0], ref) < kernels.ACT_QUANT_REL_ERROR
    with pytest.raises(InvalidInputError, match="multiple of 32"):
        NATIVE.gemm(qt.data[:, :10], Q4_1, torch.zeros(1, 48))
    with pytest.raises(InvalidInputError, match="Q4_K is not a kernel format"):
        NATIVE.gemm(qt.data, Q4_K, x)


def test_linear_falls_back_to_dequantise_and_torch(monkeypatch):
    qt = _weights(Q4_0)
    x, b = torch.randn(2, 3, 160), torch.randn(24)
    monkeypatch.setattr(kernels, "status", lambda: (None, "disabled for the test"))
    assert torch.equal(kernels.linear(qt, x, b), torch.nn.functional.linear(x, qt.dequantize(), b))


@needs_native
def test_linear_uses_the_kernel_with_leading_dimensions():
    qt = _weights(Q8_0)
    x = torch.randn(2, 3, 160)
    y = kernels.linear(qt, x)
    assert y.shape == (2, 3, 24)
    assert torch.equal(y.reshape(6, 24), NATIVE.gemm(qt.data, Q8_0, x.reshape(6, 160)))


@needs_native
@needs_gguf
def test_smollm2_layer_within_the_bound():
    from flexplan.quant.gguf_weights import read_gguf
    from flexplan.smollm import gguf_path

    w = read_gguf(gguf_path())
    g = torch.Generator().manual_seed(3)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.0.ffn_gate.weight"):
        t = w.hf_tensor(name)
        x = torch.randn(3, t.shape[1], generator=g)
        ref = x.double() @ t.dequantize().double().t()
        assert kernels.rms_rel_error(kernels.linear(t, x), ref) < kernels.ACT_QUANT_REL_ERROR, name


@needs_native
def test_gemv_list_equals_one_gemm_per_matrix():
    items = [(_weights(f, out=o, k=k, seed=i).data, f, torch.randn(k))
             for i, (f, o, k) in enumerate(((Q4_0, 24, 160), (Q4_1, 7, 64), (Q8_0, 40, 96), (Q4_1, 1, 32)))]
    ys = NATIVE.gemv_list(items).run()
    for (w, f, x), y in zip(items, ys):
        assert torch.equal(y, NATIVE.gemm(w, f, x[None])[0])
    bad = NATIVE.gemv_list([(items[0][0], Q4_K, items[0][2])])
    with pytest.raises(InvalidInputError, match="not a kernel format"):
        bad.run()


@pytest.mark.skipif(NATIVE is None, reason=f"no native quantised kernels: {WHY}")
def test_portable_c_path_passes_the_self_check(tmp_path):
    """The same source built for plain x86-64 (no AVX2): the fallback the ISA checks choose off x86's vector units."""
    import ctypes
    import subprocess

    from flexplan.executor.native import _compiler

    lib = tmp_path / "portable.so"
    subprocess.run([_compiler(), "-O2", "-march=x86-64", "-fopenmp", "-shared", "-fPIC", "-std=gnu11",
                    str(kernels.SOURCE), "-o", str(lib)], check=True, capture_output=True, timeout=120)
    portable = kernels.NativeQuant(ctypes.CDLL(str(lib)), lib)
    assert portable.isa == "portable"
    kernels._self_check(portable)
    qt, x = _weights(Q4_1), torch.randn(3, 160)
    assert _rel(portable.gemm(qt.data, Q4_1, x), NATIVE.gemm(qt.data, Q4_1, x).double()) < 1e-5
