"""Bad arguments to flexplan.load and generate() are refused at the door: flexplan's own typed
error, one line that says what was wrong and what would work, before a weight moves or a kernel
sees the input. Also: where the CPU thread count of the executor comes from."""

from __future__ import annotations

import pytest
import torch
import transformers

import flexplan.api as api
from flexplan.errors import DoesNotFitError, InvalidInputError, UnknownHardwareError, UnsupportedModelError

from conftest import VOCAB, left_padded_batch

CPU_PLAN = {"prefill": "cpu", "decode": "cpu"}


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def ptrs(model) -> list[int]:
    return [p.data_ptr() for p in model.parameters()]


# ----------------------------------------------------------------------------- load()


@pytest.mark.parametrize("kwargs, words", [
    (dict(plan={"prefill": "warp-drive", "decode": "cpu"}), ["unknown prefill policy 'warp-drive'", "splitgen",
                                                             "gpu-offload"]),
    (dict(plan={"prefill": "cpu", "decode": "gpu-offlaod"}), ["unknown decode policy", "Did you mean: gpu-offload"]),
    (dict(plan={"prefill": "splitgen", "decode": "cpu", "gpu_layers": 2.5}), ["gpu_layers", "between 0 and 4", "2.5"]),
    (dict(plan={"prefill": "splitgen", "decode": "cpu", "gpu_layers": -1}), ["gpu_layers", "between 0 and 4"]),
    (dict(plan={"prefill": "splitgen", "decode": "cpu", "gpu_layers": 9}), ["gpu_layers", "between 0 and 4"]),
    (dict(plan={"prefill": "splitgen", "decode": "cpu", "gpu_layers": "3"}), ["gpu_layers", "whole number"]),
    (dict(plan={"prefill": "splitgen", "decode": "splitgen", "decode_gpu_layers": True}), ["decode_gpu_layers"]),
    (dict(plan={"prefil": "cpu"}), ["unknown plan override", "prefill"]),
    (dict(plan={"batch_size": 0}), ["batch_size must be a positive int"]),
    (dict(plan={"dtype": "int4"}), ["unknown dtype 'int4'", "bfloat16"]),
    (dict(plan="Auto"), ["plan must be 'auto'"]),
    (dict(plan=42), ["plan must be 'auto'", "int"]),
    (dict(accelerator="tpu"), ["accelerator must be", "'cpu'"]),
    (dict(accelerator="cuda:x"), ["accelerator must be"]),
    (dict(accelerator=3), ["accelerator must be"]),
    (dict(dtype="fp8"), ["unknown dtype 'fp8'", "float32"]),
    (dict(gpu_memory_bytes=-1, accelerator="cpu"), ["gpu_memory_bytes", "non-negative", "-1"]),
    (dict(gpu_memory_bytes=1.5), ["gpu_memory_bytes", "whole number of bytes"]),
    (dict(pinned_memory_budget_bytes=-5), ["pinned_memory_budget_bytes", "non-negative"]),
    (dict(cpu_threads=0), ["cpu_threads must be a positive int"]),
    (dict(hardware=3.5), ["hardware must be 'local'", "float"]),
])
def test_bad_load_argument(fresh, kwargs, words):
    model, _ = fresh("llama")
    before = ptrs(model)
    with pytest.raises(InvalidInputError) as e:
        api.load(model, **kwargs)
    msg = one_line(e)
    assert all(w in msg for w in words), msg
    assert ptrs(model) == before  # nothing was placed


def test_unknown_hardware_name(fresh):
    model, _ = fresh("llama")
    with pytest.raises(UnknownHardwareError, match="flexinfer-server2"):
        api.load(model, hardware="flexinfer-sever2")


def test_unknown_policy_is_named_before_the_missing_accelerator(fresh):
    model, _ = fresh("llama")
    with pytest.raises(InvalidInputError, match="unknown prefill policy") as e:
        api.load(model, plan={"prefill": "warp-drive", "decode": "cpu"}, accelerator=None)
    assert "accelerator" not in str(e.value)


def test_model_argument_that_is_not_a_causal_lm(tmp_path, one_thread):
    with pytest.raises(InvalidInputError, match="does not exist"):
        api.load(tmp_path / "no-such-model")
    with pytest.raises(InvalidInputError, match="not a model folder"):
        api.load(tmp_path)  # exists, but holds no config.json
    with pytest.raises(InvalidInputError, match="folder path or a loaded transformers"):
        api.load(42)
    base = transformers.LlamaModel(transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                            num_attention_heads=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="not a causal LM.*AutoModelForCausalLM"):
        api.load(base, accelerator="cpu")


# ----------------------------------------------------------------------------- generate()


@pytest.fixture
def lm(fresh):
    model, _ = fresh("llama")
    return api.load(model, plan=CPU_PLAN)


IDS, MASK = left_padded_batch((5, 3))


