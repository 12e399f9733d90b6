"""``flexplan.load``: a HuggingFace causal LM that runs its plan behind a ``generate()`` API.

    lm = flexplan.load("path/to/model")            # plan="auto", CUDA when there is one
    out = lm.generate(**tok(prompts, return_tensors="pt", padding=True), max_new_tokens=32)
    print(lm.last_stats.summary())                  # measured TTFT/TPOT, GB/s, TFLOP/s vs predicted

``generate`` takes and returns what transformers' ``generate`` does (greedy, sampling, beam
search, stopping criteria, streamers, batched left-padded inputs); the executor only decides
where each layer computes.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flexplan import greedy_decode
from flexplan.compute_thread import ComputeThread
from flexplan.errors import DeviceUnavailableError, FlexplanError, InvalidInputError
from flexplan.estimator.policies import REGISTRY, placement_of
from flexplan.executor.cpu_backend import local_cpu_cores, local_cpu_dtype
from flexplan.executor.families import CACHE_KWARG, cache_in, check_supported
from flexplan.executor.link import Link
from flexplan.executor.loading import is_model_folder, load_streaming, read_config
from flexplan.executor.loading import own_module_tree, refuse_placed_tree
from flexplan.executor.placement import require_accelerator
from flexplan.executor.plans import check_overrides, fixed_plan
from flexplan.executor.runner import Executor
from flexplan.executor.stats import RunStats, collect
from flexplan.factors import calibrated_cpu_threads
from flexplan.factors.correction import uncorrected
from flexplan.factors.correction_store import learn
from flexplan.hardware import get_hardware
from flexplan.hardware.spec import DTYPE_BYTES, Hardware, canonical_dtype
from flexplan.hardware.standin import standin_hardware
from flexplan.inputs import check_generate_arguments, check_kv_fits_host, check_load_arguments, check_plan_argument
from flexplan.measure.hostload import cpu_seconds as _cpu_seconds  # CPU time other processes took
from flexplan.measure.hostload import other_share as _other_share
from flexplan.measure.state import efficiency_now, refresh
from flexplan.plan_expert_cache import resolve_profile
from flexplan.plan_types import Plan
from flexplan.planner import plan as plan_fn
from flexplan.quant.sources import GGUF_FLOAT32, weights_source
from flexplan.quant.sources import folder_tokenizer as _tokenizer
from flexplan.workload.model import ModelSpec

DEFAULT_SHAPE = {"batch_size": 1, "input_len": 128, "output_len": 32}


@dataclass(frozen=True)
class Replanned:
    """A request shape whose best plan changed once online corrections changed the predictions."""

    shape: tuple[int, int, int]  # (batch, input length, new tokens)
    before: str  # "prefill cpu (M=0), decode cpu (M=0)"
    after: str
    calibration: str  # the new plan's efficiency source: which corrections it used

    def describe(self) -> str:
        return f"re-planned batch {self.shape[0]}, {self.shape[1]}+{self.shape[2]} tokens: {self.before} -> {self.after}"


# a plan scaled to the host's memory state (flexplan.measure.state) is priced again, with a new
# probe, once this old: the state flips minute to minute on some hosts; it costs a probe (tens of
# ms) and the planner's few ms, at most once per this many seconds and shape
PLAN_STATE_MAX_AGE_S = 10.0


def _state_scaled(plan: Plan) -> bool:
    """Whether ``plan``'s factors were scaled by a probe of its time (its note reads "... now vs ...")."""

    return plan.factors.state_probed


def _choice(plan: Plan) -> str:
    return ", ".join(f"{ph} {c.policy} (M={c.gpu_layers})" for ph, c in plan.phases.items())


