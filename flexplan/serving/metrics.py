"""``/metrics`` in Prometheus' text format: the engine's queue, running requests per device, KV
blocks per pool, token counters and rate, TTFT and TPOT histograms, iterations by scheduler mode.

Each server has its own :class:`CollectorRegistry` (two servers in one process, as in the tests,
would otherwise collide on the global one). The engine loop's thread calls the ``observe_*``
methods; prometheus-client's metrics are thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from flexplan.serving.types import MODES, EngineStats, RequestOutput

RATE_WINDOW_S = 10.0  # the tokens/s gauge: generated tokens over the last this many seconds
# latency buckets in seconds: a CPU-only small model decodes in ~10-200 ms, a prefill queue takes seconds
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class ServingMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self._labels = {"model_name": model_name}
        m = ["model_name"]
        self.waiting = Gauge("flexplan_requests_waiting", "requests queued in the engine, not yet running", m,
                             registry=r)
        self.running = Gauge("flexplan_requests_running", "running requests by the device that attends their KV",
                             m + ["device"], registry=r)
        self.blocks_used = Gauge("flexplan_kv_blocks_used", "KV blocks in use per pool", m + ["pool"], registry=r)
        self.blocks_free = Gauge("flexplan_kv_blocks_free", "KV blocks free per pool", m + ["pool"], registry=r)
        self.prompt_tokens = Counter("flexplan_prompt_tokens", "prompt tokens of requests added", m, registry=r)
        self.prefix_queries = Counter("flexplan_prefix_cache_queries", "prompt tokens looked up in the prefix cache "
                                      "when their request was admitted", m, registry=r)
        self.prefix_hits = Counter("flexplan_prefix_cache_hits", "prompt tokens the prefix cache held (not computed "
                                   "again)", m, registry=r)
        self.blocks_cached = Gauge("flexplan_kv_blocks_cached", "full KV blocks named in the prefix cache per pool "
                                   "(held by requests or free to take)", m + ["pool"], registry=r)
        self.generation_tokens = Counter("flexplan_generation_tokens", "tokens generated", m, registry=r)
        self.tokens_per_s = Gauge("flexplan_generation_tokens_per_second",
                                  f"tokens generated per second over the last {RATE_WINDOW_S:g} s", m, registry=r)
        self.token_budget = Gauge("flexplan_iteration_token_budget", "new tokens the next iteration may schedule "
                                  "(--token-budget, or sized to --tpot-target-ms)", m, registry=r)
        self.iterations = Counter("flexplan_iterations", "engine iterations by the scheduler's mode", m + ["mode"],
                                  registry=r)
        self.placements = Counter("flexplan_placed_iterations", "a placed model's iterations by the executor "
                                  "placement they ran under (prefill / decode)", m + ["placement"], registry=r)
        self.ttft = Histogram("flexplan_time_to_first_token_seconds", "arrival to first token", m,
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.tpot = Histogram("flexplan_time_per_output_token_seconds",
                              "a request's time per token after its first", m, buckets=TPOT_BUCKETS_S, registry=r)
        self.e2e = Histogram("flexplan_e2e_request_latency_seconds", "arrival to last token", m,
                             buckets=TTFT_BUCKETS_S, registry=r)
        self.finished = Counter("flexplan_requests_finished", "requests finished by reason", m + ["finish_reason"],
                                registry=r)
        self.errors = Counter("flexplan_request_errors", "requests answered with an error, by HTTP status",
                              m + ["status"], registry=r)
        for mode in MODES:  # every mode present from the start, at 0, so a dashboard's rate() has a series
            self.iterations.labels(model_name, mode)
        self._lock = threading.Lock()
        self._seen = EngineStats()
        self._window: deque[tuple[float, int]] = deque()  # (monotonic time, generated tokens total)

    def observe_step(self, stats: EngineStats) -> None:
        """The engine's counters after an iteration (or after requests were added / aborted)."""
        name = self._labels["model_name"]
        self.waiting.labels(name).set(stats.waiting)
        for device, n in stats.running_by_device.items():
            self.running.labels(name, device).set(n)
        for pool, n in stats.blocks_used.items():
            self.blocks_used.labels(name, pool).set(n)
        for pool, n in stats.blocks_free.items():
            self.blocks_free.labels(name, pool).set(n)
        for pool, n in stats.blocks_cached.items():
            self.blocks_cached.labels(name, pool).set(n)
        self.token_budget.labels(name).set(stats.token_budget)
        now = time.monotonic()
        with self._lock:
            seen, self._seen = self._seen, stats
            self._window.append((now, stats.generated_tokens_total))
            while len(self._window) > 2 and now - self._window[1][0] >= RATE_WINDOW_S:
                self._window.popleft()
            t0, n0 = self._window[0]
        self.prompt_tokens.labels(name).inc(max(0, stats.prompt_tokens_total - seen.prompt_tokens_total))
        self.generation_tokens.labels(name).inc(max(0, stats.generated_tokens_total - seen.generated_tokens_total))
        self.prefix_queries.labels(name).inc(max(0, stats.prefix_query_tokens - seen.prefix_query_tokens))
        self.prefix_hits.labels(name).inc(max(0, stats.prefix_hit_tokens - seen.prefix_hit_tokens))
        if stats.iterations > seen.iterations and stats.last_mode:  # one step() is one iteration
            self.iterations.labels(name, stats.last_mode).inc(stats.iterations - seen.iterations)
        if stats.iterations > seen.iterations and stats.last_placement:
            self.placements.labels(name, stats.last_placement).inc(stats.iterations - seen.iterations)
        if now > t0:
            self.tokens_per_s.labels(name).set((stats.generated_tokens_total - n0) / (now - t0))

    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.labels(self._labels["model_name"]).observe(ttft_s)

    def observe_finished(self, out: RequestOutput, ttft_s: float, e2e_s: float) -> None:
        name = self._labels["model_name"]
        self.finished.labels(name, out.finish_reason or "").inc()
        self.e2e.labels(name).observe(e2e_s)
        if out.completion_tokens > 1:  # TPOT: the decode's pace, the first token's wait set apart
            self.tpot.labels(name).observe((e2e_s - ttft_s) / (out.completion_tokens - 1))

    def observe_error(self, status: int) -> None:
        self.errors.labels(self._labels["model_name"], str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
