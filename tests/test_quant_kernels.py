"""flexplan.quant.kernels (quant_gemv.c, quant_kquants.c): the GEMV / batched GEMM on raw blocks of
every kernel format (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 and the K-quants Q4_K / Q5_K / Q6_K; gguf has
no K-quant quantiser, so those are random blocks: the kernels' results do not depend on how the
blocks were made).

- the float-activation path is exact: one-hot rows give the dequantised weights bit for bit, and
  any x gives float64 matmul of the dequantised weights to one float32 rounding;
- the int8-activation path (llama.cpp's per-block activation quantisation) stays within the
  stated bound ACT_QUANT_REL_ERROR (RMS error over the RMS of y) of dequantise-then-float64, and
  equals float64 of the same quantised activation (int8_activation_reference) to float32 rounding;
- each row of the batched kernel equals the GEMV of that row bit for bit;
- the interleaved layout (8 rows' blocks side by side) round-trips, dequantises as gguf does, agrees
  with the file's layout, and gives each row bit for bit the same whatever the batch;
- without the library, linear() is dequantise (bit for bit as gguf) + F.linear."""

import pytest
import torch

from conftest import needs_gguf
from flexplan.errors import InvalidInputError
from flexplan.quant import interleave, kernels
from flexplan.quant.formats import BY_NAME, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0

NATIVE, WHY = kernels.status()
needs_native = pytest.mark.skipif(NATIVE is None, reason=f"no native quantised kernels: {WHY}")
FORMATS = list(kernels.NATIVE_FORMATS.values())


def _weights(fmt, out=24, blocks=5, seed=0):
    """[out, blocks * block_weights]: 160 weights a row for the 32-blocks, 1280 for the K-quants."""
    g = torch.Generator().manual_seed(seed)
    return kernels.test_blocks(fmt, out, blocks * fmt.block_weights, g)


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
    k = qt.shape[1]
    w = qt.dequantize()
    assert torch.equal(NATIVE.dequantize(qt.data, fmt, k).view(torch.int32), w.view(torch.int32))
    eye = torch.eye(k)  # y = W e_j: column j exactly (a sum from +0 gives +0 where W holds -0: equal values)
    assert torch.equal(NATIVE.gemm(qt.data, fmt, eye, float_act=True), w.t())
    x, b = torch.randn(5, k), torch.randn(24)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert torch.equal(NATIVE.gemm(qt.data, fmt, x, b, float_act=True), ref.float())  # one rounding of a double sum


@needs_native
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("batch", [1, 4, 7])
def test_int8_activation_path_within_the_stated_bound(fmt, batch):
    g = torch.Generator().manual_seed(batch)
    qt = _weights(fmt, out=256, seed=batch)
    w = qt.dequantize()
    x, b = torch.randn(batch, qt.shape[1], generator=g), torch.randn(256, generator=g)
    y = NATIVE.gemm(qt.data, fmt, x, b)
    # the same quantised activation in float64: only the float32 scaling and sums differ
    assert _rel(y, kernels.int8_activation_reference(qt, x, b)) < kernels.INT8_PATH_REL_ERROR
    # the bound is over a sample of activations (8 rows, 256 outputs): one row's error rests on its
    # few blocks' maxima (a K-quant row: up to 1.3e-2, above 1e-2 in 14 of 200 seeds; 8 rows: 9.3e-3 at worst)
    x8 = torch.randn(8, qt.shape[1], generator=g)
    ref = x8.double() @ w.double().t()
    assert kernels.rms_rel_error(NATIVE.gemm(qt.data, fmt, x8), ref) < kernels.ACT_QUANT_REL_ERROR


@needs_native
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_batched_rows_equal_the_gemv(fmt):
    qt = _weights(fmt, out=33, blocks=3)
    x = torch.randn(9, qt.shape[1], generator=torch.Generator().manual_seed(5))  # two tiles of 4, one row left over
    y = NATIVE.gemm(qt.data, fmt, x)
    for r in range(9):  # the tile runs the GEMV's own arithmetic per row: bit for bit
        assert torch.equal(y[r], NATIVE.gemm(qt.data, fmt, x[r:r + 1].contiguous())[0]), r


@needs_native
def test_gemm_writes_into_the_output_it_is_given():
    qt = _weights(Q4_1, out=16, blocks=2)
    x = torch.randn(3, qt.shape[1], generator=torch.Generator().manual_seed(2))
    y = torch.full((3, 16), float("nan"))
    assert NATIVE.gemm(qt.data, Q4_1, x, y=y) is y  # every element written, the caller's tensor returned
    assert torch.equal(y, NATIVE.gemm(qt.data, Q4_1, x))
    for bad in (torch.empty(3, 15), torch.empty(16, 3).t(), torch.empty(3, 16, dtype=torch.float64)):
        with pytest.raises(InvalidInputError, match=r"takes a contiguous float32 \[3, 16\]"):
            NATIVE.gemm(qt.data, Q4_1, x, y=bad)


