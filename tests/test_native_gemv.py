"""flexplan's native blocked GEMV (flexplan/executor/native.py, native_gemv.c) and its fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexplan.errors import InvalidInputError
from flexplan.executor import cpu_backend, cpu_linear, native

needs_native = pytest.mark.skipif(not native.available(), reason=f"{native.status()[1]}")


@pytest.fixture
def fresh_status():
    """native.status() recomputed under the test's environment, and again after it."""
    native.status.cache_clear()
    yield
    native.status.cache_clear()


@needs_native
@pytest.mark.parametrize("tokens", [1, 2, 5, 6, 7, 13, 64, 200])
@pytest.mark.parametrize("out,k,with_bias", [(64, 7, False), (192, 300, True), (128, 1000, True)])
def test_blocked_linear_matches_f_linear(tokens, out, k, with_bias):
    g = torch.Generator().manual_seed(tokens * 1000 + out + k)
    w = torch.randn(out, k, generator=g)
    x = torch.randn(1, tokens, k, generator=g)  # [batch, seq, in] as a decoder layer passes it
    b = torch.randn(out, generator=g) if with_bias else None
    p = cpu_linear.pack(w, 1, cpu_linear.KERNEL_BLOCKED)
    assert p.shape == (out // 64, k, 64) and cpu_linear.is_blocked(p)
    y = cpu_linear.linear(x, p, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (1, tokens, out) and y.dtype == torch.float32
    assert float((y.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [2, 9, 64, 160, 161, 165, 200])
def test_many_rows_equal_each_row_alone_bit_for_bit(dtype, tokens):
    """A decode batch's or a prefill's rows (row passes fetching ahead in turn; AVX2 from 160 rows
    16-column panels, with 1-5 rows left over) give each row exactly what a one-row decode step
    gives it: every output sums over the inputs in one order."""
    g = torch.Generator().manual_seed(tokens)
    w = torch.randn(192, 300, generator=g).to(dtype)
    x = torch.randn(1, tokens, 300, generator=g)
    b = torch.randn(192, generator=g)
    p = cpu_linear.pack(w, 1, cpu_linear.KERNEL_BLOCKED, torch.float32)
    y = cpu_linear.linear(x, p, b)
    alone = torch.cat([cpu_linear.linear(x[:, t:t + 1], p, b) for t in range(tokens)], dim=1)
    assert torch.equal(y, alone)


@needs_native
def test_blocked_weights_read_back_exactly_and_refuse_stock_f_linear():
    w = torch.randn(128, 40)
    p = cpu_linear.pack(w, None, cpu_linear.KERNEL_BLOCKED)
    assert torch.equal(cpu_linear.dense(p), w)
    with pytest.raises(RuntimeError):
        F.linear(torch.randn(1, 40), p)  # a 3-D weight: stock F.linear never computes garbage from it


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_padded_last_block_gives_the_weights_rows_and_reads_back_exactly(dtype):
    """A [100, 40] weight blocked in two blocks (the second zero-filled past row 100): the linear
    with ``out_features`` gives 100 columns, bias added, and ``dense`` with the row count is W."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(100, 40, generator=g).to(dtype)
    b = torch.randn(100, generator=g)
    x = torch.randn(2, 3, 40, generator=g)
    p = cpu_linear.block(w)
    assert p.shape == (2, 40, 64) and not p[1, :, 36:].any()
    assert torch.equal(cpu_linear.dense(p, 100), w)
    y = cpu_linear.linear(x, p, b, out_features=100)
    assert y.shape == (2, 3, 100)
    assert torch.allclose(y, F.linear(x, w.float(), b), rtol=1e-5, atol=1e-5)


@needs_native
def test_a_blocked_embedding_subclass_keeps_its_own_forward():
    """Gemma's embedding scales the rows it looks up (``super().forward(ids) * embed_scale``); held
    blocked, the lookup was answered without the scale and Gemma's tokens differed from
    transformers'. The subclass's forward runs now, its lookup read out of the blocks."""

    class Scaled(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 3.0

    torch.manual_seed(0)
    m = Scaled(130, 16)
    ids = torch.tensor([[0, 5, 129], [64, 7, 7]])
    expected = m(ids)
    m.weight = torch.nn.Parameter(cpu_linear.pack_embedding(m.weight.detach(), torch.float32), requires_grad=False)
    cpu_linear.install_embedding(m)
    assert cpu_linear.is_blocked(m.weight) and torch.equal(m(ids), expected)


@needs_native
def test_weights_that_cannot_be_blocked_take_onednn_or_stay_dense():
    odd = torch.randn(48, 40)  # rows not a multiple of 64
    half = torch.randn(128, 40).to(torch.bfloat16)
    for w in (odd, half):
        p = cpu_linear.pack(w, 1, cpu_linear.KERNEL_BLOCKED)
        assert not cpu_linear.is_blocked(p)
        assert p.is_mkldnn == cpu_linear.packing_available(w.dtype)


@pytest.mark.skipif(not cpu_linear.packing_available(torch.bfloat16), reason="oneDNN cannot pack bf16 here")
@pytest.mark.parametrize("shape", [(1, None), (2, None), (3, None), (2, 1, None), (1, 2, None), (5, None)])
def test_padded_bf16_gemv_gives_the_unpadded_rows_exactly(shape):
    """1-2 bf16 rows are zero-padded for oneDNN on a large weight (``packed_linear``): the rows that
    come back, in the input's shape, are F.linear's bit for bit."""
    out, k = 1024, cpu_linear.BF16_PAD_MIN_WEIGHT_BYTES // 2 // 1024
    g = torch.Generator().manual_seed(len(shape) * 10 + shape[0])
    w = torch.randn(out, k, generator=g).to(torch.bfloat16)
    b = torch.randn(out, generator=g).to(torch.bfloat16)
    x = torch.randn(*shape[:-1], k, generator=g).to(torch.bfloat16)
    y = cpu_linear.linear(x, cpu_linear.pack(w, 1, cpu_linear.KERNEL_PACKED), b)
    assert y.shape == (*shape[:-1], out)
    assert torch.equal(y, F.linear(x, w, b))


def test_disabled_native_kernel_falls_back_with_its_reason(monkeypatch, fresh_status):
    monkeypatch.setenv("FLEXPLAN_NATIVE", "0")
    gemv, why = native.status()
    assert gemv is None and "FLEXPLAN_NATIVE=0" in why
    assert cpu_linear.default_kernel() != cpu_linear.KERNEL_BLOCKED
    with pytest.raises(InvalidInputError, match="FLEXPLAN_NATIVE"):
        cpu_backend.configure(linear_kernel=cpu_linear.KERNEL_BLOCKED)
    # packing for the blocked kernel without it gives oneDNN's layout (or dense), never a wrong one
    assert not cpu_linear.is_blocked(cpu_linear.pack(torch.randn(64, 8), 1, cpu_linear.KERNEL_BLOCKED))


def test_broken_compiler_leaves_no_library_and_says_why(monkeypatch, tmp_path, fresh_status):
    if "built for Linux x86-64" in native.status()[1]:
        pytest.skip("not Linux x86-64")
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: no such option' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(tmp_path / "cache"))
    native.status.cache_clear()
    gemv, why = native.status()
    assert gemv is None and "failed" in why and "no such option" in why
    leftovers = list((tmp_path / "cache").rglob("*")) if (tmp_path / "cache").exists() else []
    assert not [f for f in leftovers if f.is_file()]  # no half-written library


def test_unknown_kernel_is_refused_with_the_choices():
    with pytest.raises(InvalidInputError, match="flexplan-blocked, onednn-packed, F.linear"):
        cpu_backend.configure(linear_kernel="mkl")


@pytest.mark.parametrize("march,isa", [("x86-64-v4", "avx512f"), ("x86-64-v3", "avx2"),
                                       pytest.param("x86-64", "generic", marks=pytest.mark.slow)])  # ~4 s to build
def test_every_isa_path_passes_the_self_check(tmp_path, march, isa):
    """The AVX-512, AVX2 and plain-C paths of native_gemv.c, each built for its own ISA level and
    checked against F.linear (the build for this CPU takes only one of them)."""
    import ctypes
    import subprocess

    cc = native._compiler()
    if cc is None or not native.status()[1].startswith("native GEMV ("):
        pytest.skip(native.status()[1])
    here = native.status()[0].isa  # what this CPU runs: never build past it (SIGILL)
    if (isa == "avx512f" and here != "avx512f") or (isa == "avx2" and here == "generic"):
        pytest.skip(f"this CPU runs {here}, not {isa}")
    so = tmp_path / f"gemv-{march}.so"
    flags = [f if f != "-march=native" else f"-march={march}" for f in native.CFLAGS]
    subprocess.run([cc, *flags, str(native.SOURCE), "-o", str(so)], check=True, capture_output=True)
    built = native.NativeGemv(ctypes.CDLL(str(so)), so)
    assert built.isa == isa
    native._self_check(built)


@needs_native
@pytest.mark.parametrize("vocab", [192, 200])
def test_tied_embedding_and_head_share_one_blocked_weight(vocab):
    """A tied LM head streams from the blocked layout too: the embedding's weight is blocked once
    (its lookup reads rows out of the blocks; a vocabulary that is not a multiple of 64 fills the
    last block with zeros), the head computes from the same tensor and gives the vocabulary's
    logits, no second copy is made, and greedy tokens match transformers."""
    import copy

    import transformers

    import flexplan.api as api
    from flexplan.executor.plans import fixed_plan

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=True,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, vocab, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    plan = fixed_plan(cfg, "cpu", "cpu", 0, batch_size=2, input_len=7, output_len=6, cpu_dtype="float32")
    lm = api.load(copy.deepcopy(ref), plan=plan, accelerator="cpu", gpu_memory_bytes=2**30)
    assert torch.equal(lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False), expected)
    emb = lm.model.get_input_embeddings().weight
    assert cpu_linear.is_blocked(emb) and lm.model.lm_head.weight.data_ptr() == emb.data_ptr()
    assert torch.equal(cpu_linear.dense(emb, vocab), ref.get_input_embeddings().weight)
    with torch.inference_mode():
        x = torch.randn(3, 64)
        assert torch.allclose(lm.model.lm_head(x), ref.lm_head(x), rtol=1e-5, atol=1e-5)
    weights = sum(b.nbytes for b in lm.executor.link.live_buffers("host") if not b.tag.startswith("KV"))
    model_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())  # the tied weight once
    zero_rows = (cpu_linear.blocked_rows(vocab) - vocab) * 64 * 4  # the last block's fill
    assert model_bytes + zero_rows <= weights < model_bytes + zero_rows + 64 * len(list(ref.parameters()))


@needs_native
@pytest.mark.parametrize("vocab", [192, 200])
def test_tied_head_of_a_16bit_cpu_is_blocked_and_read_by_the_native_gemv(vocab):
    """A CPU computing in bfloat16 held a tied head dense (oneDNN's layout cannot be indexed for the
    lookup) and ran it as a dense bf16 matmul: 4.4-4.8 ms a step for SmolLM2's 57 MB head on the
    Zen 4 VM. It is blocked now, in bfloat16 (the same bytes): lookups return the bf16 rows as they
    are, the head is the float32 GEMV of the bf16 weight cast back to bf16, and greedy tokens match
    transformers' bf16 model."""
    import copy

    import transformers

    import flexplan.api as api
    from flexplan.executor.plans import fixed_plan

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=True,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ref = transformers.LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    ids = torch.randint(3, vocab, (2, 7))
    plan = fixed_plan(cfg, "cpu", "cpu", 0, batch_size=2, input_len=7, output_len=4, cpu_dtype="bfloat16")
    lm = api.load(copy.deepcopy(ref), plan=plan, accelerator="cpu", gpu_memory_bytes=2**30)
    emb_module = lm.model.get_input_embeddings()
    emb = emb_module.weight
    assert cpu_linear.is_blocked(emb) and emb.dtype == torch.bfloat16
    assert lm.model.lm_head.weight.data_ptr() == emb.data_ptr()
    with torch.inference_mode():
        rows = emb_module(ids)
        assert rows.dtype == torch.bfloat16 and torch.equal(rows, ref.get_input_embeddings()(ids))
        x = torch.randn(3, 64).to(torch.bfloat16)
        got = lm.model.lm_head(x)
        expect = (x.float() @ ref.lm_head.weight.float().T).to(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), expect.float(), rtol=1e-2, atol=1e-2)
        out = lm.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 11) and torch.equal(out, ref.generate(input_ids=ids, max_new_tokens=4, do_sample=False))


@needs_native
def test_blocked_weights_are_not_repacked_for_another_decode_batch():
    """Only oneDNN's layout depends on the decode batch; with every weight blocked, a plan for
    another batch class allocates nothing and the tokens stay the same."""
    import transformers

    import flexplan.api as api
    from flexplan.executor.plans import fixed_plan

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=192, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 192, (1, 7))
    expected = ref.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    kw = dict(input_len=7, output_len=5, cpu_dtype="float32")
    import copy

    lm = api.load(copy.deepcopy(ref), plan=fixed_plan(cfg, "cpu", "cpu", 0, batch_size=1, **kw), accelerator="cpu",
                  gpu_memory_bytes=2**30, cpu_linear_kernel=cpu_linear.KERNEL_BLOCKED)
    linears = [m for m in lm.model.modules() if type(m) is torch.nn.Linear]
    assert linears and all(cpu_linear.is_blocked(m.weight) for m in linears)
    n = sum(lm.executor.link.allocations.values())
    lm.executor.place(fixed_plan(cfg, "cpu", "cpu", 0, batch_size=3, **kw))
    assert sum(lm.executor.link.allocations.values()) == n
    assert torch.equal(lm.generate(input_ids=ids, max_new_tokens=5, do_sample=False), expected)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,with_bias", [(1, False), (3, True), (7, True), (40, False)])
