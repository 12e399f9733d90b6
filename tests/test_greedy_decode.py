"""FlexModel.generate's own greedy loop (flexplan/greedy_decode.py): taken for a plain greedy
request the native stack decodes, its tokens transformers' own; anything else runs transformers' loop."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GenerationConfig

from flexplan import api, greedy_decode
from flexplan.executor import native
from test_native_decode import _wide_model

needs_decode = pytest.mark.skipif(native.decode_status()[0] is None, reason=f"{native.decode_status()[1]}")
CPU_PLAN = {"prefill": "cpu", "decode": "cpu", "cpu_dtype": "float32"}


def _loaded(family: str):
    ref = _wide_model(family)
    return ref, api.load(copy.deepcopy(ref), plan=CPU_PLAN, accelerator="cpu", dtype="float32")


def _counting(monkeypatch) -> list:
    runs = []
    fn = greedy_decode.generate
    monkeypatch.setattr(greedy_decode, "generate", lambda *a, **k: (runs.append(1), fn(*a, **k))[1])
    return runs


@needs_decode
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_plain_greedy_requests_take_the_loop_and_keep_transformers_tokens(family, one_thread, monkeypatch):
    """max_new_tokens as an argument, in a generation config, or from max_length; an end-of-sequence
    token met on the way (the model's, or a config's list of them): the same sequences as
    transformers' generate(), each decoded by flexplan's loop with every step in the native stack."""
    ref, lm = _loaded(family)
    runs = _counting(monkeypatch)
    ids = torch.tensor([[5, 17, 33, 9, 61, 4, 88]])
    plain = ref.generate(ids, max_new_tokens=10, do_sample=False)
    stop_at = int(plain[0, ids.shape[1] + 3])  # a token the greedy output meets: as an EOS it stops there
    cases = [dict(max_new_tokens=10), dict(max_new_tokens=10, attention_mask=torch.ones_like(ids)),
             dict(generation_config=GenerationConfig(max_new_tokens=7, do_sample=False)),
             dict(generation_config=GenerationConfig(max_length=ids.shape[1] + 5)),
             dict(max_new_tokens=10, eos_token_id=stop_at), dict(max_new_tokens=10, eos_token_id=[150, stop_at]),
             dict(max_new_tokens=1)]
    for kw in cases:
        ours, theirs = lm.generate(ids, **kw), ref.generate(ids, **kw)
        assert torch.equal(ours, theirs), kw
        new = ours.shape[1] - ids.shape[1]
        assert lm.last_stats.native_stack_steps == new - 1, kw
    assert len(runs) == len(cases)
    assert lm.generate(ids, max_new_tokens=10, eos_token_id=stop_at).shape[1] < plain.shape[1]


@needs_decode
def test_anything_but_a_plain_greedy_request_runs_transformers_loop(one_thread, monkeypatch):
    """Sampling, a penalty, a logits processor, scores returned, a batch, a padded prompt, a stop
    string's tokenizer argument: transformers' loop (the loop not entered), its results as ever."""
    from transformers import LogitsProcessorList, MinLengthLogitsProcessor

    ref, lm = _loaded("llama")
    runs = _counting(monkeypatch)
    ids = torch.tensor([[5, 17, 33, 9]])
    for kw in (dict(do_sample=True, top_k=5), dict(repetition_penalty=1.3), dict(min_new_tokens=4),
               dict(logits_processor=LogitsProcessorList([MinLengthLogitsProcessor(8, eos_token_id=2)])),
               dict(output_scores=True, return_dict_in_generate=True), dict(num_beams=2), dict(no_repeat_ngram_size=2)):
        torch.manual_seed(0)
        ours = lm.generate(ids, max_new_tokens=6, **kw)
        torch.manual_seed(0)
        theirs = ref.generate(ids, max_new_tokens=6, **kw)
        if isinstance(ours, torch.Tensor):
            assert torch.equal(ours, theirs), kw
        else:
            assert torch.equal(ours.sequences, theirs.sequences), kw
    batch = torch.tensor([[5, 17, 33, 9], [0, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    assert torch.equal(lm.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False),
                       ref.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False))
    assert runs == []


@needs_decode
def test_a_model_whose_decode_is_not_native_runs_transformers_loop(one_thread, monkeypatch):
    ref = _wide_model("llama")
    lm = api.load(copy.deepcopy(ref), plan={"prefill": "cpu", "decode": "gpu-offload", "cpu_dtype": "float32"},
                  accelerator="cpu", dtype="float32")
    runs = _counting(monkeypatch)
    ids = torch.tensor([[5, 17, 33, 9]])
    assert torch.equal(lm.generate(ids, max_new_tokens=5), ref.generate(ids, max_new_tokens=5))
    assert not lm.executor.decodes_natively and runs == []


class _Recording:
    """transformers' streamer protocol, recorded: each put() value, and end()."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        assert not self.ended, "a put() after end()"
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


@needs_decode
def test_a_streamed_plain_greedy_request_takes_the_loop_and_streams_as_transformers(one_thread, monkeypatch):
    """A streamer (``flexplan run``'s TextStreamer) keeps the request on flexplan's loop, and sees what
    transformers' loop shows it: the prompt, each new token as a [1] tensor (an end-of-sequence one
    included), then one end()."""
    ref, lm = _loaded("llama")
    runs = _counting(monkeypatch)
    ids = torch.tensor([[5, 17, 33, 9, 61]])
    stop_at = int(ref.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] + 2])
    for kw in (dict(max_new_tokens=8), dict(max_new_tokens=8, eos_token_id=stop_at), dict(max_new_tokens=1)):
        ours, theirs = _Recording(), _Recording()
        out = lm.generate(ids, streamer=ours, **kw)
        assert torch.equal(out, ref.generate(ids, streamer=theirs, **kw)), kw
        assert lm.last_stats.native_stack_steps == out.shape[1] - ids.shape[1] - 1, kw
        assert ours.ended == theirs.ended == 1, kw
        assert [p.shape for p in ours.puts] == [p.shape for p in theirs.puts], kw
        assert all(torch.equal(a, b) for a, b in zip(ours.puts, theirs.puts)), kw
        assert len(ours.puts) == out.shape[1] - ids.shape[1] + 1, kw
    assert len(runs) == 3