@needs_native
@pytest.mark.parametrize("fmt", [Q4_1, Q4_K], ids=lambda f: f.name)
def test_zero_activation_block_and_bad_sizes(fmt):
    qt = _weights(fmt, blocks=2)
    k = qt.shape[1]
    x = torch.zeros(1, k)
    x[0, k - 24] = 3.0  # the first block all zero: d = 0, its q all zero
    ref = qt.dequantize()[:, k - 24].double() * 3.0
    assert _rel(NATIVE.gemm(qt.data, fmt, x)[0], ref) < kernels.ACT_QUANT_REL_ERROR
    with pytest.raises(InvalidInputError, match=f"multiple of its {fmt.block_weights}-weight blocks"):
        NATIVE.gemm(qt.data[:, :10], fmt, torch.zeros(1, fmt.block_weights + 16))
    with pytest.raises(InvalidInputError, match="Q2_K is not a kernel format"):
        NATIVE.gemm(qt.data, BY_NAME["Q2_K"], x)


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
    """Formats mixed in one call, as a llama-quantize Q4_K_M file mixes them in a layer."""
    shapes = ((Q4_0, 24, 5), (Q4_1, 7, 2), (Q8_0, 40, 3), (Q4_1, 1, 1), (Q4_K, 9, 2), (BY_NAME["Q5_0"], 5, 3),
              (Q6_K, 17, 1), (BY_NAME["Q5_K"], 3, 3), (BY_NAME["Q5_1"], 6, 1))
    items = [(_weights(f, out=o, blocks=b, seed=i).data, f, torch.randn(b * f.block_weights))
             for i, (f, o, b) in enumerate(shapes)]
    ys = NATIVE.gemv_list(items).run()
    for (w, f, x), y in zip(items, ys):
        assert torch.equal(y, NATIVE.gemm(w, f, x[None])[0]), f.name
    bad = NATIVE.gemv_list([(items[0][0], BY_NAME["Q2_K"], items[0][2])])
    with pytest.raises(InvalidInputError, match="not a kernel format"):
        bad.run()


@needs_native
def test_shared_input_gemvs_equal_one_gemm_per_matrix():
    """q/k/v or gate/up of a decoder layer on one input, formats mixed (a Q4_K_M file's layer keeps
    some in Q6_K or Q8_0), with and without bias: one call, each as its own batch-1 GEMM."""
    g = torch.Generator().manual_seed(7)
    for fmts in ((Q4_1, Q4_1, Q4_1), (Q4_K, Q6_K, Q8_0), (Q8_0, BY_NAME["Q5_1"])):
        in_features = 512
        items = [(_weights(f, out=o, blocks=in_features // f.block_weights, seed=i).data, f,
                  torch.randn(o, generator=g) if i % 2 else None) for i, (f, o) in enumerate(zip(fmts, (33, 8, 70)))]
        x = torch.randn(in_features, generator=g)
        ys = NATIVE.gemv_shared(items, x)
        for (w, f, b), y in zip(items, ys):
            assert torch.equal(y, NATIVE.gemm(w, f, x[None], b)[0]), f.name
    with pytest.raises(InvalidInputError, match="not a kernel format"):
        NATIVE.gemv_shared([(items[0][0], BY_NAME["Q2_K"], None)], x)


@pytest.mark.skipif(NATIVE is None, reason=f"no native quantised kernels: {WHY}")
def test_portable_c_path_passes_the_self_check(tmp_path):
    """The same source built for plain x86-64 (no AVX2): the fallback the ISA checks choose off x86's vector units."""
    import ctypes
    import subprocess

    from flexplan.executor.native import _compiler

    lib = tmp_path / "portable.so"
    subprocess.run([_compiler(), "-O2", "-march=x86-64", "-fopenmp", "-shared", "-fPIC", "-std=gnu11",
                    *map(str, kernels.SOURCES), "-o", str(lib)], check=True, capture_output=True, timeout=120)
    portable = kernels.NativeQuant(ctypes.CDLL(str(lib)), lib)
    assert portable.isa == "portable"
    kernels._self_check(portable)  # every format, the C float16 conversion included (x86-64 has no F16C)
    for fmt in FORMATS:
        qt = _weights(fmt)
        x = torch.randn(5, qt.shape[1])
        assert _rel(portable.gemm(qt.data, fmt, x), NATIVE.gemm(qt.data, fmt, x).double()) < 1e-5, fmt.name


def test_the_int8_activation_is_quantised_exactly_as_the_reference_rounds_it():
    """An identity weight in Q8_0 (d = 1, one-hot rows) returns d_a * q_a of each input element:
    the vectorised quantisation equals the reference bit for bit, ties to even included (llama.cpp's
    SIMD quantisers round so; its scalar reference rounds them away from zero)."""
    blocks, k = 4, 4 * 32
    raw = torch.zeros(k, blocks, 34, dtype=torch.uint8)
    raw[:, :, 1] = 0x3C  # float16 1.0, little-endian
    for o in range(k):
        raw[o, o // 32, 2 + o % 32] = 1
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5)) * 3
    x[0, :8] = torch.tensor([127.0, 2.5, -3.5, 0.49999997, 1.5, -0.5, 0.5, -126.5])  # d = 1: exact halves
    x[1, 32:64] = 0.0  # an all-zero block: d = 0, q = 0
    y = NATIVE.gemm(raw.reshape(k, -1), Q8_0, x)
    assert torch.equal(y, kernels.quantized_activation(x, 32).float())
    assert y[0, :8].tolist() == [127.0, 2.0, -4.0, 0.0, 2.0, 0.0, 0.0, -126.0]