def _host_memory_bytes(field: str = "MemAvailable") -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _resolve_accelerator(accelerator: str | None) -> str | None:
    if accelerator is None:
        return "cuda" if torch.cuda.is_available() else None
    acc = str(accelerator).lower()
    if acc.startswith("cuda"):
        if not torch.cuda.is_available():
            why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise DeviceUnavailableError(
                f"accelerator={accelerator!r} but {why} (torch {torch.__version__}); use accelerator=None "
                "(CPU only) or accelerator='cpu' to run every path on the CPU stand-in")
        return acc
    if acc == "cpu":
        return "cpu"
    raise InvalidInputError(f"accelerator must be 'cuda', 'cpu' (stand-in) or None, got {accelerator!r}")


class FlexModel:
    """A loaded model, its executor and its plan; ``generate()`` as in transformers."""

    def __init__(self, model, executor: Executor, *, tokenizer=None, plan_spec: Any = None,
                 planner_args: dict[str, Any] | None = None, cpu_threads_source: str = "",
                 online_correction: bool = True):
        self.model = model
        self.executor = executor
        self.tokenizer = tokenizer
        self.cpu_threads_source = cpu_threads_source  # why the executor runs this many CPU threads
        self.last_stats: RunStats | None = None
        self.compute_thread = ComputeThread()  # generate() on another thread warns once (compute_thread.py)
        # "auto" or a dict of overrides: planned per request shape; a Plan: fixed
        self._auto = isinstance(plan_spec, dict) or plan_spec == "auto"
        self._plan_spec = {k: v for k, v in plan_spec.items() if k not in DEFAULT_SHAPE} if isinstance(plan_spec, dict) else plan_spec
        self._planner_args = planner_args or {}
        self._plans: dict[tuple[int, int, int], Plan] = {}
        # learn from each run's measurements (calibration/correction.py); plans made before the
        # corrections last changed are kept to tell whether re-planning changed the choice
        self.online_correction = online_correction
        self._stale_plans: dict[tuple[int, int, int], Plan] = {}
        self._planned_at: dict[tuple[int, int, int], float] = {}  # time.monotonic() of each shape's plan
        self._replan_note = ""
        self.replanned: list[Replanned] = []  # shapes whose plan changed after a correction

    @property
    def config(self):
        return self.model.config

    @property
    def plan(self) -> Plan:
        return self.executor.plan

    @property
    def generation_config(self):
        return self.model.generation_config

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # inputs go to the host: the embedding lookup runs there

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def estimator_inputs(self) -> tuple[ModelSpec, Hardware, Any] | None:
        """What the planner prices this model with: (its ModelSpec, the Hardware, the factors at the
        memory state of now, with the online corrections where this model learns them); None where
        the machine has no hardware model (a fixed plan then runs unpriced)."""
        hardware = self._planner_args.get("hardware")
        if hardware is None:
            return None
        try:
            hw = hardware if isinstance(hardware, Hardware) else get_hardware(str(hardware))
            return self.executor.spec, hw, _efficiency_now(hw, self.online_correction)
        except FlexplanError:  # no hardware model for this machine: nothing to price with
            return None

    def plan_for(self, batch_size: int, input_len: int, output_len: int) -> Plan:
        """The plan for one request shape (planned once per shape; priced again once it is more
        than :data:`PLAN_STATE_MAX_AGE_S` old where it was scaled to the memory state of its time:
        a long-running process predicts for the state of now, not of its first call)."""
        key = (int(batch_size), int(input_len), int(output_len))
        old_plan = self._plans.get(key)
        if old_plan is not None and _state_scaled(old_plan) and \
                time.monotonic() - self._planned_at.get(key, 0.0) > PLAN_STATE_MAX_AGE_S:
            self._planned_at[key] = time.monotonic()
            self._plans[key] = self._repriced(old_plan, key)
        if key not in self._plans:
            self._planned_at[key] = time.monotonic()
            new = self._plans[key] = _make_plan(self._plan_spec, self.model.config, batch_size=key[0],
                                                input_len=key[1], output_len=key[2], **self._planner_args)
            old = self._stale_plans.pop(key, None)
            if old is not None and _choice(old) != _choice(new):
                self.replanned.append(Replanned(key, _choice(old), _choice(new), new.calibration))
                self._replan_note = self.replanned[-1].describe()
        return self._plans[key]

    def refresh_state(self) -> None:
        """Probe the memory state afresh and price every state-scaled plan again at its next call,
        whatever its age: for a caller about to time a call (``flexplan run`` after its warm-up:
        the plan-time probe was taken before the model loaded, seconds earlier, and the memory
        state can flip within such a gap). A fixed plan (``plan=`` a Plan) is priced again now, the
        same choice, where it was state-scaled. Costs one probe (and a plan for a fixed one)."""

        refresh()
        for key in self._planned_at:
            self._planned_at[key] = -math.inf
        plan = self.executor.plan
        if not self._auto and _state_scaled(plan):
            self.executor.place(self._repriced(plan, (plan.batch_size, plan.input_len, plan.output_len)))

    def _repriced(self, old: Plan, key: tuple[int, int, int]) -> Plan:
        """``old``'s choice (policies, GPU layers, CPU dtype) priced again at the memory state of
        now: the predictions follow the state, the placement does not flip with it (a new CPU
        dtype or M would move every weight; only corrections re-choose, ``_learn``). ``old`` as it
        was where its phases hold different M (plan() forces one) or the re-pricing fails."""
        if old.prefill.gpu_layers != old.decode.gpu_layers:
            return old
        spec = dict(self._plan_spec) if isinstance(self._plan_spec, dict) else {}
        spec.update(prefill=old.prefill.policy, decode=old.decode.policy, cpu_dtype=old.cpu_dtype,
                    gpu_layers=old.decode.gpu_layers)
        try:
            return _make_plan(spec, self.model.config, batch_size=key[0], input_len=key[1], output_len=key[2],
                              **self._planner_args)
        except FlexplanError:
            return old

    def _request_shape(self, inputs, generation_config, kwargs) -> tuple[int, int, int, int]:
        check_generate_arguments(self.model, inputs, kwargs)
        x = inputs if inputs is not None else kwargs.get("input_ids")
        x = x if x is not None else kwargs.get("inputs_embeds")
        batch, input_len = int(x.shape[0]), int(x.shape[1])
        gc = generation_config or self.model.generation_config
        max_new = kwargs.get("max_new_tokens")
        if max_new is None and kwargs.get("max_length") is not None:
            max_new = kwargs["max_length"] - input_len
        if max_new is None:
            max_new = gc.max_new_tokens if gc.max_new_tokens is not None else gc.max_length - input_len
        beams = kwargs.get("num_beams", gc.num_beams) or 1
        seqs = kwargs.get("num_return_sequences", gc.num_return_sequences) or 1
        return batch, batch * max(int(beams), int(seqs)), input_len, max(int(max_new), 1)

    def __repr__(self) -> str:
        p = self.executor.placement
        return f"FlexModel({self.config.model_type}, {p.describe()}, accelerator={self.executor.link.name})"

    def generate(self, inputs=None, generation_config=None, *args, **kwargs):
        """transformers' ``generate`` (same arguments, same return value), run under the plan;
        fills ``last_stats``."""
        self.compute_thread.check("FlexModel.generate()")
        batch, eff_batch, input_len, max_new = self._request_shape(inputs, generation_config, kwargs)
        if not str(self.executor.link.name).startswith("cuda"):  # every KV byte is in host memory
            check_kv_fits_host(self.executor.spec, eff_batch, input_len + max_new,
                               DTYPE_BYTES[self.plan.cpu_dtype], _host_memory_bytes("MemTotal"))
        if self._auto:
            self.executor.place(self.plan_for(eff_batch, input_len, max_new))
        use_cache = kwargs.get("use_cache", (generation_config or self.model.generation_config).use_cache)
        if cache_in(kwargs) is None and use_cache is not False:
            kwargs[CACHE_KWARG] = self.executor.new_cache(eff_batch, input_len + max_new, input_len)
        allocations_before = dict(self.executor.link.allocations)
        busy_before = _cpu_seconds()
        self.executor.begin_run()
        t0 = time.perf_counter()
        try:
            # a plain greedy request decoded natively: flexplan's loop, not transformers' (greedy_decode)
            plain = (greedy_decode.plain_greedy(self.model, inputs, generation_config, kwargs)
                     if self.executor.decodes_natively and not args else None)
            out = (greedy_decode.generate(self.model, inputs, plain, kwargs) if plain is not None
                   else self.model.generate(inputs, generation_config, *args, **kwargs))
        finally:
            self.executor.end_run()
        t1 = time.perf_counter()
        seqs = out if isinstance(out, torch.Tensor) else out.sequences
        self.last_stats = collect(self.executor, t0, t1, eff_batch, input_len, int(seqs.shape[1]) - input_len,
                                  allocations_before, cpu_threads_source=self.cpu_threads_source)
        self.last_stats.other_processes_cpu_share = _other_share(busy_before, _cpu_seconds(), t1 - t0,
                                                                 os.cpu_count() or 1)
        if self.online_correction:
            self._learn()
        return out

    def _learn(self) -> None:
        """Feed ``last_stats`` to the online correction (local hardware only); when the
        corrections change, plans are made again at their next use."""

        stats, note, self._replan_note = self.last_stats, self._replan_note, ""
        # the first run after placing the weights holds one-time costs (CUDA kernels loaded at first
        # launch, allocator growth, oneDNN primitives): learned from, they would teach a slowdown
        # (the link's, say) that the next runs do not have
        skip = "the first run after placing the weights (one-time costs)" if self.executor.runs_since_place == 1 else ""
        try:
            hardware = self._planner_args.get("hardware")
            base = _efficiency_now(hardware, online_correction=False) if hardware is not None else None
            learned = learn(stats, self.executor.spec, hardware, skip, base=base)
        except (FlexplanError, OSError, ValueError, KeyError) as e:
            warnings.warn(f"online correction skipped for this run ({type(e).__name__}: {e})", stacklevel=3)
            return
        if learned is None:
            return
        if learned.changed:
            self._stale_plans.update(self._plans)
            self._plans.clear()
        stats.correction = "; ".join(x for x in (learned.describe(), note) if x)


