"""Park & Egger's split-point search (flexplan/estimator/split_search.py) against a plain loop and
against cases worked out by hand."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from flexplan.estimator.split_search import best_split, candidate_count, layer_times_s


def _loop(c, g, hw, hkv, x, m):
    n = len(c)
    out = np.full((n + 1, n + 1), np.inf)
    for i, j in itertools.product(range(n + 1), repeat=2):
        if j < i:
            continue
        cpu = sum(c[:i]) + sum(c[j:])
        acc = sum(g[i:j])
        h2d = sum(hw[i:j]) + m * sum(hkv[i:j]) + (m - 1) * acc
        crossings = x if 0 < j - i < n else 0.0
        out[i, j] = max(m * (cpu + crossings) + acc, h2d)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_vectorised_search_equals_a_plain_loop(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    c, g, hw, hkv = (rng.random(n) * s for s in (5.0, 0.5, 4.0, 2.0))
    x, m = float(rng.random()), int(rng.integers(1, 4))
    got = layer_times_s(c, g, hw, hkv, x, m)
    np.testing.assert_allclose(got, _loop(c, g, hw, hkv, x, m))
    i, j, t = best_split(got)
    assert t == pytest.approx(np.min(_loop(c, g, hw, hkv, x, m)))


def test_a_four_operator_layer_by_hand():
    # QKV, attention, output, MLP. CPU ms 2, 1, 1, 6; accelerator 0.1 each; copy ms 3, 0, 1, 6.
    c, g, h = [2.0, 1.0, 1.0, 6.0], [0.1] * 4, [3.0, 0.0, 1.0, 6.0]
    t = layer_times_s(c, g, h)
    assert t[0, 4] == pytest.approx(10.0)  # all streamed: the copy, 10 ms
    assert t[2, 2] == pytest.approx(10.0)  # all on the CPU: 10 ms
    # CPU: QKV + attention (3 ms) + accelerator 0.2, copy: output + MLP 7 ms -> 7
    assert t[2, 4] == pytest.approx(7.0)
    # CPU: the MLP (6) + accelerator 0.3, copy: QKV + attention + output 4 -> 6.3
    assert t[0, 3] == pytest.approx(6.3)
    # CPU: QKV + attention + output (4) + accelerator 0.1, copy: the MLP 6 -> 6.0, the best
    i, j, best = best_split(t)
    assert (i, j) == (3, 4) and best == pytest.approx(6.0)
    # one split point: the CPU's run must touch an end, and (3, 4) does
    assert best_split(t, max_split_points=1)[:2] == (3, 4)
    # two split points: CPU does QKV (2) and MLP (6) = 8 + 0.2, copy 1: worse
    assert t[1, 3] == pytest.approx(8.2)
    # a link 4x as slow: two split points win, the accelerator takes attention and output (4 ms
    # to copy), the CPU QKV and the MLP (8 ms) + 0.2: 8.2 against 10 on the CPU alone
    t4 = layer_times_s(c, g, np.array(h) * 4)
    assert best_split(t4)[:2] == (1, 3) and best_split(t4)[2] == pytest.approx(8.2)
    assert best_split(t4, max_split_points=1)[2] > 8.2


def test_decode_steps_share_one_split_and_a_growing_cache_moves_it():
    # attention's copy (its KV cache) grows with the steps; the split minimises the mean
    steps = 4
    kv = np.linspace(1.0, 8.0, steps)[:, None] * np.array([0, 1, 0, 0])
    c = np.array([2.0, 3.0, 1.0, 6.0])
    t = layer_times_s(c, np.zeros(4), np.array([3.0, 0, 1.0, 6.0]), kv)
    assert t.shape == (steps, 5, 5)
    i, j, mean_s = best_split(t)
    assert mean_s == pytest.approx(np.min(t.mean(axis=0)))
    assert not (i <= 1 < j)  # the attention (KV on the copy side) stays on the CPU


def test_counts_and_bad_input():
    assert [candidate_count(n) for n in (2, 4, 8)] == [1, 6, 28]
    with pytest.raises(ValueError, match="micro_batches"):
        layer_times_s([1.0], [1.0], [1.0], micro_batches=0)