@needs_native
def test_q4_1_takes_q8_1s_float16_sum():
    """A Q4_1 block of d = 0 and m = 1 returns its activation block's s: float16(d * sum q), d =
    max|x| / 127 before its own rounding (llama.cpp's quantize_row_q8_1), not float16(d) * sum q."""
    k = 2 * 32  # two blocks: every summation order adds the two s alike
    raw = torch.zeros(2, 2, 20, dtype=torch.uint8)
    raw[:, :, 2:4] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # m = float16 1.0; d = 0
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(7)) * 2
    y = NATIVE.gemm(raw.reshape(2, -1), Q4_1, x)
    xb = x.reshape(5, 2, 32)
    amax = xb.abs().amax(-1)
    q = torch.round(xb * (127 / amax)[..., None])
    s = ((amax / 127) * q.sum(-1)).half().float()
    assert torch.equal(y[:, 0], s.sum(-1)) and torch.equal(y[:, 1], y[:, 0])


# ---- the interleaved layout (flexplan.quant.interleave, quant_gemv.c's X8) ------------------------------
X8_FORMATS = [f for f in FORMATS if NATIVE is not None and NATIVE.x8_layout(f) is not None]
needs_x8 = pytest.mark.skipif(not X8_FORMATS, reason="no interleaved kernel in this build (no AVX2)")