def _make_plan(plan: Any, config, *, accelerator: str | None, hardware: Any, dtype: str, cpu_dtype: str,
               gpu_memory_bytes: int | None, batch_size: int, input_len: int, output_len: int,
               online_correction: bool = True, routing_profile: Any = None, cpu_dtype_from: str | None = None,
               planned_model: Any = None, weights: str | None = None) -> Plan:
    """A Plan from "auto", a Plan or a dict of overrides, for what exists. Policies forced with
    per-phase M, or while the planner has no hardware model, give a fixed plan (no estimate).
    ``online_correction=False``: planned on the calibration alone, without the runs' corrections.
    ``cpu_dtype_from``: which argument of ``load`` gave ``cpu_dtype`` ("cpu_dtype", or "dtype": an
    explicit dtype holds on the CPU too); None: the CPU's own, and the planner may choose float32.
    In a dict of overrides, its "cpu_dtype" wins, then load's ``cpu_dtype``, then its "dtype".
    ``planned_model`` (a GGUF path, a folder) and ``weights``: what the planner prices the weights
    from where the model holds blocks (planner.plan's ``weights``)."""
    if isinstance(plan, Plan):
        return plan
    shape = dict(batch_size=batch_size, input_len=input_len, output_len=output_len)
    overrides: dict[str, Any] = {}
    if isinstance(plan, dict):
        check_overrides(plan)
        overrides = dict(plan)
        for k in ("batch_size", "input_len", "output_len"):
            shape[k] = overrides.pop(k, shape[k])
        if "dtype" in overrides:
            dtype = canonical_dtype(overrides.pop("dtype"))
            if cpu_dtype_from != "cpu_dtype":
                cpu_dtype, cpu_dtype_from = dtype, "dtype"
        if "cpu_dtype" in overrides:
            cpu_dtype, cpu_dtype_from = canonical_dtype(overrides.pop("cpu_dtype")), "cpu_dtype"
    elif plan != "auto":
        raise InvalidInputError(f"plan must be 'auto', a flexplan.Plan or a dict of overrides, got {plan!r}")
    if accelerator is None:  # nothing to plan: the CPU computes everything
        bad = {k: v for k, v in overrides.items() if k in ("prefill", "decode") and _uses_accelerator(v)}
        if bad:
            raise DeviceUnavailableError(
                f"plan overrides {bad} need an accelerator but CUDA is not available; use plan='auto', "
                "'cpu' for both phases, or accelerator='cpu' to run them on the CPU stand-in")
        overrides.update(prefill="cpu", decode="cpu")
    forced = overrides.get("prefill") and overrides.get("decode")
    per_phase_m = "prefill_gpu_layers" in overrides or "decode_gpu_layers" in overrides
    if forced and (per_phase_m or hardware is None or not _planner_available()):
        return fixed_plan(config, overrides["prefill"], overrides["decode"], overrides.get("gpu_layers"),
                          prefill_gpu_layers=overrides.get("prefill_gpu_layers"),
                          decode_gpu_layers=overrides.get("decode_gpu_layers"), dtype=dtype, cpu_dtype=cpu_dtype,
                          gpu_memory_bytes=gpu_memory_bytes or 0, hardware=str(getattr(hardware, "name", hardware)),
                          **shape)
    if per_phase_m:
        raise InvalidInputError("prefill_gpu_layers / decode_gpu_layers need both 'prefill' and 'decode' policies")
    forced_cpu_dtype = cpu_dtype if cpu_dtype_from else None
    if cpu_dtype_from == "dtype":  # the caller's dtype on the CPU: where it cannot be planned, say what to pass
        hw = hardware if isinstance(hardware, Hardware) else _hardware_or_none(hardware)
        if hw is not None and hw.cpu.peak_flops_per_s.get(cpu_dtype, 0) <= 0:
            usable = ", ".join(d for d, f in hw.cpu.peak_flops_per_s.items() if f > 0)
            raise InvalidInputError(
                f"dtype={dtype!r} holds on the CPU too, but {hw.cpu.name} has no {cpu_dtype} figure to plan its part "
                f"with; pass cpu_dtype= one of {usable} for the part the CPU computes")

    hardware = hardware if hardware is not None else "local"
    return plan_fn(planned_model if planned_model is not None else config, hardware=hardware, dtype=dtype,
                   gpu_memory_bytes=gpu_memory_bytes if accelerator else None, prefill=overrides.get("prefill"),
                   decode=overrides.get("decode"), gpu_layers=overrides.get("gpu_layers"),
                   cpu_dtype=forced_cpu_dtype, efficiency=_efficiency_now(hardware, online_correction),
                   routing_profile=routing_profile, weights=weights, **shape)


