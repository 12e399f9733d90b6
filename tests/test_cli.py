"""The `flexplan` command line: explain, hw, models; bad input gives one clear line, no traceback.

Most cases call the CLI's main() in this process (a new interpreter costs seconds of imports each);
one runs `python -m flexplan` itself, the console entry point."""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from flexplan.cli import main
from flexplan.estimator.policies import POLICIES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flexplan_process(*args, env=None, timeout=120):
    """`python -m flexplan *args` in a process of its own."""
    e = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "flexplan", *args], capture_output=True, text=True, env=e,
                          timeout=timeout, cwd=REPO)


def flexplan(*args):
    """`flexplan *args` through the CLI's main() in this process: exit code, stdout and stderr as a
    process would give them (argparse's refusals exit with 2; any other exception fails the test)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_explain_paper_setting():
    r = flexplan("explain", "facebook/opt-66b", "--hw", "flexinfer-server2", "-b", "16", "-i", "512", "-o", "32")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "prefill candidates" in out and "decode candidates" in out
    for policy in ("cpu", "gpu-offload", "gpu-offload-partial", "splitgen", "gpu"):
        assert policy in out
    assert "chosen: prefill gpu-offload" in out
    assert "why:" in out and "lower" in out


def test_explain_sweep_reports_reduction_vs_flexgen():
    r = flexplan("explain", "facebook/opt-66b", "--hw", "flexinfer-server2", "-b", "1-32", "-i", "512", "-o", "32")
    assert r.returncode == 0, r.stderr
    assert "mean E2E reduction vs gpu-offload (FlexGen)" in r.stdout
    assert r.stdout.count("\n") >= 7


def test_explain_json_is_plan_to_dict():
    r = flexplan("explain", "meta-llama/Llama-2-70b-hf", "--hw", "flexinfer-server1", "-b", "4", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["prefill"]["policy"] and d["decode"]["policy"] and d["e2e_s"] > 0
    assert len(d["candidates"]) == 2 * len(POLICIES) and "gpu-offload" in d["baselines"]


def test_gpu_memory_cap_changes_the_plan():
    big = json.loads(flexplan("explain", "meta-llama/Llama-2-7b-hf", "--hw", "flexinfer-server2", "--json").stdout)
    small = json.loads(flexplan("explain", "meta-llama/Llama-2-7b-hf", "--hw", "flexinfer-server2", "--json",
                                "--gpu-memory", "6").stdout)
    assert small["gpu_memory_bytes"] == 6 * 2**30
    assert small["decode"]["gpu_layers"] < big["decode"]["gpu_layers"]


def test_models_and_hw_list():
    r = flexplan("models")
    assert r.returncode == 0 and "facebook/opt-66b" in r.stdout and "HuggingFaceTB/SmolLM2-135M-Instruct" in r.stdout
    moe = next(line for line in r.stdout.splitlines() if line.startswith("Qwen/Qwen3-30B-A3B "))
    assert "3.35B" in moe and "MoE 8 of 128 experts" in moe  # active parameters of an MoE entry
    r = flexplan_process("hw", "--list")  # the console entry point itself, once
    assert r.returncode == 0 and "flexinfer-server1" in r.stdout and "flexinfer-server2" in r.stdout


def test_hw_local():
    r = flexplan("hw")
    assert r.returncode == 0, r.stderr
    assert "cores" in r.stdout.lower()


@pytest.mark.parametrize("args, needle", [
    (["explain", "opt-67b", "--hw", "flexinfer-server2"], "facebook/opt-66b"),
    (["explain", "facebook/opt-66b", "--hw", "flexinfer-server3"], "flexinfer-server"),
    (["explain", "facebook/opt-66b", "--hw", "flexinfer-server2", "-i", "0"], "input_len"),
    (["explain", "meta-llama/Llama-2-70b-hf", "--hw", "flexinfer-server1", "--cpu-memory", "32", "--gpu-memory", "8"],
     "GiB"),
])
def test_bad_input_is_one_line(args, needle):
    r = flexplan(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert needle in r.stderr


@pytest.mark.parametrize("text, expected", [("1.5", 3 << 29), ("0.15", round(0.15 * (1 << 30))), ("0", 0)])
def test_gib_arguments_become_whole_bytes(text, expected):
    """--gpu-memory 0.15 once reached the planner as 161061273.6 bytes and was refused as not whole."""
    from flexplan.inputs import gib_bytes

    assert gib_bytes(text) == expected and isinstance(gib_bytes(text), int)
    r = flexplan("explain", "facebook/opt-13b", "--hw", "flexinfer-server2", "--gpu-memory", text)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("cmd", ["explain", "run", "validate"])
@pytest.mark.parametrize("text", ["-1", "nan", "lots"])
def test_bad_gib_argument_is_one_line(cmd, text):
    r = flexplan(cmd, *(["facebook/opt-13b"] if cmd == "explain" else []), "--gpu-memory", text)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--gpu-memory" in r.stderr, r.stderr


def test_malformed_config_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    r = flexplan("explain", str(bad), "--hw", "flexinfer-server2")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "config" in r.stderr


def test_malformed_hwdb(tmp_path, monkeypatch):
    for f in ("cpus.yaml", "gpus.yaml", "links.yaml", "servers.yaml"):
        (tmp_path / f).write_text((open(os.path.join(REPO, "hwdb", f)).read()))
    (tmp_path / "gpus.yaml").write_text("gpus: [ {id: x, : }")
    monkeypatch.setenv("FLEXPLAN_HWDB_DIR", str(tmp_path))  # read at each lookup, cached per folder
    r = flexplan("explain", "facebook/opt-66b", "--hw", "flexinfer-server2")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "gpus.yaml" in r.stderr


def test_explain_a_config_folder_not_in_the_catalog(tmp_path):
    """A model the catalog lacks, given as a folder with its config.json (an MoE of a model type
    flexplan has no entry for), is planned from its generic fields; every catalog MoE entry plans too."""
    cfg = {"model_type": "brand_new_moe", "architectures": ["BrandNewMoeForCausalLM"], "hidden_size": 2048,
           "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
           "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 64, "num_experts_per_tok": 4,
           "vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = flexplan("explain", str(tmp_path), "--hw", "flexinfer-server2", "--gpu-memory", "8", "-b", "1", "-i", "256",
                 "-o", "32", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["num_layers"] == 24 and plan["e2e_s"] > 0
    dense = dict(cfg, num_experts=0, num_experts_per_tok=0, model_type="brand_new_dense")
    (tmp_path / "config.json").write_text(json.dumps(dense))
    r2 = flexplan("explain", str(tmp_path), "--hw", "flexinfer-server2", "--gpu-memory", "8", "-b", "1", "-i", "256",
                  "-o", "32", "--json")
    cpu = {json.dumps(d): [c for c in d["candidates"] if c["policy"] == "cpu" and c["phase"] == "decode"][0]["time_s"]
           for d in (plan, json.loads(r2.stdout))}
    moe_tpot, dense_tpot = cpu.values()
    assert moe_tpot < dense_tpot  # the MoE reads 4 of 64 experts per token, the dense model its whole MLP