def _bad_generate_cases():
    ids = IDS.clone()
    ids[1, -1] = 15624
    neg = IDS.clone()
    neg[0, -1] = -3
    zero_row = MASK.clone()
    zero_row[1] = 0
    return [
        (dict(input_ids=ids, attention_mask=MASK), ["token id 15624", f"[0, {VOCAB})"]),
        (dict(input_ids=neg, attention_mask=MASK), ["token id -3", "vocabulary"]),
        (dict(input_ids=IDS.float()), ["integer token ids", "torch.float32", ".long()"]),
        (dict(input_ids=IDS[None]), ["2-D", "(1, 2, 5)"]),
        (dict(input_ids=IDS[0]), ["2-D", "unsqueeze(0)"]),
        (dict(input_ids=torch.zeros((1, 0), dtype=torch.long)), ["empty"]),
        (dict(input_ids=IDS.tolist()), ["torch tensor", "list", "return_tensors='pt'"]),
        (dict(input_ids=IDS, attention_mask=MASK[:, 1:]), ["attention_mask has shape (2, 4)", "(2, 5)"]),
        (dict(input_ids=IDS, attention_mask=MASK * 2), ["only 0", "1"]),
        (dict(input_ids=IDS, attention_mask=zero_row), ["row 1 is all zeros"]),
        (dict(inputs_embeds=torch.randn(2, 5, 32)), ["hidden size 32", "64", "get_input_embeddings"]),
        (dict(inputs_embeds=torch.randn(2, 5)), ["3-D"]),
        (dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=0), ["max_new_tokens must be an int >= 1", "0"]),
        (dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=-2), ["max_new_tokens must be an int >= 1"]),
        (dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=2.5), ["max_new_tokens", "2.5"]),
        (dict(input_ids=IDS, attention_mask=MASK, max_length=4), ["max_length 4", "5-token prompt", "max_new_tokens"]),
        (dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=2, num_beams=0), ["num_beams must be an int >= 1"]),
        (dict(attention_mask=MASK), ["needs input_ids", "inputs_embeds"]),
    ]


@pytest.mark.parametrize("kwargs, words", _bad_generate_cases())
def test_bad_generate_argument(lm, kwargs, words):
    if "max_length" not in kwargs:
        kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(InvalidInputError) as e:  # a FlexplanError: one except clause catches every refusal
        lm.generate(do_sample=False, **kwargs)
    msg = one_line(e)
    assert all(w in msg for w in words), msg


def test_positional_ids_are_checked_too(lm):
    with pytest.raises(InvalidInputError, match="inputs holds token id 999"):
        lm.generate(torch.tensor([[5, 999]]), max_new_tokens=2, do_sample=False)


def test_tokenizer_output_passed_whole(lm):
    with pytest.raises(InvalidInputError, match=r"pass it unpacked: generate\(\*\*inputs"):
        lm.generate({"input_ids": IDS, "attention_mask": MASK}, max_new_tokens=2)


def test_request_larger_than_the_machine_is_refused_before_allocation(lm):
    live = lm.executor.link.live_bytes()
    with pytest.raises(DoesNotFitError, match=r"batch 2 x 1000000000005 tokens needs .* GiB of KV cache"):
        lm.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=10**12, do_sample=False)
    assert lm.executor.link.live_bytes() == live


def test_good_inputs_still_run(lm, reference_models):
    ref = reference_models["llama"]
    for kwargs in (dict(input_ids=IDS, attention_mask=MASK), dict(input_ids=IDS, attention_mask=MASK.bool())):
        out = lm.generate(**kwargs, max_new_tokens=3, do_sample=False)
        assert torch.equal(out, ref.generate(**kwargs, max_new_tokens=3, do_sample=False))


# ----------------------------------------------------------------------------- CPU threads


def test_calibrated_thread_count_reaches_the_executor(fresh, monkeypatch):
    model, _ = fresh("llama")
    monkeypatch.setattr(api, "local_cpu_cores", lambda: 2)
    monkeypatch.setattr(api, "calibrated_cpu_threads", lambda: (1, "calibrated: fastest in the thread sweep of x.yaml"))
    lm = api.load(model, plan=CPU_PLAN)
    assert lm.executor.backend.threads == 1 and torch.get_num_threads() == 1
    lm.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=2, do_sample=False)
    assert lm.last_stats.cpu_threads == 1
    assert lm.last_stats.cpu_threads_source.startswith("calibrated")
    assert "1 threads (calibrated: fastest in the thread sweep" in lm.last_stats.summary()


def test_thread_count_given_by_the_caller_wins(fresh, monkeypatch):
    model, _ = fresh("llama")
    monkeypatch.setattr(api, "calibrated_cpu_threads", lambda: (2, "calibrated: x"))
    lm = api.load(model, plan=CPU_PLAN, cpu_threads=1)
    assert lm.executor.backend.threads == 1
    lm.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=2, do_sample=False)
    assert lm.last_stats.cpu_threads_source == "given by the caller"


def test_without_calibration_all_cores(fresh):
    model, _ = fresh("llama")  # one_thread: no calibration, one usable core
    lm = api.load(model, plan=CPU_PLAN)
    lm.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=2, do_sample=False)
    assert lm.last_stats.cpu_threads == 1
    assert lm.last_stats.cpu_threads_source.startswith("all usable cores")