def _efficiency_now(hardware: Any, online_correction: bool = True):
    """The factors ``hardware`` plans with at the memory state of now (a probe: ``measure.state``),
    with the online corrections or, ``online_correction=False``, without."""
    eff = efficiency_now(hardware if isinstance(hardware, Hardware) else get_hardware(str(hardware)))
    return eff if online_correction else uncorrected(eff)


def _checkpoint_dtype(model_or_path, config) -> str | None:
    """The dtype of the model's weights: a loaded model's parameters', else the config's
    ``dtype`` (``torch_dtype`` before transformers 5); None when neither says."""
    if isinstance(model_or_path, nn.Module):
        p = next(iter(model_or_path.parameters()), None)
        found = None if p is None else p.dtype
    else:
        found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    try:
        return canonical_dtype(str(found)) if found is not None else None
    except InvalidInputError:  # e.g. a quantised or unusual dtype: treat as unknown
        return None


def _uses_accelerator(policy: str) -> bool:
    """Whether a registered policy computes anything on an accelerator (asked of its placement rule)."""

    pol = REGISTRY[policy]
    return any(pol.placement(2, int(m), ph).uses_accelerator for m in pol.gpu_layer_options(2) for ph in ("prefill", "decode"))


def _hardware_or_none(hardware: Any) -> Hardware | None:
    """The Hardware ``hardware`` names ("local" where None), or None where it cannot be described."""
    try:
        return get_hardware(str(hardware if hardware is not None else "local"))
    except Exception:  # noqa: BLE001 - no hardware model: the planner says so itself
        return None