def test_16bit_blocked_weights_compute_exactly_as_their_float32_widening(dtype, tokens, with_bias):
    """A 16-bit weight blocked for a float32 computation stays 16-bit (half the bytes) and gives
    the float32 kernel's result on ``w.float()`` bit for bit: the widening is exact and the
    summation order the same."""
    g = torch.Generator().manual_seed(tokens)
    w = (torch.randn(192, 300, generator=g) * 3).to(dtype)
    x = torch.randn(1, tokens, 300, generator=g)
    b = torch.randn(192, generator=g) if with_bias else None
    p = cpu_linear.pack(w, 1, cpu_linear.KERNEL_BLOCKED, torch.float32)
    assert cpu_linear.is_blocked(p) and p.dtype == dtype and torch.equal(cpu_linear.dense(p), w)
    assert cpu_linear.stored_dtype(tuple(w.shape), dtype, torch.float32, cpu_linear.KERNEL_BLOCKED) == dtype
    y = cpu_linear.linear(x, p, b)
    assert y.dtype == torch.float32
    assert torch.equal(y, cpu_linear.linear(x, cpu_linear.pack(w.float(), 1, cpu_linear.KERNEL_BLOCKED), b))
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert float((y.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@needs_native
def test_16bit_weights_that_cannot_be_blocked_are_widened_for_the_float32_cpu():
    """Where the blocked kernel cannot read a 16-bit weight (odd rows, another kernel) the CPU gets
    it in its compute dtype, and stored_dtype says so (the executor sizes memory with it)."""
    odd = torch.randn(48, 40).to(torch.bfloat16)
    for w, kernel in ((odd, cpu_linear.KERNEL_BLOCKED), (torch.randn(128, 40).half(), cpu_linear.KERNEL_PACKED)):
        assert cpu_linear.stored_dtype(tuple(w.shape), w.dtype, torch.float32, kernel) == torch.float32
        p = cpu_linear.pack(w, 1, kernel, torch.float32)
        assert not cpu_linear.is_blocked(p)
        assert torch.equal(cpu_linear.dense(p), w.float())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 2, 5, 6, 11, 32, 33, 70])