@needs_x8
@pytest.mark.parametrize("out", [8, 21])
@pytest.mark.parametrize("fmt", X8_FORMATS, ids=lambda f: f.name)
def test_interleaved_blocks_round_trip_and_keep_each_rows_bytes_in_its_range(fmt, out):
    qt = _weights(fmt, out=out, blocks=3)
    run = NATIVE.x8_layout(fmt)
    assert sorted(run.tolist()) == list(range(8 * fmt.block_bytes))  # a permutation of a group's blocks
    packed = NATIVE.x8_pack(qt.data, fmt)
    assert packed.shape == qt.data.shape and torch.equal(NATIVE.x8_pack(packed, fmt, unpack=True), qt.data)
    assert torch.equal(interleave.unpack(packed, run), qt.data)  # torch's copy (an accelerator's), the same permutation
    # its index built once per device, width and layout: the next call (an accelerator's next step) reuses it
    row_bytes = packed.shape[1]
    assert interleave._group_index(run, row_bytes, packed.device)[1] is interleave._group_index(run, row_bytes, packed.device)[1]
    assert torch.equal(interleave.unpack(packed, run), qt.data)
    assert not torch.equal(packed[:8], qt.data[:8])
    for g in range(out // 8):  # each group's bytes stay within its 8 rows; rows past the groups as the file's
        assert sorted(packed[8 * g:8 * g + 8].flatten().tolist()) == sorted(qt.data[8 * g:8 * g + 8].flatten().tolist())
    assert torch.equal(packed[out // 8 * 8:], qt.data[out // 8 * 8:])
    k = qt.shape[1]
    assert torch.equal(NATIVE.dequantize(packed, fmt, k, interleaved=True).view(torch.int32),
                       qt.dequantize().view(torch.int32))


@needs_x8
@pytest.mark.parametrize("fmt", X8_FORMATS, ids=lambda f: f.name)
def test_interleaved_kernels_agree_with_the_files_layout(fmt):
    """The float path bit for bit (the same double sums of the same rows); the int8 path to float32
    rounding of the same integer dots, within the int8 path's bound of its float64 reference."""
    qt = _weights(fmt, out=45, blocks=4)  # five groups and five rows past them
    packed = NATIVE.x8_pack(qt.data, fmt)
    g = torch.Generator().manual_seed(3)
    x, b = torch.randn(6, qt.shape[1], generator=g), torch.randn(45, generator=g)
    assert torch.equal(NATIVE.gemm(packed, fmt, x, b, float_act=True, interleaved=True),
                       NATIVE.gemm(qt.data, fmt, x, b, float_act=True))
    y = NATIVE.gemm(packed, fmt, x, b, interleaved=True)
    assert _rel(y, kernels.int8_activation_reference(qt, x, b)) < kernels.INT8_PATH_REL_ERROR
    assert _rel(y, NATIVE.gemm(qt.data, fmt, x, b).double()) < 1e-5


@needs_x8
@pytest.mark.parametrize("fmt", X8_FORMATS, ids=lambda f: f.name)
def test_interleaved_rows_do_not_depend_on_the_batch(fmt):
    """Each activation row's outputs bit for bit as its own GEMV, whatever the batch (tiles of 4, 2
    and 1 rows): what keeps a request's greedy tokens independent of what shares its batch."""
    qt = _weights(fmt, out=32, blocks=3)
    packed = NATIVE.x8_pack(qt.data, fmt)
    x = torch.randn(11, qt.shape[1], generator=torch.Generator().manual_seed(5))
    y = NATIVE.gemm(packed, fmt, x, interleaved=True)
    for r in range(11):
        assert torch.equal(y[r], NATIVE.gemm(packed, fmt, x[r:r + 1].contiguous(), interleaved=True)[0]), r
    items = [(packed, fmt, None), (packed[:16].contiguous(), fmt, torch.randn(16))]
    for (w, f, bias), one in zip(items, NATIVE.gemv_shared(items, x[0], interleaved=True)):
        assert torch.equal(one, NATIVE.gemm(w, f, x[:1], bias, interleaved=True)[0])


@needs_native
def test_the_interleaved_flag_on_a_format_without_its_kernel_is_refused():
    fmt = BY_NAME["Q2_K"]  # dequantised at load: no kernel reads its blocks, interleaved or not
    assert NATIVE.x8_layout(fmt) is None
    qt = kernels.QuantTensor("", torch.zeros(8, fmt.row_bytes(256), dtype=torch.uint8), (8, 256), fmt)
    with pytest.raises(InvalidInputError, match="not a kernel format"):
        NATIVE.gemm(qt.data, fmt, torch.randn(1, 256), interleaved=True)


@needs_x8
def test_quant_linear_holds_interleaved_blocks_and_gives_the_files_back():
    from flexplan.quant.quant_linear import QuantLinear

    qt = _weights(X8_FORMATS[0], out=24, blocks=4)
    lin = QuantLinear(qt)
    assert lin.interleaved and torch.equal(lin.file_blocks(), qt.data)
    x = torch.randn(3, qt.shape[1])
    ref = torch.nn.functional.linear(x.double(), qt.dequantize().double())
    assert _rel(lin.forward_dequantised(x), ref) < 1e-6  # the accelerator's path, through the file's layout
    assert _rel(lin(x), ref) < 2e-2


@needs_x8
def test_the_vnni_form_of_the_interleaved_kernel_gives_the_same_bits(tmp_path):
    """The interleaved kernel's VNNI form (one dpbusd per four products), built here with dpbusd
    emulated by AVX2 (this CPU may have no VNNI): the self-check, and bit for bit the AVX2 form's
    results (integer dots are exact either way)."""
    import ctypes
    import subprocess

    from flexplan.executor.native import _compiler

    lib = tmp_path / "vnni_form.so"
    emulated = "X8_DPBUSD(a,u,s)=_mm256_add_epi32(a,_mm256_madd_epi16(_mm256_maddubs_epi16(u,s),_mm256_set1_epi16(1)))"
    subprocess.run([_compiler(), "-O2", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", f"-D{emulated}",
                    *map(str, kernels.SOURCES), "-o", str(lib)], check=True, capture_output=True, timeout=120)
    vnni = kernels.NativeQuant(ctypes.CDLL(str(lib)), lib)
    kernels._self_check(vnni)
    for fmt in X8_FORMATS:
        qt = _weights(fmt, out=45, blocks=4)
        packed = NATIVE.x8_pack(qt.data, fmt)
        x = torch.randn(6, qt.shape[1], generator=torch.Generator().manual_seed(2))
        assert torch.equal(vnni.gemm(packed, fmt, x, interleaved=True), NATIVE.gemm(packed, fmt, x, interleaved=True))
