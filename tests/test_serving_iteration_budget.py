"""The engine's token budget sized to an iteration time target (serving/iteration_budget.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from flexplan.errors import InvalidInputError
from flexplan.serving.engine import Engine
from flexplan.serving.iteration_budget import IterationBudget
from flexplan.serving.types import SamplingParams


def test_budget_on_numbers_worked_by_hand():
    b = IterationBudget(0.2, cap_tokens=512, floor_tokens=16)
    assert b.tokens() == 16 and b.tokens(decodes=5) == 21  # nothing measured: the floor beside the decodes
    b.observe(16, 0.05)
    assert b.fit() == (0.0, 0.05 / 16) and b.tokens() == 64  # one size: every second on the tokens
    # t = 0.02 + 0.002 n exactly: 16 -> 0.052, 66 -> 0.152
    b = IterationBudget(0.2, cap_tokens=512, floor_tokens=16)
    b.observe(16, 0.052)
    b.observe(66, 0.152)
    t0, c = b.fit()
    assert t0 == pytest.approx(0.02) and c == pytest.approx(0.002)
    assert b.tokens() == 90  # (0.2 - 0.02) / 0.002
    assert b.tokens(decodes=80) == 96  # the decodes all run, with the floor's prefill tokens
    assert IterationBudget(10.0, cap_tokens=64).tokens() == 16
    assert IterationBudget(10.0, cap_tokens=8).tokens(decodes=20) == 8  # the cap over everything
    big = IterationBudget(10.0, cap_tokens=64)
    big.observe(16, 0.052)
    big.observe(66, 0.152)
    assert big.tokens() == 64  # never above the cap


def test_budget_keeps_a_positive_slope_and_a_bounded_window():
    b = IterationBudget(0.1, cap_tokens=512, floor_tokens=8, window=4)
    b.observe(10, 0.05)
    b.observe(20, 0.04)  # longer but faster (noise): the seconds are charged to the tokens
    t0, c = b.fit()
    assert t0 == 0.0 and c == pytest.approx(0.09 / 30)
    assert b.tokens() == 33  # 0.1 / 0.003
    for _ in range(4):  # the window forgets the first two
        b.observe(40, 0.1)
    assert b.fit() == (0.0, 0.1 / 40)
    b.observe(0, 1.0)  # an iteration without tokens (a step that only collected) teaches nothing
    b.observe(5, 0.0)
    assert b.fit() == (0.0, 0.1 / 40)


@pytest.mark.parametrize("target", [0, -1.0, float("nan"), float("inf"), "0.2"])
def test_a_bad_target_says_what_would_work(target):
    with pytest.raises(InvalidInputError, match="iteration_target_s must be a positive number of seconds"):
        IterationBudget(target, cap_tokens=64)
    with pytest.raises(InvalidInputError, match="iteration_target_s"):
        Engine(make_model("llama"), host_blocks=16, iteration_target_s=target)


def test_the_engine_chunks_prefills_to_the_target_and_keeps_the_tokens():
    torch.set_num_threads(1)
    model = make_model("llama")
    prompts = [list(range(10, 70)), list(range(100, 140)), [7, 8, 9]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with Engine(model, host_blocks=64) as plain:
        want = [list(o.new_token_ids) for o in plain.generate(prompts, params)]

    class Budget(IterationBudget):  # a machine on which every token costs 1 s and an iteration 0.5 s more
        def __init__(self):
            super().__init__(20.5, cap_tokens=512, floor_tokens=4)
            self.given = []

        def observe(self, tokens, seconds):
            super().observe(tokens, 0.5 + tokens)

        def tokens(self, decodes=0):
            self.given.append(super().tokens(decodes))
            return self.given[-1]

    with Engine(model, host_blocks=64, iteration_target_s=20.5) as e:
        e.budget = Budget()
        scheduled = []
        for i, p in enumerate(prompts):
            e.add_request(str(i), p, params)
        got = {}
        while e.has_unfinished():
            for o in e.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
            scheduled.append(e._scheduled_tokens)
            assert e.stats().token_budget == e.budget.given[-1]
        assert [got[str(i)] for i in range(3)] == want  # chunked or not, the same greedy tokens
        # the floor first (4 tokens: 4.5 s), then 20.5 / 1.125 s a token, then the line through both sizes
        assert scheduled[:3] == [4, 18, 20] and max(scheduled) == 20
        assert e.budget.fit() == pytest.approx((0.5, 1.0))


def test_the_engine_without_a_target_keeps_its_budget():
    with Engine(make_model("llama"), host_blocks=16, token_budget=7) as e:
        assert e.budget is None and e.iteration_tokens() == 7 and e.stats().token_budget == 7
