"""The serving engine and `flexplan serve` over compressed weights, as ``flexplan.load`` takes them
(one rule: flexplan.quant.sources.weights_source): a .gguf file's own blocks, and a model folder
quantised at load to int8 / int4, on the CPU.

What holds: each request's greedy tokens equal ``generate()``'s of the same model loaded alone
(``load_gguf_model(path)``: the same int8-activation blocks; ``load_quantized_folder``: the same
quantised linears), two requests sharing the batch; the blocks are not packed by cpu_linear (they stay
QuantLinear); a choice the path does not take, or blocks on another device, is refused naming what
works; `flexplan serve` parses --weights, puts blocks on the CPU, names a .gguf file by its file name,
and reports a bad combination in one line with exit code 2."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch
from gguf_files import EOS_ID, file_and_folder

from flexplan.errors import FlexplanError, InvalidInputError
from flexplan.quant import kernels
from flexplan.quant.at_load import load_quantized_folder
from flexplan.quant.gguf_model import load_gguf_model
from flexplan.quant.quant_linear import QuantLinear
from flexplan.quant.sources import DENSE, GGUF_BLOCKS, GGUF_FLOAT32, weights_source
from flexplan.serving.engine import Engine
from flexplan.serving.types import SamplingParams

NATIVE, WHY = kernels.status()
pytestmark = pytest.mark.skipif(NATIVE is None, reason=f"no native quantised kernels: {WHY}")
SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client", "jinja2")
needs_serve_extra = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in SERVE_EXTRA),
                                       reason="the [serve] extra is not installed")

PROMPTS = ([5, 6, 7, 8, 9, 10, 11], list(range(30, 52)))
NEW_TOKENS = 8
QUIET = dict(host_blocks=32, block_size_tokens=4, token_budget=32)


def _quiet(line):  # the loaders' one-line notes
    pass


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Llama as a Q8_0 .gguf file, and as a folder (safetensors, the file's tokenizer)."""
    torch.set_num_threads(1)
    return file_and_folder(tmp_path_factory.mktemp("serving-compressed"))


