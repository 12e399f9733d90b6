"""The shapes calibration fits factors into: a factor by one quantity (:class:`Table`), its bounds,
and the one-layer model spec that sizes a calibrated op. Shared by ``efficiency``, ``layer_fit``
and ``memory_state``, which import it and not each other's internals."""

from __future__ import annotations

import numpy as np

from flexplan.workload.model import ModelSpec

EFF_MIN = 1e-4  # a factor below this is a broken measurement, not a slow machine


# Factors are measured / nominal. The nominal peak of a machine whose SKU is hidden (a VM) is an
# assumption and can be below what the machine does; the factor then exceeds 1 so that the
# estimator reproduces the measurement. Bounded, to catch nonsense.
EFF_MAX = 4.0


def _num(x: float) -> float:
    return float(f"{float(x):.4g}")


def _stat_s(row: dict) -> float:
    """The median run when recorded: predictions are for typical runs, not the luckiest one."""
    return float(row.get("time_median_s") or row["time_s"])


class Table:
    """A factor as a function of one positive quantity, piecewise linear in log(x) (``log_y``:
    log(y) linear in log(x), a power law between points), held constant beyond the ends, clamped."""

    def __init__(self, x, y, lo: float | None = None, hi: float | None = None, log_y: bool = False):
        order = np.argsort(np.asarray(x, dtype=float))
        self.x = np.asarray(x, dtype=float)[order]
        self.y = np.clip(np.asarray(y, dtype=float)[order], EFF_MIN if lo is None else lo, EFF_MAX if hi is None else hi)
        if self.x.size == 0 or np.any(self.x <= 0) or not np.all(np.isfinite(self.y)):
            raise ValueError("a factor table needs positive x and finite y")
        if log_y and np.any(self.y <= 0):
            raise ValueError("a power-law table needs positive y")
        self._logx = np.log(self.x)
        self.log_y = log_y

    def __call__(self, v):
        lv = np.log(np.maximum(np.asarray(v, dtype=float), 1e-30))
        out = np.exp(np.interp(lv, self._logx, np.log(self.y))) if self.log_y else np.interp(lv, self._logx, self.y)
        return float(out) if np.ndim(out) == 0 else out

    def rows(self, key: str) -> list[dict[str, float]]:
        return [{key: _num(x), "eff": _num(y)} for x, y in zip(self.x, self.y)]


def capped_growth(x, y, power_law: bool) -> list[float]:
    """``y`` (a factor by x, x ascending) with each point at most the previous one times the
    growth that keeps x / y(x) non-decreasing between the points as the Table interpolates
    them: x[i]/x[i-1] for a power law, 1 + ln(x[i]/x[i-1]) for linear in log(x). The term
    work(x) / (rate x y(x)) with work proportional to x then never falls as x grows."""
    out = [float(v) for v in y]
    for i in range(1, len(out)):
        r = float(x[i]) / float(x[i - 1])
        out[i] = min(out[i], out[i - 1] * (r if power_law else 1.0 + float(np.log(r))))
    return out


def _attention_spec(heads: int, kv_heads: int, head_dim: int, hidden: int | None = None,
                    intermediate: int = 1) -> ModelSpec:
    """A one-layer Llama-layout ModelSpec with these attention heads (and, for real layers, this
    hidden and intermediate size): what workload/costs.py needs to size a calibrated op."""
    return ModelSpec.from_config(dict(model_type="llama", hidden_size=hidden or heads * head_dim,
                                      intermediate_size=intermediate, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=1,
                                      vocab_size=128))
