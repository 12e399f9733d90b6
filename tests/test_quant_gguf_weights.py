"""flexplan.quant.gguf_weights: a GGUF file's raw blocks, dequantised bit for bit as the gguf
package's reference does, Llama's q/k rows permuted on whole rows of blocks as transformers does."""

import os
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from conftest import needs_gguf
from flexplan.errors import InvalidInputError
from flexplan.quant.formats import Q4_1, Q8_0
from flexplan.quant.gguf_weights import hf_rows, read_gguf

LLAMA_QUANTIZE = os.environ.get("FLEXPLAN_LLAMA_QUANTIZE") or shutil.which("llama-quantize") or \
    "/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-quantize"


def _reference(path) -> dict[str, np.ndarray]:
    return {t.name: gguf.quants.dequantize(np.array(t.data), t.tensor_type) for t in gguf.GGUFReader(path).tensors}


def _bitwise_equal(got: torch.Tensor, ref: np.ndarray) -> bool:
    ref = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    return got.shape == ref.shape and torch.equal(got.view(torch.int32), ref.view(torch.int32))


def _write(path, tensors, arch="llama", **fields):
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in fields.items():
        getattr(w, f"add_{k}")(v)
    for name, (data, qtype) in tensors.items():
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, data.astype(np.float16 if qtype == gguf.GGMLQuantizationType.F16 else np.float32))
        else:
            raw = gguf.quants.quantize(data, qtype) if qtype.name in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1") else data
            w.add_tensor(name, raw, raw_dtype=qtype)  # the weight shape follows from the block bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _random_blocks(rng, rows, blocks, qtype, fp16_at):
    """Raw blocks of random bytes, the float16 fields at ``fp16_at`` sane values (a block of any layout)."""
    raw = rng.integers(0, 256, (rows * blocks, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    for at in fp16_at:
        raw[:, at:at + 2] = (rng.uniform(-1e-2, 1e-2, rows * blocks).astype(np.float16).view(np.uint8)
                             .reshape(-1, 2))
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    Q = gguf.GGMLQuantizationType
    tensors = {f"t.{q.name}": (rng.standard_normal((24, 96)).astype(np.float32) * 0.1, q)
               for q in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.F16, Q.F32)}
    # gguf has no K-quant quantiser: random blocks, 2 super-blocks a row (plus Q2_K: dequantised at load)
    for q, fp16_at in ((Q.Q4_K, (0, 2)), (Q.Q5_K, (0, 2)), (Q.Q6_K, (208,)), (Q.Q2_K, (80, 82))):
        tensors[f"t.{q.name}"] = (_random_blocks(rng, 8, 2, q, fp16_at), q)
    tensors["norm"] = (rng.standard_normal(96).astype(np.float32), Q.F32)
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    _write(path, tensors, head_count=2)
    return path


def test_small_file_raw_blocks_and_bitwise_dequantisation(small_file):
    w = read_gguf(small_file)
    assert w.architecture == "llama" and w.field("{arch}.attention.head_count") == 2
    ref = _reference(small_file)
    for name, t in w.tensors.items():
        assert t.data.dtype == torch.uint8  # the blocks as stored, no float copy
        assert t.nbytes == t.format.tensor_bytes(int(np.prod(t.shape[:-1])), t.shape[-1])
        assert _bitwise_equal(t.dequantize(), ref[name]), name
    assert w.tensors["t.Q4_1"].shape == (24, 96) and w.tensors["t.Q4_1"].format is Q4_1
    assert w.tensors["t.Q8_0"].nbytes == 24 * 3 * 34
    assert w.tensors["t.Q4_K"].shape == (8, 512) and w.tensors["t.Q4_K"].nbytes == 8 * 2 * 144
    assert w.tensors["t.Q6_K"].format.native_kernel and not w.tensors["t.Q2_K"].format.native_kernel


def test_a_type_flexplan_does_not_read_is_refused_by_name(tmp_path):
    path = tmp_path / "q8k.gguf"
    raw = np.zeros((4, 292), dtype=np.uint8)  # 4 rows of one Q8_K block (llama.cpp's activation format)
    _write(path, {"blk.0.attn_q.weight": (raw, gguf.GGMLQuantizationType.Q8_K)})
    with pytest.raises(InvalidInputError, match=r"Q8_K \(tensor blk\.0\.attn_q\.weight\) is not supported.*llama-quantize"):
        read_gguf(path)


def test_a_type_the_installed_gguf_cannot_dequantise_is_refused_by_name(tmp_path, monkeypatch):
    from flexplan.quant import gguf_weights

    path = tmp_path / "iq4.gguf"
    _write(path, {"blk.0.attn_q.weight": (np.zeros((4, 136), np.uint8), gguf.GGMLQuantizationType.IQ4_XS)})
    assert read_gguf(path).tensors["blk.0.attn_q.weight"].format.name == "IQ4_XS"
    monkeypatch.setattr(gguf_weights, "_gguf_dequantises", lambda fmt: False)  # as an older gguf package
    with pytest.raises(InvalidInputError, match=r"blk\.0\.attn_q\.weight is IQ4_XS, which the installed gguf "
                                                r"package \(gguf .*\) cannot dequantise; upgrade gguf"):
        read_gguf(path)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(InvalidInputError, match="not a readable GGUF file"):
        read_gguf(tmp_path / "x.gguf")


@pytest.mark.parametrize("keep", [40, 200, 0.6])
def test_a_file_cut_short_is_refused_not_a_trace(tmp_path, keep):
    """A truncated download ends anywhere: in the header's strings (gguf's parser raised IndexError),
    in a tensor's data (ValueError); either is one clear refusal."""
    path = tmp_path / "whole.gguf"
    _write(path, {"blk.0.attn_q.weight": (np.ones((64, 64), np.float32), gguf.GGMLQuantizationType.Q4_1)})
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(InvalidInputError, match="not a readable GGUF file, corrupt or cut short"):
        read_gguf(cut)


def test_row_permutation_moves_whole_rows_of_blocks():
    rows = torch.arange(8, dtype=torch.uint8)[:, None].repeat(1, 20)  # row r: 20 bytes of r (one Q4_1 block)
    from flexplan.quant.gguf_weights import QuantTensor

    t = hf_rows(QuantTensor("q", rows, (8, 32), Q4_1), n_head=2)
    # per head, rows [2, dim] -> [dim, 2]: (0 1 2 3) -> (0 2 1 3)
    assert t.data[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7] and bool((t.data == t.data[:, :1]).all())
    with pytest.raises(InvalidInputError, match="rotary pairs"):
        hf_rows(QuantTensor("q", rows, (8, 32), Q4_1), n_head=3)


# ---- the shipped SmolLM2 file ---------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    from flexplan.smollm import gguf_path

    return read_gguf(gguf_path())


@needs_gguf
def test_smollm2_first_layer_and_embedding_dequantise_bit_for_bit(smollm2):
    assert smollm2.formats() == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    ref = {t.name: gguf.quants.dequantize(np.array(t.data), t.tensor_type)
           for t in gguf.GGUFReader(smollm2.path).tensors if t.name.startswith(("blk.0.", "token_embd"))}
    assert len(ref) == 10
    assert all(_bitwise_equal(smollm2.tensors[n].dequantize(), r) for n, r in ref.items())


@pytest.mark.slow
@needs_gguf
def test_every_tensor_of_smollm2_dequantises_bit_for_bit(smollm2):
    assert smollm2.formats() == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    ref = _reference(smollm2.path)
    assert set(ref) == set(smollm2.tensors)
    bad = [n for n, t in smollm2.tensors.items() if not _bitwise_equal(t.dequantize(), ref[n])]
    assert not bad
    assert smollm2.tensors["token_embd.weight"].format is Q8_0  # the tied embedding / LM head


@needs_gguf
@pytest.mark.parametrize("layer", [0, 29])
def test_smollm2_q_k_rows_permuted_as_transformers_does(smollm2, layer):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    proc = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for kind in ("attn_q", "attn_k", "attn_v"):
        name = f"blk.{layer}.{kind}.weight"
        ref = proc.process(weights=smollm2.tensors[name].dequantize().numpy(), name=name).weights
        t = smollm2.hf_tensor(name)
        assert t.format is Q4_1 and t.data.dtype == torch.uint8
        assert _bitwise_equal(t.dequantize(), ref), name
    assert smollm2.hf_tensor(f"blk.{layer}.attn_v.weight") is smollm2.tensors[f"blk.{layer}.attn_v.weight"]


@pytest.mark.slow
@needs_gguf
def test_smollm2_permuted_blocks_equal_transformers_loaded_float_weights(smollm2):
    """Against the float32 folder transformers converts the same file into (flexplan.smollm)."""
    from safetensors import safe_open

    from flexplan.smollm import default_model_dir

    with safe_open(Path(default_model_dir(verbose=False)) / "model.safetensors", "pt") as f:
        for layer in (0, 17):
            for gguf_name, hf_name in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_output", "o_proj")):
                want = f.get_tensor(f"model.layers.{layer}.self_attn.{hf_name}.weight")
                got = smollm2.hf_tensor(f"blk.{layer}.{gguf_name}.weight").dequantize()
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (layer, hf_name)


@pytest.mark.slow
@needs_gguf
@pytest.mark.skipif(not Path(LLAMA_QUANTIZE).exists(), reason="llama.cpp's llama-quantize is not built")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K_M"])
def test_files_made_by_llama_quantize_dequantise_bit_for_bit(smollm2, tmp_path, qtype):
    out = tmp_path / f"smollm2-{qtype}.gguf"
    r = subprocess.run([LLAMA_QUANTIZE, "--allow-requantize", str(smollm2.path), str(out), qtype, "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    w = read_gguf(out)
    assert qtype.split("_K")[0] in " ".join(w.formats())
    ref = _reference(out)
    bad = [n for n, t in w.tensors.items() if not _bitwise_equal(t.dequantize(), ref[n])]
    assert not bad