def _alone(model, prompt) -> list[int]:
    """generate()'s greedy tokens on the prompt alone, cut after EOS as the engine stops."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=EOS_ID)[0, len(prompt):].tolist()
    return out[:out.index(EOS_ID) + 1] if EOS_ID in out else out


def _served(engine: Engine) -> list[list[int]]:
    outs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    return [list(o.new_token_ids) for o in outs]


def test_a_gguf_file_is_served_on_its_own_blocks_with_generates_tokens(files):
    gguf_path, _ = files
    ref, _ = load_gguf_model(gguf_path, log=_quiet)  # float_act=False: int8 activations, as the engine runs
    with Engine.from_pretrained(gguf_path, **QUIET) as e:
        assert e.device.type == "cpu"
        linears = [m for m in e.model.modules() if isinstance(m, QuantLinear)]
        assert len(linears) == 2 * 7 + 1 and e.tokenizer is not None  # blocks kept, not packed by cpu_linear
        assert _served(e) == [_alone(ref, p) for p in PROMPTS]


def test_a_gguf_file_dequantised_is_served_as_float32_linears(files):
    gguf_path, _ = files
    ref, _ = load_gguf_model(gguf_path, dequantize_all=True, tokenizer=False)
    with Engine.from_pretrained(gguf_path, weights="float32", **QUIET) as e:
        assert not any(isinstance(m, QuantLinear) for m in e.model.modules())
        assert _served(e) == [_alone(ref, p) for p in PROMPTS]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_folder_quantised_at_load_is_served_with_generates_tokens(files, weights):
    _, folder = files
    ref = load_quantized_folder(folder, weights, log=_quiet)
    with Engine.from_pretrained(folder, weights=weights, **QUIET) as e:
        assert {m.format.name for m in e.model.modules() if isinstance(m, QuantLinear)} == \
            {"Q8_0" if weights == "int8" else "Q4_1"}
        assert _served(e) == [_alone(ref, p) for p in PROMPTS]


def test_a_gguf_file_under_a_plan_is_placed_by_flexplan_load_on_its_blocks(files):
    gguf_path, _ = files
    ref, _ = load_gguf_model(gguf_path, log=_quiet)
    with Engine.from_pretrained(gguf_path, plan="auto", **QUIET) as e:
        assert (e.flexmodel.plan.prefill.policy, e.flexmodel.plan.decode.policy) == ("cpu", "cpu")
        assert _served(e) == [_alone(ref, p) for p in PROMPTS]


def test_the_rule_is_flexplan_loads(files):
    gguf_path, folder = files
    assert weights_source(str(gguf_path), None).kind == GGUF_BLOCKS
    assert weights_source(str(gguf_path), "auto").kind == GGUF_BLOCKS
    assert weights_source(str(gguf_path), "float32").kind == GGUF_FLOAT32
    assert weights_source(str(folder), "float32").kind == DENSE
    assert weights_source(str(folder), "int4").planned_weights == "int4"
    assert not weights_source(str(gguf_path), "float32").blocks


def test_bad_combinations_are_refused_naming_what_works(files, tmp_path):
    gguf_path, folder = files
    with pytest.raises(InvalidInputError, match=r"weights='int4' quantises a model folder.*'gguf'.*'float32'"):
        Engine.from_pretrained(gguf_path, weights="int4")
    with pytest.raises(InvalidInputError, match=r"weights='gguf'.*take a .gguf file path.*'int4'"):
        Engine.from_pretrained(folder, weights="gguf")
    with pytest.raises(InvalidInputError, match=r"'float32', 'int4', 'int8'"):
        Engine.from_pretrained(folder, weights="int3")
    if not torch.cuda.is_available():  # refused before any load, whatever the weights
        for path, weights in ((gguf_path, None), (folder, "int8"), (folder, None)):
            with pytest.raises(FlexplanError, match=r"device='cuda:0' but this machine has no CUDA device.*device='cpu'"):
                Engine.from_pretrained(path, weights=weights, device="cuda:0")
    with pytest.raises(InvalidInputError, match=r"float32 activations on the CPU.*dtype=torch.float32"):
        Engine.from_pretrained(gguf_path, dtype=torch.bfloat16)
    with pytest.raises(InvalidInputError, match="no such GGUF file"):
        Engine.from_pretrained(tmp_path / "absent.gguf")


def _args(*argv) -> argparse.Namespace:
    from flexplan import serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flexplan_serve_parses_weights_and_puts_blocks_on_the_cpu(files, capsys):
    from flexplan import serve_cmd

    gguf_path, folder = files
    assert _args().weights == "auto" and _args().model is None  # no MODEL: the embedded folder, float32
    with pytest.raises(SystemExit):
        _args(str(folder), "--weights", "int3")
    assert "auto,float32,int8,int4" in capsys.readouterr().err
    a = _args(str(gguf_path))
    source, device = serve_cmd.weights_and_device(a.model, a.weights, a.device)
    assert (source.kind, device) == (GGUF_BLOCKS, "cpu")  # even where CUDA is: the blocks run on the CPU
    assert "own blocks" in serve_cmd.weights_label(source, a.dtype)
    a = _args(str(folder), "--weights", "int4", "--device", "cpu")
    source, device = serve_cmd.weights_and_device(a.model, a.weights, a.device)
    assert (source.kind, device) == ("int4", "cpu")
    a = _args(str(folder))
    assert serve_cmd.weights_and_device(a.model, a.weights, "cpu")[0].kind == DENSE
    assert serve_cmd.weights_label(weights_source(str(folder), None), "float32") == "float32"


def test_flexplan_serve_names_a_gguf_file_by_its_file_name(files):
    from flexplan import serve_cmd

    gguf_path, folder = files
    name, aliases = serve_cmd.model_names(str(gguf_path), None)
    assert name == "tiny-llama.Q8_0.gguf" and set(aliases) == {str(gguf_path), "tiny-llama.Q8_0"}
    assert serve_cmd.model_names(str(folder) + "/", None)[0] == "tiny-llama"  # folders as before
    assert serve_cmd.model_names(str(gguf_path), "mine")[0] == "mine"


@needs_serve_extra
@pytest.mark.parametrize("argv, words", [
    (["--weights", "int4"], "weights='int4' quantises a model folder"),
    pytest.param(["--device", "cuda"], "no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_flexplan_serve_reports_a_bad_combination_in_one_line(files, capsys, argv, words):
    from flexplan.cli import main

    gguf_path, _ = files
    assert main(["serve", str(gguf_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flexplan serve: error: ") and words in err and "\n" not in err
    assert "Traceback" not in err


@needs_serve_extra
def test_flexplan_serve_of_an_absent_gguf_file_is_one_line(tmp_path, capsys):
    from flexplan.cli import main

    assert main(["serve", str(tmp_path / "absent.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flexplan serve: error: ") and "no such GGUF file" in err and "\n" not in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_gguf_file_is_served_on_cuda_dequantising_its_blocks_there(files):
    gguf_path, _ = files
    ref, _ = load_gguf_model(gguf_path, log=_quiet)
    ref = ref.to("cuda")  # the same blocks on the GPU: generate() dequantises them there too
    with Engine.from_pretrained(gguf_path, device="cuda", **QUIET) as e:
        assert all(m.blocks.device.type == "cuda" for m in e.model.modules() if isinstance(m, QuantLinear))
        assert _served(e) == [_alone_on(ref, p) for p in PROMPTS]


def _alone_on(model, prompt) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=EOS_ID)[0, len(prompt):].tolist()
    return out[:out.index(EOS_ID) + 1] if EOS_ID in out else out
