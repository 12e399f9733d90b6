"""What real decoder layers add to the micro-benchmark factors: the per-layer overhead of a decode
step, and the compute factor of a prefill layer.

The GEMM, GEMV and attention micro-benchmarks (``efficiency.py``) measure one op on one weight
shape. A real layer runs seven GEMMs of other shapes plus norms, rotary embedding, activations
and attention, so ``flexplan calibrate`` also times whole transformers decoder layers of a few
widths, in decode (one query per sequence, a short KV cache) and in prefill (``cpu_layers``).
Their times are fitted here so that the estimator's per-layer term

    t = C / (TH x Eff_comp(tokens)) + D / (BW x Eff_mem(tokens)) + KV / (BW x Eff_attn(ctx)) + overhead(tokens, layer bytes)

reproduces each calibrated layer:

- **Decode rows** (a few tokens, memory-bound): what the factors leave unexplained is overhead,
  seconds per layer (dispatch, norms, rotary, the cache update), by tokens and layer size
  (:class:`LayerOverhead`), fitted non-decreasing in tokens. Above the most decode tokens it is held.
- **Decode rows over a longer KV cache** (the same shapes, ``layer_long_kv_len``): what the extra
  keys cost a real layer, the attention factor of decode (:func:`layer_attention_table`): a real
  layer's extra keys cost more than the SDPA micro-benchmark's factor says, so its own rows set it.
- **Prefill rows** (hundreds of tokens, compute-bound): the layer's own compute factor,
  ``C / (TH x (t - D / (BW x Eff_mem) - overhead))`` with the decode overhead held, at the widest
  measured layer's level at each token count (:func:`layer_compute_table`; not the median over
  the widths: a model as wide as the widest layer would then be priced slow, its time beyond the
  median factor only ever added as overhead, never taken off). It replaces the
  GEMM micro-benchmark's factor over the tokens the layers span: a real layer can be faster than
  the isolated GEMM of another weight shape, which an overhead that can only add time could not
  express, or slower (attention and elementwise work per token).
  Eff_comp keeps its one constraint: it grows no faster than the tokens do, so the compute term
  never falls as tokens grow. What each narrower width's prefill takes beyond that factor (a small
  layer's norms, rotary and activations weigh more per token) joins the overhead at those tokens,
  so each calibrated prefill layer is reproduced, a small model's short prompt included.

- **Prefill rows of the same b x s at two prompt lengths** (8 x 128 beside 1 x 1024): the same
  GEMMs, weight reads and per-layer costs, eight times the causal (query, key) pairs apart, so
  their difference is the attention core's own factor (:func:`prefill_attention_factor`). Those
  pairs run far below the GEMMs' rate, so with one factor by tokens a batch of short prompts
  would be priced as one long prompt of the same tokens, too slow. The estimator prices
  ``c_prefill_attention`` at it and the rest of C_Prefill at the compute factor, which is fitted
  on what is left once the attention is taken out. Files without such a pair price the whole of
  C_Prefill at the compute factor, as before.

Files written before decode and prefill rows were told apart read the same way: they hold both.
"""

from __future__ import annotations

import numpy as np

from flexplan.estimator.terms import Shape, phase_work, t_compute_s, t_memory_s, t_on_device_s
from flexplan.factors.tables import EFF_MAX, Table, _attention_spec, _stat_s, capped_growth
from flexplan.hardware.spec import DTYPE_BYTES

MIN_CONTEXT_SHARE = 0.25  # long-cache decode rows used where the extra keys cost >= this share of the short row
# a prefill pair's time difference below this share of the layer is noise, not attention
MIN_ATTENTION_SHARE = 0.1
MAX_ATTENTION_RESCALE = 4.0  # the real layers rescale the SDPA attention factor by at most this much either way


def _num(x: float) -> float:
    return float(f"{float(x):.4g}")


