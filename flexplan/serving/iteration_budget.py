"""How many new tokens an iteration may schedule so that it ends within a time target.

Every running request waits for the whole iteration: its time between tokens (TPOT) is the
iteration's time. A fixed token budget sets that time only per machine (512 tokens are ~0.1 s on
a GPU and over a second on two CPU cores), so the engine can instead be given the time, and size
each iteration's prefill chunks to fit it (Sarathi-Serve's token budget from a TPOT SLO).

The time of an iteration is close to affine in its new tokens, t = t0 + c n: t0 the weights' read
and the fixed per-iteration work, c the rows' arithmetic. Both are fitted to the iterations the
engine measured last (least squares over a sliding window), so the budget follows this machine,
this model and its memory state without a calibration. Before any iteration was measured the
budget is the floor (a small iteration measured first); while all measured iterations had one
size, every second is charged to the tokens (t0 = 0: the fewest tokens the line allows), which
also gives the next iteration another size to fit with.
"""

from __future__ import annotations

import math
from collections import deque

from flexplan.errors import InvalidInputError

FLOOR_TOKENS = 16  # prefill tokens an iteration may always add to its decodes: prefills keep moving
WINDOW = 32  # iterations the fit reads: a few seconds of serving, so it follows the machine's state


class IterationBudget:
    """Token budget per iteration for ``target_s`` seconds an iteration, at most ``cap_tokens``."""

    def __init__(self, target_s: float, cap_tokens: int, floor_tokens: int = FLOOR_TOKENS, window: int = WINDOW):
        if not (isinstance(target_s, (int, float)) and math.isfinite(target_s) and target_s > 0):
            raise InvalidInputError(f"iteration_target_s must be a positive number of seconds, got {target_s!r} "
                                    "(e.g. 0.2 for 200 ms between tokens)")
        self.target_s = float(target_s)
        self.cap_tokens = int(cap_tokens)
        self.floor_tokens = min(int(floor_tokens), self.cap_tokens)
        self._seen: deque[tuple[int, float]] = deque(maxlen=window)
        self._line: tuple[float, float] | None = None  # fit() of the window as it is (state() and stats() both ask)

    def observe(self, tokens: int, seconds: float) -> None:
        """One iteration measured: ``tokens`` new tokens in ``seconds``."""
        if tokens > 0 and seconds > 0:
            self._seen.append((int(tokens), float(seconds)))
            self._line = None

    def fit(self) -> tuple[float, float] | None:
        """(t0 seconds, c seconds per token) of the window's least-squares line, or None before any
        iteration was measured. The slope is kept positive and t0 non-negative."""
        k = len(self._seen)
        if not k:
            return None
        if self._line is None:
            self._line = self._fitted(k)
        return self._line

    def _fitted(self, k: int) -> tuple[float, float]:
        mean_n = sum(n for n, _ in self._seen) / k
        mean_t = sum(t for _, t in self._seen) / k
        var = sum((n - mean_n) ** 2 for n, _ in self._seen)
        cov = sum((n - mean_n) * (t - mean_t) for n, t in self._seen)
        if var == 0 or cov <= 0:  # one size, or sizes noise cannot tell apart: all seconds on the tokens
            return 0.0, mean_t / mean_n
        c = cov / var
        return max(mean_t - c * mean_n, 0.0), c

    def tokens(self, decodes: int = 0) -> int:
        """This iteration's budget: the most tokens the fitted line keeps within the target, but at
        least the ``decodes`` running requests' tokens and the floor's prefill tokens (every request
        progresses, even where the target is too short for them), at most the cap."""
        least = decodes + self.floor_tokens
        line = self.fit()
        fitted = least if line is None else int((self.target_s - line[0]) / line[1])
        return min(self.cap_tokens, max(least, fitted))
