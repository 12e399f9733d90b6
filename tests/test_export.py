"""`explain --export`: a plan as llama.cpp's flags, vLLM's and accelerate's device_map, and what
each cannot express (plans forced to known placements on hwdb hardware: no measurement)."""

import re
import subprocess
import sys

import pytest

import flexplan
from flexplan.errors import InvalidInputError
from flexplan.export import export_plan, module_names
from flexplan.hardware.spec import DTYPE_BYTES
from flexplan.workload import resolve_model

HW = "flexinfer-server2"


def _plan(model, **kw):
    return flexplan.plan(model, HW, batch_size=2, input_len=256, output_len=32, include_initial_load=False, **kw)


def test_llama_cpp_gets_the_last_resident_layers_as_ngl_and_cpu_experts_as_n_cpu_moe():
    spec = resolve_model("meta-llama/Llama-3.1-8B")
    p = _plan("meta-llama/Llama-3.1-8B", prefill="splitgen", decode="splitgen", gpu_layers=20)
    out = export_plan(p, spec, "llama.cpp").render()
    assert re.search(r"-ngl 20\b", out) and "-np 2 -c 576" in out  # splitgen: the last 20 layers on the GPU
    everything = export_plan(_plan("meta-llama/Llama-3.1-8B", prefill="gpu", decode="gpu"), spec, "llama.cpp")
    assert re.search(r"-ngl 33\b", everything.settings) and not everything.cannot  # all 32 layers and the output
    moe = resolve_model("Qwen/Qwen3-30B-A3B")
    q = _plan("Qwen/Qwen3-30B-A3B", prefill="cpu-experts", decode="cpu-experts", gpu_layers=8)
    out = export_plan(q, moe, "llama.cpp").settings
    assert f"--n-cpu-moe {moe.num_layers - 8}" in out and f"-ngl {moe.num_layers + 1}" in out


def test_llama_cpp_says_it_cannot_stream_decode_layers_or_split_them():
    spec = resolve_model("meta-llama/Llama-3.1-8B")
    p = _plan("meta-llama/Llama-3.1-8B", prefill="gpu-offload-partial", decode="gpu-offload-partial", gpu_layers=10)
    e = export_plan(p, spec, "llama.cpp")
    resident = [i for i, m in enumerate(p.placement.phases["decode"].modes) if not m.streamed]
    assert len(resident) == 10
    # the streamed layers stay in host memory, where llama.cpp computes them; the resident ones on the GPU
    assert "=CPU" in e.settings or f"-ngl {len(resident)}" in e.settings
    assert any("streamed to the GPU each step" in c for c in e.cannot)
    s = _plan("meta-llama/Llama-3.1-8B", prefill="split-points", decode="split-points", gpu_layers=4)
    assert any("split points" in c for c in export_plan(s, spec, "llama.cpp").cannot)


def test_vllm_offloads_the_streamed_layers_bytes_and_says_what_runs_on_the_cpu():
    spec = resolve_model("meta-llama/Llama-3.1-8B")
    p = _plan("meta-llama/Llama-3.1-8B", prefill="gpu-offload", decode="gpu-offload", gpu_layers=12)
    streamed = [i for i, m in enumerate(p.placement.phases["decode"].modes) if m.streamed]
    gb = float(re.search(r"--cpu-offload-gb ([0-9.]+)", export_plan(p, spec, "vllm").settings).group(1))
    want = sum(spec.layer_params(i) for i in streamed) * DTYPE_BYTES[p.dtype] / 2**30
    assert want <= gb <= want + 0.1
    c = _plan("meta-llama/Llama-3.1-8B", prefill="splitgen", decode="splitgen", gpu_layers=12)
    e = export_plan(c, spec, "vllm")
    assert any("computed on the CPU" in x for x in e.cannot) and "--max-num-seqs 2" in e.settings


def test_accelerate_device_map_uses_the_models_own_module_names():
    parts, layers, how = module_names("facebook/opt-6.7b", resolve_model("facebook/opt-6.7b").num_layers)
    assert layers[0] == "model.decoder.layers.0" and "read from transformers" in how  # OPT's own, not a table
    spec = resolve_model("meta-llama/Llama-3.1-8B")
    p = _plan("meta-llama/Llama-3.1-8B", prefill="splitgen", decode="splitgen", gpu_layers=30)
    code = export_plan(p, spec, "accelerate").settings
    assert '"model.layers.0": "cpu"' in code and '"model.layers.31": 0' in code
    ns = {}
    exec(code.split("\nmodel = ")[0], ns)  # the device_map and max_memory are valid Python
    assert sum(v == 0 for v in ns["device_map"].values()) >= 30


def test_an_unknown_format_or_several_shapes_get_a_clear_error():
    spec = resolve_model("meta-llama/Llama-3.1-8B")
    with pytest.raises(InvalidInputError, match="llama.cpp, vllm, accelerate"):
        export_plan(_plan("meta-llama/Llama-3.1-8B"), spec, "tgi")
    r = subprocess.run([sys.executable, "-m", "flexplan", "explain", "meta-llama/Llama-3.1-8B", "--hw", HW,
                        "-b", "1,2", "--export", "vllm"], capture_output=True, text=True)
    assert r.returncode == 2 and "--export translates one plan" in r.stderr and "Traceback" not in r.stderr


def test_accelerate_reads_a_gguf_file_with_gguf_file():
    """transformers loads a GGUF file from its folder and gguf_file=, not from the file's path."""
    from flexplan.smollm import gguf_path

    path = str(gguf_path())
    spec = resolve_model(path)
    p = flexplan.plan(path, HW, weights="float32", prefill="gpu", decode="gpu")
    code = export_plan(p, spec, "accelerate", model_ref=path).settings
    assert f'from_pretrained("{gguf_path().parent}", gguf_file="{gguf_path().name}"' in code