@pytest.mark.parametrize("out,k,with_bias", [(7, 64, True), (130, 96, False), (64, 304, True), (192, 208, True)])
def test_dense_gemv_matches_f_linear_on_the_float32_widening(dtype, tokens, out, k, with_bias):
    """The dense row-major kernel (split-points layers' CPU operators): any ``out`` (rows past the
    last group of four; above 32 batch rows, rows past the last 64-row panel), batch rows past a
    group and past a panel's chunk of ``in``, 16-bit weights widened exactly."""
    g = torch.Generator().manual_seed(tokens * 1000 + out + k)
    w = torch.randn(out, k, generator=g).to(dtype)
    x = torch.randn(tokens, k, generator=g)
    b = torch.randn(out, generator=g) if with_bias else None
    y = native.status()[0].dense_gemv(w, x, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (tokens, out) and y.dtype == torch.float32
    assert float((y.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@needs_native
def test_dense_gemv_refuses_an_inner_size_off_the_vector_width():
    gemv = native.status()[0]
    if gemv.vector_width == 1:
        pytest.skip("the plain-C build takes any inner size")
    with pytest.raises(ValueError, match="multiple of"):
        gemv.dense_gemv(torch.randn(8, gemv.vector_width + 1), torch.randn(1, gemv.vector_width + 1), None)


@pytest.mark.parametrize("rows,k,dtype,compute", [(1, 64, torch.bfloat16, torch.float32), (4, 64, torch.float32, torch.float32),
                                                  (40, 64, torch.bfloat16, torch.float32),  # packed panels
                                                  (3, 37, torch.float32, torch.float32),  # off the vector width
                                                  (2, 64, torch.bfloat16, torch.bfloat16)])  # a bf16 CPU: oneDNN
def test_split_cpu_operator_linear_is_f_linear_in_the_cpu_dtype(rows, k, dtype, compute):
    from flexplan.executor.split_layer import cpu_operator_linear

    g = torch.Generator().manual_seed(rows + k)
    w = torch.randn(96, k, generator=g).to(dtype)
    x = torch.randn(1, rows, k, generator=g).to(dtype)  # the host hidden state, in the pinned dtype
    b = torch.randn(96, generator=g).to(dtype)
    y = cpu_operator_linear(x, w, b, compute)
    ref = F.linear(x.to(compute), w.to(compute), b.to(compute)).to(dtype)
    assert y.shape == (1, rows, 96) and y.dtype == dtype
    torch.testing.assert_close(y, ref, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-2 if dtype != torch.float32 else 1e-5)