def _planner_available() -> bool:
    try:
        get_hardware("local")
        return True
    except Exception:  # noqa: BLE001 - no hardware model: placements must be given in full
        return False


def load(model_or_path, plan: Any = "auto", accelerator: str | None = None, hardware: Any = "local",
         dtype: str | None = None, gpu_memory_bytes: int | None = None,
         pinned_memory_budget_bytes: int | None = None, cpu_linear_kernel: str | None = None,
         cpu_threads: int | None = None, online_correction: bool = True, routing_profile: Any = None,
         cpu_dtype: str | None = None, keep_model: bool = True, weights: str | None = None) -> FlexModel:
    """Load (or take over) a decoder-only transformers causal LM and run it under a plan.

    ``model_or_path``: a folder with config.json + *.safetensors (streamed tensor by tensor into
    place), or a loaded ``*ForCausalLM``: it is left as it was and usable (the executor runs a module
    tree of its own, filled from its tensors without writing to them), so the same model may be
    loaded again under another plan; host memory then holds its weights and the placed copies while
    the caller keeps it (a folder streams without that first copy). ``keep_model=False`` hands the
    model over instead: its own modules and Parameters are re-placed, unit by unit (peak memory near
    the placed size, not the model's plus it), it then runs only through the returned FlexModel, and
    loading it again is refused with an error that says what to pass. ``plan``: "auto" (planned per
    request shape), a Plan, or overrides such as ``{"prefill": "splitgen", "decode": "cpu",
    "gpu_layers": 4}``. ``dtype``: what the weights are held and computed in, on every device,
    unless ``cpu_dtype`` gives the CPU's part its own (e.g. ``dtype="bfloat16", cpu_dtype="float32"``);
    default: bfloat16 (float16 without it) on CUDA, the CPU's own on the stand-in, the checkpoint's
    on the CPU alone, with the CPU's dtype left to the planner. ``cpu_dtype``: what the CPU's part
    is held and computed in (a plan dict's "cpu_dtype" wins over it). A Plan carries both dtypes
    itself. ``accelerator``: "cuda", "cpu" (the CPU stands in for the GPU, every path runs) or None
    (CUDA if available, else the CPU alone). ``gpu_memory_bytes``: accelerator budget (default: free
    CUDA memory; the stand-in: a quarter of available host memory). ``pinned_memory_budget_bytes``:
    bound on pinned host memory (default: half of physical memory). ``cpu_linear_kernel``: how the
    CPU computes its linears: ``"flexplan-blocked"`` (default where flexplan's native kernel builds:
    float32 weights blocked once for it, the rest as below), ``"onednn-packed"`` (default otherwise:
    weights reordered once for oneDNN) or ``"F.linear"`` (stock kernel, bit-identical to
    transformers in fp32 too). Packed kernels read decode weights near memory bandwidth
    (cpu_linear).
    ``cpu_threads``: intra-op threads of the CPU side (default: the count ``flexplan calibrate``
    found fastest on this machine, else all usable cores); ``last_stats`` says which.
    ``online_correction``: learn from each run's measured TTFT/TPOT and re-plan with the corrected
    predictions (local hardware only; ``calibration/correction.py``); False: neither learn nor
    plan with corrections. ``FLEXPLAN_ONLINE_CORRECTION=0`` turns it off for every model.
    ``routing_profile``: a RoutingProfile or its file (``flexplan profile-experts``): plans of a MoE
    model price cpu-experts from it and keep the most-used CPU experts on the accelerator (plan_expert_cache).
    ``weights``: for a ``.gguf`` path, "gguf" (default: its own blocks) or "float32" (dequantised);
    for a model folder, "float32" (default: not quantised) or "int4" / "int8" (its linears quantised
    at load to group-wise blocks). Blocks run under any plan: the CPU's kernels read them, pinned
    memory and the link hold and carry them, the accelerator dequantises them per call; plans
    price their bytes. The rule is ``flexplan.quant.sources.weights_source``'s, shared with the serving engine.
    """
    gguf_tokenizer, blocks_spec = None, None
    source = weights_source(model_or_path, weights)  # which loader (quant.sources: shared with the serving engine)
    if source.blocks:
        # a GGUF file's own blocks, or a float checkpoint quantised at load to int4 / int8 (issue 40):
        # its linears hold blocks under any plan (the CPU's kernels read them, the link carries them
        # and the accelerator dequantises them), planned from its header / config as stored
        blocks_spec = str(model_or_path)
        model_or_path, gguf_tokenizer = source.load()
        keep_model = False
    elif source.kind == GGUF_FLOAT32:  # every weight dequantised: any plan
        model_or_path, gguf_tokenizer = source.load()
        keep_model = False
    check_load_arguments(model_or_path, accelerator, dtype, gpu_memory_bytes, pinned_memory_budget_bytes, cpu_threads,
                         hardware)
    if not isinstance(online_correction, bool):
        raise InvalidInputError(f"online_correction must be True or False, got {online_correction!r}")
    if not isinstance(keep_model, bool):
        raise InvalidInputError(f"keep_model must be True (the model passed in is left as it was) or False "
                                f"(handed over to flexplan), got {keep_model!r}")
    acc = _resolve_accelerator(accelerator)
    from_path = isinstance(model_or_path, (str, os.PathLike))
    if from_path:
        if not is_model_folder(model_or_path):
            raise InvalidInputError(
                f"{model_or_path} is not a model folder with config.json and *.safetensors shards; pass such a "
                "folder or a loaded transformers model")
        config = read_config(model_or_path)
    else:
        config = getattr(refuse_placed_tree(model_or_path), "config", None)
    check_supported(config)
    check_plan_argument(plan, int(getattr(config, "num_hidden_layers")))
    gpu_memory_bytes = None if gpu_memory_bytes is None else int(gpu_memory_bytes)
    local_dtype = local_cpu_dtype()
    cpu_dtype_from = None  # an explicit dtype holds on the CPU too, unless cpu_dtype is given
    if cpu_dtype is not None:
        try:
            cpu_dtype, cpu_dtype_from = canonical_dtype(cpu_dtype), "cpu_dtype"
        except InvalidInputError as e:
            raise InvalidInputError(f"cpu_dtype: {e}") from None
    if dtype:
        dtype = canonical_dtype(dtype)
        if cpu_dtype_from is None:
            cpu_dtype, cpu_dtype_from = dtype, "dtype"
    elif acc and acc.startswith("cuda"):
        dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    elif acc is None:  # the CPU alone: the weights keep their own dtype where the CPU can read it as is
        dtype = _checkpoint_dtype(model_or_path, config) or local_dtype  # (spec.cpu_weight_dtype)
    else:
        dtype = local_dtype
    if cpu_dtype_from is None:
        cpu_dtype = local_dtype
    if acc == "cpu" and gpu_memory_bytes is None:
        gpu_memory_bytes = _host_memory_bytes() // 4
    elif acc and acc.startswith("cuda") and gpu_memory_bytes is None:
        gpu_memory_bytes = int(torch.cuda.mem_get_info(torch.device(acc))[0])
    if pinned_memory_budget_bytes is None:
        pinned_memory_budget_bytes = _host_memory_bytes("MemTotal") // 2
    hw = hardware
    if acc == "cpu" and not (isinstance(hardware, Hardware) and hardware.has_gpu):
        hw = _lazy_standin(standin_hardware, gpu_memory_bytes, hardware if isinstance(hardware, Hardware) else None)
    planner_args = dict(accelerator=acc, hardware=hw, dtype=dtype, cpu_dtype=cpu_dtype, gpu_memory_bytes=gpu_memory_bytes,
                        online_correction=online_correction, cpu_dtype_from=cpu_dtype_from)
    if blocks_spec is not None:  # plans price the blocks the model holds (planner: weights=)
        planner_args.update(planned_model=blocks_spec, weights=source.planned_weights)
    if routing_profile is not None:  # read and checked once, not at every re-plan

        planner_args["routing_profile"] = resolve_profile(routing_profile, ModelSpec.from_config(config))
    refresh()  # plans made now use the host memory state of now (calibration/memory_state.py)
    p = _make_plan(plan, config, **planner_args, **DEFAULT_SHAPE)
    n = int(getattr(config, "num_hidden_layers"))
    require_accelerator(placement_of(p, n), acc is not None, torch.version.cuda is not None)
    link = Link(acc or "cpu")
    budget = gpu_memory_bytes if acc else None
    cores, threads_source = _cpu_threads(cpu_threads)
    if from_path:
        model = load_streaming(model_or_path, p, link, gpu_memory_bytes=budget,
                               pinned_memory_budget_bytes=pinned_memory_budget_bytes, cpu_cores=cores,
                               cpu_linear_kernel=cpu_linear_kernel)
        executor = model.flexplan_executor
        tokenizer = _tokenizer(model_or_path)
    else:
        # the executor's own module tree over the caller's tensors: placing, packing and hooks leave
        # the caller's model as it was, and a second load of it (another plan) starts from it again
        # (keep_model=False: handed over, the executor re-places the caller's own modules, freeing its
        # tensors unit by unit)
        model = own_module_tree(model_or_path) if keep_model else model_or_path
        executor = Executor(model, p, link, accelerator_budget_bytes=budget,
                            pinned_budget_bytes=pinned_memory_budget_bytes, cpu_cores=cores,
                            cpu_linear_kernel=cpu_linear_kernel)
        model.flexplan_executor = executor
        tokenizer = gguf_tokenizer
    return FlexModel(model, executor, tokenizer=tokenizer, plan_spec=plan, planner_args=planner_args,
                     cpu_threads_source=threads_source, online_correction=online_correction)


def _cpu_threads(requested: int | None) -> tuple[int | None, str]:
    """(CPU threads for the executor, why): the caller's, else the calibrated best, else all
    usable cores (None lets cpu_backend.configure count them)."""
    if requested is not None:
        return int(requested), "given by the caller"
    threads, why_not = calibrated_cpu_threads()
    if threads is not None:
        return threads, why_not
    return local_cpu_cores(), f"all usable cores ({why_not})"


def _lazy_standin(make, gpu_memory_bytes: int, base=None):
    """The stand-in Hardware when the local CPU can be described; else None (plans must then be
    given in full, checked when planning)."""
    try:
        return make(int(gpu_memory_bytes), base=base)
    except Exception:  # noqa: BLE001 - no hardware model yet: fixed plans still run
        return None


__all__ = ["FlexModel", "Replanned", "load"]
