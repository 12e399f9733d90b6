"""What the serving rooms pass each other: a request's sampling parameters, one iteration's
output per request, the engine's counters, and the scheduler's decision as data.

The HTTP front only translates requests into :class:`SamplingParams` and
:class:`RequestOutput` into responses; the scheduler's decision is an :class:`IterationPlan`
that a test can check on numbers worked by hand, without running a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flexplan.errors import InvalidInputError
from flexplan.plan_types import PHASES

# Where a scheduler may put an iteration (NEO section 4, APEX section 3.3):
MODE_DEVICE_ONLY = "device-only"  # every running request's KV and attention on the accelerator (NEO's GPU-only)
MODE_ASYMMETRIC = "asymmetric"  # NEO's asymmetric pipelining: two sub-batches, host-KV decodes' attention on the CPU
MODE_ASYNC_OVERLAP = "async-overlap"  # APEX: CPU attention consumed one iteration later
MODE_CPU_ONLY = "cpu-only"  # no accelerator: the whole iteration on the CPU
MODES = (MODE_DEVICE_ONLY, MODE_ASYMMETRIC, MODE_ASYNC_OVERLAP, MODE_CPU_ONLY)

FINISH_STOP = "stop"  # end-of-sequence token or a stop string
FINISH_LENGTH = "length"  # max_tokens reached, or the model's context is full
FINISH_ABORT = "abort"  # aborted by the caller (a client that disconnected)
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling, as OpenAI's API names it. ``temperature=0`` is greedy;
    ``top_k=0`` and ``top_p=1`` switch those filters off; ``seed`` makes a sampled request
    repeat its tokens whatever else shares its batch."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks force a trace's output length

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidInputError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and 0.0 <= self.temperature <= 2.0):
            raise InvalidInputError(f"temperature must be between 0 and 2 (0: greedy), got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise InvalidInputError(f"top_p must be in (0, 1] (1: off), got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InvalidInputError(f"top_k must be a non-negative integer (0: off), got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidInputError(f"stop must be non-empty strings, got {self.stop!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -(2**63) <= self.seed < 2**64):  # what a 64-bit generator takes
            raise InvalidInputError(f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class RequestOutput:
    """What one iteration produced for one request: its new tokens (and their text where the
    engine has a tokenizer), and whether and why it finished."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # one of FINISH_REASONS once finished
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far, this iteration's included


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters after an iteration (what ``/metrics`` exports)."""

    waiting: int = 0
    running_by_device: dict[str, int] = field(default_factory=dict)  # "accelerator" / "cpu" -> requests
    blocks_used: dict[str, int] = field(default_factory=dict)  # pool ("device" / "host") -> KV blocks
    blocks_free: dict[str, int] = field(default_factory=dict)
    iterations: int = 0
    last_mode: str = ""  # one of MODES
    last_placement: str = ""  # a placed model's last placement (IterationPlan.placement)
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    token_budget: int = 0  # new tokens the next iteration may schedule
    prefix_query_tokens: int = 0  # prompt tokens admitted, looked up in the prefix cache
    prefix_hit_tokens: int = 0  # ... found there, not computed
    blocks_cached: dict[str, int] = field(default_factory=dict)  # pool -> full blocks named in its prefix cache


@dataclass(frozen=True)
class IterationPlan:
    """A scheduler's decision for one iteration, as data. Sub-batch 0 holds the prefill chunks
    and the decodes whose KV is in the device pool; sub-batch 1 the decodes whose KV is in the
    host pool, their attention on the CPU beside it (NEO's asymmetric pipelining)."""

    mode: str
    prefill: tuple[tuple[str, int], ...] = ()  # (request id, prompt tokens this iteration: a chunk)
    device_decodes: tuple[str, ...] = ()
    host_decodes: tuple[str, ...] = ()
    swap_out: tuple[str, ...] = ()  # KV moved device -> host pool before the iteration
    swap_in: tuple[str, ...] = ()  # KV moved host -> device pool before the iteration
    preempted: tuple[str, ...] = ()  # back to waiting, KV freed (recomputed later)
    prefill_host: tuple[str, ...] = ()  # prefills of requests with no blocks yet whose KV goes to the host pool
    predicted_s: float = 0.0  # the estimator's price of this iteration
    why: str = ""  # one line: the inequality or rule that chose the mode
    # a placed model's executor placement for the iteration, one of PHASES (the plan's prefill or
    # decode placement, whatever the batch holds); "": the engine's rule (flexplan.serving.placed.phase_of)
    placement: str = ""

    def __post_init__(self):
        if self.mode not in MODES:
            raise InvalidInputError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.placement and self.placement not in PHASES:
            raise InvalidInputError(f"placement must be one of {', '.join(PHASES)} or '' (the engine's rule), "
                                    f"got {self.placement!r}")

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(r for r, _ in self.prefill) + self.device_decodes + self.host_decodes