def non_decreasing_fit(y: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``y`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in y:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


class LayerOverhead:
    """Seconds a real decoder layer takes beyond what the factors explain, by tokens per GEMM and
    layer size: piecewise linear in log(layer bytes) within a token count, then in log(tokens)
    between the two nearest token counts; held constant below the fewest and above the most
    tokens. Never falls as tokens grow."""

    def __init__(self, by_tokens: dict[int, "Table"]):
        self.tokens = np.array(sorted(by_tokens), dtype=float)
        self.tables = [by_tokens[int(t)] for t in self.tokens]

    def __call__(self, tokens: float, layer_bytes: float | None) -> float:
        def at(i: int) -> float:
            t = self.tables[i]
            return float(t(layer_bytes)) if layer_bytes else float(np.median(t.y))

        # each token count's value raised to the largest at fewer tokens: the tables are fitted one
        # token count at a time, and interpolated to another layer size they can dip as tokens grow,
        # which would price a larger batch's prefill cheaper than a smaller one's
        # (tests/test_calibration_properties.py)
        values = np.maximum.accumulate([at(i) for i in range(len(self.tables))])
        lt = np.log(max(float(tokens), 1e-9))
        logs = np.log(self.tokens)
        if lt <= logs[0]:
            return float(values[0])
        if lt >= logs[-1]:
            return float(values[-1])
        j = int(np.searchsorted(logs, lt))
        w = (lt - logs[j - 1]) / (logs[j] - logs[j - 1])
        return float((1 - w) * values[j - 1] + w * values[j])

    def rows(self) -> list[dict[str, float]]:
        return [{"tokens": _num(t), "layer_bytes": _num(x), "overhead_s": _num(y)}
                for t, tab in zip(self.tokens, self.tables) for x, y in zip(tab.x, tab.y)]


def no_faster_with_more_work(rows: list[dict]) -> list[float]:
    """Each layer row's time (its median run), lowered to the fastest row of the same phase and
    width that does at least as much work in BOTH respects, tokens and KV length (noise only adds
    time). Work is a partial order here: batch 8 over 129 keys is not more work than batch 4 over
    1025, so neither may lower the other."""

    kind = lambda r: (int(r["query_len"]) == 1,  # noqa: E731
                      *(int(r[k]) for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim")))
    work = [(kind(r), int(r["batch"]) * int(r["query_len"]), int(r["kv_len"])) for r in rows]
    times = [_stat_s(r) for r in rows]
    return [min(t for (k2, n2, l2), t in zip(work, times) if k2 == k and n2 >= n and l2 >= kv)
            for (k, n, kv) in work]


def _row_work(r: dict, dtype_bytes: float):
    """(phase work of one calibrated layer row, its attention factor's kv_len or None, tokens)."""

    batch, q_len = int(r["batch"]), int(r["query_len"])
    m = _attention_spec(int(r["heads"]), int(r["kv_heads"]), int(r["head_dim"]), int(r["hidden"]),
                        int(r["intermediate"]))
    dtype = r["dtype"] if r.get("dtype") in DTYPE_BYTES else next(k for k, v in DTYPE_BYTES.items()
                                                                  if v == int(dtype_bytes))
    if q_len == 1:  # one decode step over kv_len keys (kv_len - 1 cached before it)
        return phase_work(Shape(m, batch, int(r["kv_len"]) - 1, 2, dtype, dtype), "decode"), int(r["kv_len"]), batch
    return phase_work(Shape(m, batch, q_len, 1, dtype, dtype), "prefill"), None, batch * q_len


def derive_layers(rows: list[dict], peak_flops_per_s: float, bandwidth_bytes_per_s: float, eff_c, eff_m,
                  eff_a, dtype_bytes: float) -> tuple[LayerOverhead, "Table | None", "Table | None", float | None]:
    """(per-layer overhead from the decode rows, the prefill layers' compute factor or None, the
    decode layers' attention factor or None, the prefill attention core's factor or None) from
    real decoder layers (see the module docstring); ``eff_c`` / ``eff_m`` / ``eff_a`` are the
    micro-benchmarks' tables."""
    times = no_faster_with_more_work(rows)
    decode: dict[tuple[int, float], list] = {}  # (tokens, layer bytes) -> [(kv_len, work, time)] by kv_len
    prefill = []
    for r, time_s in zip(rows, times):
        w, kv_len, tokens = _row_work(r, dtype_bytes)
        if kv_len is None:
            prefill.append((tokens, w, time_s))
        else:
            decode.setdefault((tokens, w.weight_bytes_cpu), []).append((kv_len, w, time_s))
    if not decode and not prefill:
        raise ValueError("no usable layer measurements")
    eff_a = layer_attention_table(decode, peak_flops_per_s, bandwidth_bytes_per_s, eff_c, eff_a) or eff_a
    residuals: dict[int, dict[float, float]] = {}
    for (tokens, layer_bytes), runs in decode.items():
        kv_len, w, time_s = min(runs, key=lambda x: x[0])  # the shortest cache: the fixed part, not the context's
        eff_kv = float(eff_a(kv_len)) if eff_a is not None else None
        modelled = t_on_device_s(float(w.flops[0]), w.d_cpu + w.kv_write_cpu, peak_flops_per_s, bandwidth_bytes_per_s,
                                 float(eff_c(tokens)), float(eff_m(tokens)),
                                 kv_bytes=float(w.kv_read_cpu[0]) if eff_kv else 0.0, eff_kv=eff_kv or 1.0)
        residuals.setdefault(tokens, {})[layer_bytes] = max(time_s - modelled, 0.0)
    if not residuals:  # prefill rows only: no fixed part measured apart
        residuals = {1: {w.weight_bytes_cpu: 0.0 for _, w, _ in prefill}}
    residuals = _pooled(residuals)
    overhead = _table(residuals)
    eff_pa = prefill_attention_factor(prefill, peak_flops_per_s)
    compute = layer_compute_table(prefill, peak_flops_per_s, bandwidth_bytes_per_s, eff_c, eff_m, overhead, eff_pa)
    if compute is not None:
        # the compute factor is at the widest layer's level; what a narrower width's prefill takes beyond it
        # (a small layer's norms, rotary and activations per token weigh more) is its own overhead,
        # fitted apart from the decode steps' (other code) and never below the most decode tokens'
        extra: dict[int, dict[float, float]] = {}
        for tokens, w, time_s in prefill:
            linear, attn_s = _prefill_split(w, peak_flops_per_s, eff_pa)
            modelled = attn_s + t_on_device_s(linear, w.d_cpu + w.kv_write_cpu, peak_flops_per_s, bandwidth_bytes_per_s,
                                              float(compute(tokens)), float(eff_m(tokens)))
            extra.setdefault(tokens, {})[w.weight_bytes_cpu] = max(time_s - modelled, 0.0)
        for t, d in _pooled(extra).items():
            residuals[t] = {lb: max(v, float(overhead(max(residuals), lb))) for lb, v in d.items()}
        overhead = _table(residuals)
    return overhead, compute, (eff_a if any(len(v) > 1 for v in decode.values()) else None), eff_pa


def _prefill_split(w, peak_flops_per_s: float, eff_pa: float | None) -> tuple[float, float]:
    """(FLOPs left to the compute factor, seconds of the attention core priced apart) of a prefill
    layer: with no attention factor, all of C_Prefill goes to the compute factor, as before."""
    if not eff_pa:
        return float(w.flops), 0.0
    attn = float(w.prefill_attention_flops)
    return float(w.flops) - attn, t_compute_s(attn, peak_flops_per_s, eff_pa)


def prefill_attention_factor(prefill: list, peak_flops_per_s: float) -> float | None:
    """Eff of a prefill layer's attention core, from two prefill rows of one width with the same
    GEMM rows (b x s) and other prompt lengths (e.g. 1 x 1024 and 8 x 128): their GEMMs, weight
    reads and per-layer costs are the same, so the time between them is the attention pairs
    between them. The median over the widths; None without such a pair, or where the pairs'
    difference is within :data:`MIN_ATTENTION_SHARE` of the layer (noise, or an attention too
    cheap to matter: it stays with the compute factor)."""

    by_key: dict[tuple[float, int], list] = {}
    for tokens, w, time_s in prefill:
        by_key.setdefault((w.weight_bytes_cpu, tokens), []).append((float(w.prefill_attention_flops), time_s))
    effs = []
    for runs in by_key.values():
        (a0, t0), (a1, t1) = min(runs), max(runs)
        if a1 > a0 and (t1 - t0) > MIN_ATTENTION_SHARE * t1:
            effs.append(min(EFF_MAX, t_compute_s(a1 - a0, peak_flops_per_s, 1.0) / (t1 - t0)))
    return float(np.median(effs)) if effs else None


def _pooled(residuals: dict[int, dict[float, float]]) -> dict[int, dict[float, float]]:
    """Residuals (tokens -> layer bytes -> seconds) fitted non-decreasing in tokens at each layer
    size, least squares (pooling adjacent violators): a layer's own cost does not shrink with more
    tokens. Not a running maximum: that would let one slow row add its excess to every larger
    token count, whose factors already explain its time."""
    out = {t: dict(d) for t, d in residuals.items()}
    for lb in {lb for d in out.values() for lb in d}:
        ts = sorted(t for t in out if lb in out[t])
        for t, v in zip(ts, non_decreasing_fit([out[t][lb] for t in ts])):
            out[t][lb] = v
    return out


def _table(residuals: dict[int, dict[float, float]]) -> LayerOverhead:
    return LayerOverhead({t: Table(list(d), list(d.values()), lo=0.0, hi=10.0) for t, d in residuals.items()})


def layer_attention_table(decode: dict, peak_flops_per_s: float, bandwidth_bytes_per_s: float, eff_c, eff_a):
    """Eff_attn(ctx) of real decode layers, from the same layer timed over a short and a long KV
    cache: the extra keys' bytes over the extra time (less their attention FLOPs at the compute
    factor), the median over widths and batches; the SDPA micro-benchmark's ctx curve scaled to
    it where there is one (its shape kept, so ctx / Eff_attn(ctx) still never falls), else
    constant. None without such pairs."""

    effs, ctxs = [], []
    for (tokens, _), runs in decode.items():
        if len(runs) < 2:
            continue
        (l0, w0, t0), (l1, w1, t1) = min(runs, key=lambda x: x[0]), max(runs, key=lambda x: x[0])
        kv = float(w1.kv_read_cpu[0] - w0.kv_read_cpu[0])
        dt = (t1 - t0) - t_compute_s(float(w1.flops[0] - w0.flops[0]), peak_flops_per_s, float(eff_c(tokens)))
        # a difference of two timed runs: only where the extra keys cost a good part of the layer
        # (else a few % of noise on each run is most of the difference)
        if kv > 0 and dt > MIN_CONTEXT_SHARE * t0:
            effs.append(min(EFF_MAX, kv / (bandwidth_bytes_per_s * dt)))
            ctxs.append(float(np.sqrt(l0 * l1)))
    if not effs:
        return None
    if eff_a is None:
        lo, hi = min(ctxs), max(ctxs)
        return Table([lo, hi * 1.0001], [float(np.median(effs))] * 2)
    k = float(np.median([e / float(eff_a(c)) for e, c in zip(effs, ctxs)]))
    return Table(eff_a.x, eff_a.y * min(max(k, 1 / MAX_ATTENTION_RESCALE), MAX_ATTENTION_RESCALE))


# a narrower width's factor, lifted to the widest's level, further than this either way from the
# widest's own at the same tokens is noise (a 576-wide layer's few milliseconds on a 16-core host)
OUTLIER_RATIO = 2.0


def _at_the_widest(by_t: dict[int, dict[float, float]]) -> dict[float, float]:
    """Tokens -> compute factor at the widest layer's level, from every width's: each width's
    factors lifted by its ratio to the widest's, then the median over the widths at each token count
    (the widest's own row alone would carry all its noise into every larger model's prefill). The
    ratio is the median over the token counts both have when they share three or more; with fewer,
    the ratio at the largest shared count (the most compute-bound: the decode overhead and the glue
    weigh least there). Not a median of two, which is their mean: one disturbed narrow row (slower
    at 128 tokens than at 512) would then lift every narrow point several times over and price a
    long prefill several times fast.

    Where fewer than three widths were measured at a count the widest has (a median of two cannot
    outvote either's noise), a lifted width more than :data:`OUTLIER_RATIO` off the widest's own
    factor is left out; three or more keep their median. Above the widest's largest count a lifted
    narrow factor is held no lower than the widest's there (at one width, more rows per weight
    byte never make the GEMMs slower; no such bound below its smallest count, where few rows can
    run faster per FLOP than more). Without that floor, a narrow layer whose ratio at its largest
    count is small (a disturbed or cache-favoured row) would price a long prefill several times
    fast."""
    widest = max(lb for v in by_t.values() for lb in v)
    lift = {}
    for lb in {lb for v in by_t.values() for lb in v}:
        shared = sorted(t for t, v in by_t.items() if lb in v and widest in v)
        ratios = [by_t[t][widest] / by_t[t][lb] for t in shared]
        lift[lb] = float(np.median(ratios)) if len(ratios) >= 3 else ratios[-1] if ratios else 1.0
    own = sorted(t for t, v in by_t.items() if widest in v)
    out = {}
    for t, v in by_t.items():
        lifted = [eff * lift[lb] for lb, eff in v.items()]
        if widest in v and len(v) < 3:  # two widths: one more than OUTLIER_RATIO off the widest's is noise
            lifted = [x for x in lifted if 1 / OUTLIER_RATIO <= x / v[widest] <= OUTLIER_RATIO]
        f = float(np.median(lifted))
        if t > own[-1]:
            f = max(f, float(by_t[own[-1]][widest]))
        out[float(t)] = f
    return out


def layer_compute_table(prefill: list, peak_flops_per_s: float, bandwidth_bytes_per_s: float, eff_c, eff_m,
                        overhead: LayerOverhead, eff_pa: float | None = None):
    """Eff_comp(tokens) over the tokens the prefill layers span, the GEMM factor's points outside
    them; None without prefill rows. Each layer's factor: its compute time is what is left of its
    time after the memory term, the decode overhead (held) and, with ``eff_pa``, the attention
    core priced apart; at one token count, at the widest layer's level (:func:`_at_the_widest`:
    the width nearest the models that are offloaded; a narrower layer's norms, rotary and
    activations weigh more per FLOP, and :func:`derive_layers` gives what they take beyond this
    factor to that width's overhead); the whole table capped so that it grows no faster than the
    tokens do."""

    by_t: dict[int, dict[float, float]] = {}  # tokens -> layer bytes -> factor
    for tokens, w, time_s in prefill:
        linear, attn_s = _prefill_split(w, peak_flops_per_s, eff_pa)
        rest = (time_s - t_memory_s(w.d_cpu + w.kv_write_cpu, bandwidth_bytes_per_s, float(eff_m(tokens)))
                - overhead(tokens, w.weight_bytes_cpu) - attn_s)
        if rest > 0:
            by_t.setdefault(tokens, {})[float(w.weight_bytes_cpu)] = min(
                EFF_MAX, t_compute_s(linear, peak_flops_per_s, 1.0) / rest)
    if not by_t:
        return None
    lo, hi = min(by_t), max(by_t)
    points = {float(x): float(y) for x, y in zip(eff_c.x, eff_c.y) if x < lo or x > hi}
    points.update(_at_the_widest(by_t))
    x = sorted(points)
    return Table(x, capped_growth(x, [points[t] for t in x], power_law=True), log_y=True)
