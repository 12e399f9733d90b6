"""The serving engine's loop: requests join and leave the running batch between iterations
(continuous batching), each iteration one forward pass over every scheduled request's new tokens.

``step()`` asks the scheduler for an :class:`IterationPlan` (a narrow call: ``schedule(state)``
with an :class:`EngineState` of plain data), carries it out (preemptions, swaps between the KV
pools, block allocation), runs the model once over the ragged batch (:mod:`model_runner`),
samples each request's next token (:mod:`sampling`), and finishes and frees what is done. A decode
batch of N reads the weights once: the throughput a one-request loop leaves unused.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import deque
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flexplan.compute_thread import ComputeThread
from flexplan.errors import DeviceUnavailableError, FlexplanError, InvalidInputError
from flexplan.executor import cpu_linear
from flexplan.quant.sources import DENSE, GGUF_BLOCKS, weights_source
from flexplan.serving import placed, sampling
from flexplan.serving.fcfs import FcfsScheduler
from flexplan.serving.iteration_budget import IterationBudget
from flexplan.serving.kv_blocks import (
    BLOCK_SIZE_TOKENS,
    DEVICE,
    HOST,
    BlockManager,
    pool_blocks,
    text_config,
)
from flexplan.serving.model_runner import ModelRunner, PendingForward
from flexplan.serving.plan_check import check_plan
from flexplan.serving.ragged_batch import Segment
from flexplan.serving.request import Request
from flexplan.serving.state import EngineState
from flexplan.serving.types import (
    FINISH_ABORT,
    MODE_ASYMMETRIC,
    MODE_ASYNC_OVERLAP,
    EngineStats,
    IterationPlan,
    RequestOutput,
    SamplingParams,
)
from flexplan.smollm import default_model_dir

STALL_STEPS = 100  # generate(): iterations in a row that schedule nothing before it gives up
KV_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)  # the KV blocks' dtypes (None: the model's)


def _check_target(source, device, dtype: torch.dtype) -> None:
    """A device this machine has; blocks (a GGUF file's own, or int4 / int8 made at load) on the CPU
    compute in float32 activations (the block kernels' arithmetic); on an accelerator they are
    dequantised per call by torch ops, in any dtype. Anything else is refused, naming what works."""
    where = str(device).split(":")[0] if device is not None else "cpu"
    if where == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError(f"device={device!r} but this machine has no CUDA device (torch "
                                     f"{torch.__version__}); serve on the CPU (device='cpu' or None)")
    if not source.blocks or where != "cpu" or dtype == torch.float32:
        return
    if source.kind == GGUF_BLOCKS:
        what = f"{Path(str(source.path)).name}: a GGUF file's own blocks"
        instead = "weights='float32' (every weight dequantised)"
    else:
        what = f"weights={source.kind!r}: blocks quantised at load"
        instead = "weights='float32' (the folder's float weights)"
    raise InvalidInputError(f"{what} compute in float32 activations on the CPU; got dtype={dtype}: pass "
                            f"dtype=torch.float32, or {instead} for {dtype}")


def _locked(method):
    """One caller at a time: a server's request thread may add or abort while its loop steps."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


class Engine:
    """Continuous batching over a transformers causal LM, its weights where they are (one device).

    ``device_blocks`` / ``host_blocks``: KV blocks of ``block_size_tokens`` tokens in the device
    pool (on the model's device; on the CPU it stands in for an accelerator) and the host pool
    (CPU memory, attended on the CPU). Left out, they are sized by :func:`kv_blocks.pool_blocks`:
    the device pool from ``device_memory_bytes`` (the accelerator's budget: less the weights and an
    iteration's activations; on the CPU it makes a pool that stands in for an accelerator's), else
    80% of the accelerator's free memory (none when the model is on the CPU); the host pool from
    ``host_memory_bytes``, else a quarter of the available memory, at most 2 GiB.
    ``token_budget``: new tokens per iteration (prefill chunks + decodes). ``iteration_target_s``:
    the time an iteration (a running request's time between tokens) should take: each iteration's
    budget is then sized to it from the iterations measured (:mod:`iteration_budget`), at most
    ``token_budget``; None: always ``token_budget``. ``kv_dtype``: the KV blocks' dtype (default: the
    model's); ``torch.bfloat16`` under a float32 model halves the bytes a decode's attention reads and
    doubles the tokens a pool holds, K and V rounded to bfloat16 as they are written.
    ``scheduler``: any object with ``schedule(EngineState) -> IterationPlan`` (default: FCFS; for a
    FlexModel, FCFS under the placement the estimator prices lower, :mod:`placed_scheduler`);
    where it also has ``observe(plan, seconds)``, each iteration's measured wall time is passed
    back (an online correction of its cost model). ``asymmetric_pipelining``: run an asymmetric
    plan's two sub-batches at once (default: where the model is on an accelerator).
    ``prefix_caching``: a prompt whose leading whole blocks another request computed takes those
    blocks instead of computing them again (:mod:`kv_blocks`); False computes every prompt whole."""

    def __init__(self, model, tokenizer=None, *, device_blocks: int | None = None, host_blocks: int | None = None,
                 block_size_tokens: int = BLOCK_SIZE_TOKENS, token_budget: int = 512, max_running: int = 256,
                 max_model_len: int | None = None, scheduler=None, asymmetric_pipelining: bool | None = None,
                 device_memory_bytes: int | None = None, host_memory_bytes: int | None = None,
                 iteration_target_s: float | None = None, kv_dtype: torch.dtype | None = None,
                 prefix_caching: bool = True):
        flexmodel = None
        if placed.is_flexmodel(model):  # a FlexModel: its executor places the weights, the engine keeps the KV
            flexmodel = model
            model, flex_tokenizer = placed.unwrap(flexmodel, asymmetric_pipelining)
            tokenizer = tokenizer if tokenizer is not None else flex_tokenizer
            asymmetric_pipelining = False
        for name, v in (("token_budget", token_budget), ("max_running", max_running)):
            if not isinstance(v, int) or v < 1:
                raise InvalidInputError(f"{name} must be a positive integer, got {v!r}")
        self.budget = IterationBudget(iteration_target_s, token_budget) if iteration_target_s is not None else None
        if kv_dtype not in KV_DTYPES:
            raise InvalidInputError(f"kv_dtype={kv_dtype!r}: give one of {', '.join(map(str, KV_DTYPES))} "
                                    "(None: the model's dtype)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if flexmodel is not None:  # the device pool on the plan's accelerator, whatever the first weight's place
            self.device = placed.accelerator(flexmodel)
        config = text_config(model.config)
        context = getattr(config, "max_position_embeddings", None) or 2048
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                          or not 1 <= max_model_len <= context):
            # past the positions the model was trained on its rotary angles extrapolate: garbage, not an error
            raise InvalidInputError(f"max_model_len={max_model_len!r}: give 1..{context} (this model's context, "
                                    "max_position_embeddings), or None for all of it")
        self.max_model_len = int(max_model_len or context)
        self.vocab_size = int(config.vocab_size)
        on_accelerator = self.device.type != "cpu"
        if flexmodel is not None and device_blocks is None and device_memory_bytes is not None:
            device_blocks = placed.device_pool_blocks(flexmodel, device_memory_bytes, block_size_tokens, token_budget,
                                                      max_running, kv_dtype)
        sized = pool_blocks(model, device=self.device, block_size_tokens=block_size_tokens, token_budget=token_budget,
                            max_running=max_running, device_memory_bytes=device_memory_bytes,
                            host_memory_bytes=host_memory_bytes, kv_dtype=kv_dtype)
        device_blocks = sized[0] if device_blocks is None else device_blocks
        host_blocks = sized[1] if host_blocks is None else host_blocks
        self.blocks = BlockManager(config, device_blocks=device_blocks, host_blocks=host_blocks,
                                   dtype=kv_dtype or self.dtype, device=self.device, block_size_tokens=block_size_tokens,
                                   prefix_caching=prefix_caching)
        self.runner = ModelRunner(model, self.blocks)
        self.flexmodel = None
        if flexmodel is not None:
            placed.attach(self, flexmodel)
        if scheduler is None and flexmodel is not None:  # its placement per iteration, priced (placed_scheduler)
            scheduler = placed.default_scheduler(flexmodel)
        self.scheduler = scheduler if scheduler is not None else FcfsScheduler()
        self.token_budget, self.max_running, self.accelerator = token_budget, max_running, on_accelerator
        # an asymmetric plan's two sub-batches run at once where the CPU's attention overlaps an
        # accelerator's kernels; with the CPU alone they would only share its cores
        self.asymmetric_pipelining = on_accelerator if asymmetric_pipelining is None else bool(asymmetric_pipelining)
        self.eos = sampling.eos_token_ids(model, tokenizer)
        self._waiting: deque[Request] = deque()
        self._running: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self._arrivals = itertools.count()
        self._iterations, self._last_mode, self._last_placement = 0, "", ""
        self._prompt_total = self._generated_total = 0
        self._scheduled_tokens = 0  # by the last iteration
        self._lock = threading.RLock()
        self.last_iteration_s = 0.0  # wall time of the last step()'s swaps, forward and sampling
        self._in_flight: PendingForward | None = None  # host decodes overlapping the next iteration (APEX)
        self._held_outputs: list[RequestOutput] = []  # collected early (an abort waited for them)
        self.compute_thread = ComputeThread()  # step() on another thread warns once (compute_thread.py)

    @classmethod
    def from_pretrained(cls, path=None, *, weights: str | None = None, device: str | None = None,
                        dtype: torch.dtype = torch.float32, cpu_linear_kernel: str | None = None, plan=None,
                        accelerator: str | None = None, gpu_memory_bytes: int | None = None, **engine_kwargs) -> Engine:
        """An engine over a transformers checkpoint folder or hub name (None: the embedded SmolLM2) or
        a ``.gguf`` file, on ``device`` (default: the CPU). ``weights``: what ``flexplan.load`` takes
        (one rule: :func:`flexplan.quant.sources.weights_source`): for a ``.gguf`` file "gguf" (default,
        or "auto": its linears on the file's own blocks) or "float32" (every weight dequantised); for
        a folder "float32" (default: its float weights in ``dtype``) or "int4" / "int8" (its decoder
        and head linears quantised at load to group-wise blocks). Blocks compute on the CPU in float32
        activations (its kernels), on an accelerator in ``dtype`` (dequantised there per call). On the CPU its dense linears take ``cpu_linear_kernel`` (default:
        flexplan's fastest here, :func:`flexplan.executor.cpu_linear.default_kernel`): the engine owns
        this model, so its weights are packed once for the kernel that streams them (a decode batch
        is a few rows: a GEMV's read of the weights, not a GEMM); blocks stay as they are. With
        ``plan`` ("auto", a dict of overrides or a Plan) the model is loaded by ``flexplan.load(path,
        plan, accelerator, gpu_memory_bytes, weights=)`` and served with its weights placed per phase
        (:mod:`placed`)."""
        path = str(path) if path is not None else str(default_model_dir(verbose=False))
        source = weights_source(path, weights)  # refuses a choice the path does not take, before any load
        if plan is not None:  # placed by flexplan's planner and executor (flexplan.serving.placed)
            return cls(placed.load(path, plan, accelerator, gpu_memory_bytes, dtype, cpu_linear_kernel, weights),
                       **engine_kwargs)
        _check_target(source, device, dtype)
        kernel = cpu_linear_kernel or cpu_linear.default_kernel()
        why = cpu_linear.kernel_unavailable(kernel)
        if why:
            raise InvalidInputError(why.replace("linear_kernel=", "cpu_linear_kernel="))
        if source.kind == DENSE:
            try:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
                tokenizer = AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError) as e:  # transformers' own words, without its trace
                raise InvalidInputError(f"could not load a causal LM and its tokenizer from {path!r} ({e}); give a "
                                        "folder with config.json, weights and tokenizer files, a .gguf file, or None "
                                        "for the embedded SmolLM2") from None
        else:
            model, tokenizer = source.load()
            if tokenizer is None:
                raise InvalidInputError(f"{path}: no tokenizer could be built from it; serve a .gguf file with "
                                        "tokenizer metadata, or a folder with tokenizer files")
            if dtype != torch.float32:  # dequantised: float32, cast as a folder is (blocks stay bytes)
                model = model.to(dtype)
        if device is not None:
            model = model.to(device)
        # only plain nn.Linear weights are packed (cpu_linear.packable): QuantLinear keeps its blocks
        if next(model.parameters()).device.type == "cpu" and kernel != cpu_linear.KERNEL_PLAIN:
            cpu_linear.pack_module(model, None, kernel)
        return cls(model, tokenizer, **engine_kwargs)

    def close(self) -> None:
        """Give the model's attention modules their own configs back (after any forward in flight)."""
        if self._in_flight is not None:
            self._in_flight.result()
            self._in_flight = None
        self.runner.close()
        placed.detach(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests in and out ----
    @_locked
    def add_request(self, request_id: str, prompt_token_ids: list[int] | str, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise InvalidInputError(f"params must be a flexplan.serving.SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidInputError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._running or any(r.request_id == request_id for r in (*self._waiting, *self._aborted)):
            raise InvalidInputError(f"request id {request_id!r} is in use by an unfinished request: give each "
                                    "request its own id")
        prompt = self._tokens(prompt_token_ids)
        n, ctx = len(prompt), self.max_model_len
        if n >= ctx:
            raise InvalidInputError(f"the prompt has {n} tokens; this model's context is {ctx} tokens, so a prompt "
                                    f"may have at most {ctx - 1}")
        if n + params.max_tokens > ctx:
            raise InvalidInputError(f"max_tokens={params.max_tokens} with a {n}-token prompt exceeds the model's "
                                    f"context of {ctx} tokens: ask for at most {ctx - n}")
        need = self.blocks.blocks_for(n + params.max_tokens)
        most = max(p.num_blocks for p in self.blocks.pools.values())
        if need > most:
            fits = most * self.blocks.block_size_tokens - n
            what = f"ask for max_tokens={fits} at most" if fits > 0 else "give the engine more KV blocks"
            raise InvalidInputError(f"a {n}-token prompt with max_tokens={params.max_tokens} needs {need} KV blocks; "
                                    f"the largest pool holds {most}: {what}")
        r = Request(request_id, prompt, params, next(self._arrivals), sampling.request_generator(params),
                     sampling.Detokenizer(self.tokenizer, prompt, params.stop))
        self._waiting.append(r)
        self._prompt_total += n

    def _tokens(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidInputError("a text prompt needs a tokenizer: give Engine(model, tokenizer) or token ids")
            prompt = self.tokenizer.encode(prompt)
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise InvalidInputError(f"a prompt is a string or a list of token ids, got {prompt!r:.80}") from None
        if not ids:
            raise InvalidInputError("the prompt is empty: give at least one token (or a non-empty string)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidInputError(f"token ids {bad[:5]} are outside this model's vocabulary of {self.vocab_size}: "
                                    f"each must be in 0..{self.vocab_size - 1}")
        return ids

    @_locked
    def abort(self, request_id: str) -> bool:
        """Free the request's blocks now; its next output is finished with reason "abort". False
        where no unfinished request has this id (finished already: nothing to do)."""
        if self._in_flight is not None and any(s.request_id == request_id for s in self._in_flight.segments):
            self._held_outputs += self._collect_in_flight()  # its blocks are being written: wait, then free
        r = self._running.pop(request_id, None)
        if r is None:
            r = next((w for w in self._waiting if w.request_id == request_id), None)
            if r is None:
                return False
            self._waiting.remove(r)
        self.blocks.free(request_id)
        r.finish_reason = FINISH_ABORT
        self._aborted.append(r)
        return True

    @_locked
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._aborted or self._held_outputs)

    @_locked
    def state(self) -> EngineState:
        """What the scheduler sees now: the waiting requests but those held for a prefix
        (:meth:`_held_for_a_prefix`)."""
        free = self.blocks.usage()[1]
        held = self._held_for_a_prefix()
        return EngineState(
            waiting=tuple(r.view(None) for r in self._waiting if r.request_id not in held),
            running=tuple(r.view(self.blocks.pool_of(r.request_id), self.blocks.shared_blocks(r.request_id))
                          for r in self._running.values()),
            free_blocks=free, total_blocks={n: p.num_blocks for n, p in self.blocks.pools.items()},
            block_size_tokens=self.blocks.block_size_tokens, token_budget=self.iteration_tokens(),
            max_running=self.max_running, accelerator=self.accelerator)

    def iteration_tokens(self) -> int:
        """The next iteration's token budget: ``token_budget``, or sized to ``iteration_target_s``."""
        if self.budget is None:
            return self.token_budget
        return self.budget.tokens(sum(1 for r in self._running.values() if r.decoding))

    @_locked
    def stats(self) -> EngineStats:
        used, free = self.blocks.usage()
        by_device = {"accelerator": 0, "cpu": 0}  # by pool: the device pool's requests attend on the accelerator
        for rid in self._running:
            by_device["accelerator" if self.blocks.pool_of(rid) == DEVICE else "cpu"] += 1
        return EngineStats(waiting=len(self._waiting), running_by_device=by_device, blocks_used=used,
                           blocks_free=free, iterations=self._iterations, last_mode=self._last_mode,
                           last_placement=self._last_placement,
                           prompt_tokens_total=self._prompt_total, generated_tokens_total=self._generated_total,
                           token_budget=self.iteration_tokens(), prefix_query_tokens=self.blocks.prefix_query_tokens,
                           prefix_hit_tokens=self.blocks.prefix_hit_tokens,
                           blocks_cached={n: p.cached_blocks for n, p in self.blocks.pools.items()})

    # ---- one iteration ----
    @_locked
    def step(self) -> list[RequestOutput]:
        """One iteration: the scheduler's plan carried out, one forward pass, one token per
        request that finished its prefill or decoded. Outputs of requests that produced tokens,
        finished or were aborted. Under APEX's asynchronous overlap the host decodes of an
        iteration run beside the next and their tokens come out of that next step()."""
        self.compute_thread.check("Engine.step()")
        outputs = [r.take_output() for r in self._aborted] + self._held_outputs + self._collect_in_flight()
        self._aborted, self._held_outputs = [], []
        if not (self._waiting or self._running):
            return outputs
        plan = self.scheduler.schedule(self.state())
        started = time.perf_counter()
        segments = self._carry_out(plan)
        self._scheduled_tokens = sum(len(s.token_ids) for s in segments)
        self._iterations += 1
        self._last_mode, self._last_placement = plan.mode, plan.placement
        host = set(plan.host_decodes)
        phase = plan.placement or None  # a placed model's placement, where the scheduler chose one
        if plan.mode == MODE_ASYNC_OVERLAP and host:  # consumed one iteration later
            self._in_flight = self.runner.forward_async([s for s in segments if s.request_id in host], phase)
            segments = [s for s in segments if s.request_id not in host]
        if segments and plan.mode == MODE_ASYMMETRIC and self.asymmetric_pipelining:
            # sub-batch 1: the host decodes, listed last in the segments, so the logits' order holds
            logits = self.runner.forward_sub_batches([[s for s in segments if s.request_id not in host],
                                                      [s for s in segments if s.request_id in host]], phase)
        elif segments:
            logits = self.runner.forward(segments, phase)
        outputs += self._finish(segments, logits) if segments else []
        self.last_iteration_s = time.perf_counter() - started
        if self.budget is not None and self._in_flight is None:  # an overlapped iteration's time is not its own
            self.budget.observe(self._scheduled_tokens, self.last_iteration_s)
        observe = getattr(self.scheduler, "observe", None)
        if callable(observe):  # what the iteration took, for a scheduler that corrects its cost model online
            observe(plan, self.last_iteration_s)
        return outputs

    def _finish(self, segments: list[Segment], logits: torch.Tensor) -> list[RequestOutput]:
        """Sample the segments' next tokens; their outputs; finished requests' blocks freed."""
        sampled = [self._running[s.request_id] for s in segments if s.logits]
        tokens = sampling.sample(logits, [r.params for r in sampled], [r.generator for r in sampled])
        for r, t in zip(sampled, tokens):
            r.append(t, self.eos, self.max_model_len)
        self._generated_total += len(tokens)
        outputs = []
        for s in segments:
            r = self._running[s.request_id]
            self.blocks.commit(r.request_id, r.tokens, r.computed)  # its KV is written: full blocks join the cache
            if r.new_tokens or r.finish_reason:
                outputs.append(r.take_output())
            if r.finish_reason:
                self.blocks.free(r.request_id)
                del self._running[r.request_id]
        return outputs

    def _collect_in_flight(self) -> list[RequestOutput]:
        """The outputs of the host decodes still running from the last iteration (waits for them)."""
        if self._in_flight is None:
            return []
        pending, self._in_flight = self._in_flight, None
        return self._finish(pending.segments, pending.result())

    def _names(self, r: Request) -> list[bytes]:
        if r.block_names[0] != len(r.prompt) + len(r.output):
            r.block_names = (len(r.prompt) + len(r.output), self.blocks.prefix_names(r.tokens))
        return r.block_names[1]

    def _held_for_a_prefix(self) -> set[str]:
        """Waiting requests left out of this iteration's admissions: the first whole block of theirs
        that the cache lacks is one a request now prefilling will compute, or one an earlier waiting
        request (not held) would compute first. Admitted together, each would compute the shared
        prefix itself; held, it takes the blocks from the cache once they are computed (SGLang's
        in-batch prefix caching). A held request never waits on a request that cannot move first:
        the one it waits on is running, or is ahead of it in the queue."""
        if not self.blocks.prefix_caching or not self._waiting:
            return set()
        bs, forgotten = self.blocks.block_size_tokens, self.blocks.names_forgotten
        computing = {name for r in self._running.values() if not r.decoding
                     for name in self._names(r)[r.computed // bs:]}
        held, claimed = set(), set()
        for r in self._waiting:  # the queue's order (a preempted request is back at its front)
            names = self._names(r)
            # its first name the cache lacks; the names found cached before are looked up again only
            # where the cache has dropped a name since (every iteration asks, for every waiting request)
            when, first = r.names_cached
            first = first if when == forgotten else 0
            while first < len(names) and self.blocks.cached(names[first]):
                first += 1
            r.names_cached = (forgotten, first)
            if first == len(names):
                continue
            if names[first] in computing or names[first] in claimed:
                held.add(r.request_id)
            else:
                claimed.update(names[first:])
        return held

    def _carry_out(self, plan: IterationPlan) -> list[Segment]:
        """Preemptions, swaps and block allocations of the plan; the segments to run."""
        waiting = {r.request_id: r for r in self._waiting}
        check_plan(plan, self.blocks, self._running, set(waiting))
        for rid in plan.preempted:  # back to the front of the queue, its KV recomputed later
            r = self._running.pop(rid)
            self.blocks.free(rid)
            r.computed = 0
            self._waiting.appendleft(r)
            waiting[rid] = r
        for rid in plan.swap_out:
            self.blocks.swap(rid, HOST)
        for rid in plan.swap_in:
            self.blocks.swap(rid, DEVICE)
        segments = []
        for rid, n in plan.prefill:
            r = waiting.pop(rid, None)
            if r is not None:
                self._waiting.remove(r)
                self._running[rid] = r
                pool = HOST if rid in plan.prefill_host or not self.blocks.pools[DEVICE].num_blocks else DEVICE
                if r.computed == 0:  # the blocks another request (or its own preempted run) computed
                    r.computed = self.blocks.match_prefix(rid, r.tokens, pool)
            else:
                r, pool = self._running[rid], None
            todo = len(r.tokens) - r.computed
            n = min(n, todo)
            self.blocks.append(rid, n, pool)
            segments.append(Segment(rid, tuple(r.tokens[r.computed:r.computed + n]), r.computed, n == todo))
            r.computed += n
        for rid, pool in [(rid, DEVICE) for rid in plan.device_decodes] + [(rid, HOST) for rid in plan.host_decodes]:
            r = self._running[rid]
            self.blocks.append(rid, 1)
            segments.append(Segment(rid, (r.output[-1],), r.computed))
            r.computed += 1
        return segments


    # ---- convenience ----
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` (strings or token-id lists) to the end; one output per prompt with all
        its tokens and text. The engine must hold no other request (step() them yourself)."""
        if self.has_unfinished():
            raise InvalidInputError("generate() runs the engine alone, but it holds unfinished requests: drive "
                                    "them with step(), or call generate() when has_unfinished() is False")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = params if params is not None else SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidInputError(f"{len(prompts)} prompts but {len(plist)} SamplingParams: give one, or one each")
        ids = [f"generate-{i}" for i in range(len(prompts))]
        try:
            for rid, p, sp in zip(ids, prompts, plist):
                self.add_request(rid, p, sp)
        except FlexplanError:
            for rid in ids:
                self.abort(rid)
            self._aborted = []
            raise
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        text: dict[str, str] = {rid: "" for rid in ids}
        final: dict[str, RequestOutput] = {}
        idle = 0
        while self.has_unfinished():
            outs = self.step()
            idle = 0 if outs or self._scheduled_tokens else idle + 1
            if idle >= STALL_STEPS:
                raise FlexplanError(f"the scheduler scheduled nothing for {STALL_STEPS} iterations; "
                                    f"state: {self.stats()}")
            for o in outs:
                tokens[o.request_id].extend(o.new_token_ids)
                text[o.request_id] += o.new_text
                if o.finished:
                    final[o.request_id] = o
        return [RequestOutput(rid, tuple(tokens[rid]), text[rid], True, final[rid].finish_reason,
                              final[rid].prompt_tokens, final[rid].completion_tokens) for rid in ids]
