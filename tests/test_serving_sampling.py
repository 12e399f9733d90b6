"""Per-request sampling on logits worked by hand, the end-of-sequence sources, and incremental
detokenization with stop strings."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexplan.errors import InvalidInputError
from flexplan.serving.sampling import (
    Detokenizer,
    eos_token_ids,
    filtered_logits,
    request_generator,
    sample,
)
from flexplan.serving.types import SamplingParams

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (logits their logs)
PROBS = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
LOGITS = PROBS.log()


def support(params: SamplingParams) -> set[int]:
    return set(torch.nonzero(torch.isfinite(filtered_logits(LOGITS, params))).flatten().tolist())


def test_top_k_and_top_p_keep_what_the_hand_says():
    assert support(SamplingParams(top_k=2)) == {0, 1}
    assert support(SamplingParams()) == {0, 1, 2, 3, 4}
    # top_p 0.7: 0.5 alone is short of it, 0.5 + 0.25 reaches it -> {0, 1}
    assert support(SamplingParams(top_p=0.7)) == {0, 1}
    assert support(SamplingParams(top_p=0.75)) == {0, 1}
    assert support(SamplingParams(top_p=0.8)) == {0, 1, 2}
    assert support(SamplingParams(top_p=0.1)) == {0}  # the most likely token always stays
    # temperature 0.5 squares the odds: 0.5^2 : 0.25^2 = 4 : 1
    p = filtered_logits(LOGITS, SamplingParams(temperature=0.5)).softmax(-1)
    assert math.isclose(p[0] / p[1], 4.0, rel_tol=1e-5)


def test_greedy_rows_take_the_argmax_and_sampled_rows_their_generator():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    greedy = [SamplingParams(temperature=0), SamplingParams(top_k=1)]
    assert sample(logits, greedy, [request_generator(p) for p in greedy]) == [0, 4]
    assert request_generator(greedy[0]) is None
    seeded = SamplingParams(seed=5)
    draws = [sample(LOGITS[None], [seeded], [request_generator(seeded)])[0] for _ in range(3)]
    runs = [[sample(LOGITS[None], [seeded], [g])[0] for _ in range(20)] for g in
            (request_generator(seeded), request_generator(seeded))]
    assert draws[0] == draws[1] == draws[2] and runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # it samples


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31), st.floats(0.05, 1.0), st.integers(0, 5))
def test_a_sample_is_always_in_the_filtered_support(seed, top_p, top_k):
    p = SamplingParams(seed=seed, top_p=top_p, top_k=top_k, temperature=1.0)
    assert sample(LOGITS[None], [p], [request_generator(p)])[0] in support(p)


def test_sampling_params_refuse_what_they_cannot_do():
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -1}, {"stop": ("",)},
                {"seed": 1.5}):
        with pytest.raises(InvalidInputError):
            SamplingParams(**bad)


def test_eos_from_generation_config_then_config_then_tokenizer():
    gen = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2, 7]), config=SimpleNamespace(eos_token_id=3))
    assert eos_token_ids(gen) == {2, 7}
    cfg = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None), config=SimpleNamespace(eos_token_id=3))
    assert eos_token_ids(cfg) == {3}
    bare = SimpleNamespace(config=SimpleNamespace())
    assert eos_token_ids(bare, SimpleNamespace(eos_token_id=9)) == {9}
    assert eos_token_ids(bare) == frozenset()


PIECES = {0: "", 1: " Hello", 2: ",", 3: " wor", 4: "ld", 5: "!", 6: " END", 7: "E", 8: "N"}


class Pieces:
    """Token i decodes to PIECES[i]; token 9 is half a character until token 10 completes it."""

    def decode(self, ids, skip_special_tokens=True):
        text, i = "", 0
        while i < len(ids):
            if ids[i] == 9:
                text += "\u00e9" if i + 1 < len(ids) and ids[i + 1] == 10 else "\ufffd"
                i += 2 if i + 1 < len(ids) and ids[i + 1] == 10 else 1
            else:
                text += PIECES[ids[i]]
                i += 1
        return text


def run(tokens, stop=()):
    d = Detokenizer(Pieces(), [0, 0], stop)
    pieces = []
    for t in tokens:
        d.push(t)
        pieces.append(d.new_text())
        if d.stopped:
            break
    return d, pieces


def test_text_comes_out_token_by_token_and_waits_for_whole_characters():
    d, pieces = run([1, 2, 9, 10, 3, 4])
    assert pieces == [" Hello", ",", "", "\u00e9", " wor", "ld"]
    assert d.text == " Hello,\u00e9 world" and not d.stopped


def test_stop_strings_cut_the_text_and_hold_back_a_possible_start():
    d, pieces = run([1, 3, 4, 5, 6], stop=("ld!",))
    assert d.stopped and d.text == " Hello wor"
    assert "".join(pieces) + d.new_text(final=True) == " Hello wor"
    # " E" could begin " END": held back until the text shows it is not a stop string
    d, pieces = run([1, 7, 8, 5], stop=(" END", "EN!"))
    assert pieces[:3] == [" Hello", "", ""] and d.stopped and d.text == " Hello"
    d, pieces = run([1, 7, 2], stop=("EX",))
    assert pieces == [" Hello", "", "E,"]
    # a stop string inside one token's text
    d, _ = run([1, 6, 5], stop=("EN",))
    assert d.text == " Hello " and d.stopped
