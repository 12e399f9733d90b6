"""One iteration of a transformers causal LM over a ragged batch, its KV in paged pools.

Every request's new tokens of the iteration (a prefill chunk, or the one token of a decode) are
flattened into ONE sequence of T tokens with per-token ``position_ids``, so the linear layers read
their weights once for the whole batch. Two things make the model attend per request instead of
across the flattened sequence, as transformers' own continuous batching does:

- a :class:`PagedCache` passed as the model's cache: its ``update()`` writes each layer's new K
  and V into the requests' blocks (:mod:`flexplan.serving.kv_blocks`) and hands them back;
- an attention function registered in transformers' ``AttentionInterface`` under :data:`NAME`
  that each attention module's own shallow copy of the config names (the model's config and the
  other modules are untouched): it splits the T queries by request and attends each against its
  own blocks, causal within a chunk, with the module's sliding window, logit soft-capping and
  attention sinks where it has them.

Requests whose KV is in the host pool are attended on the CPU beside it (NEO section 3); those in
the device pool on the pool's device. Decodes in a CPU pool are read where their blocks lie by the
paged kernel (:mod:`paged_attention`); otherwise (prefill chunks, an accelerator pool, a latent
cache, no compiler) each request's past is gathered from its blocks and attended by flexplan's
strided decode kernel (one query, on the CPU) or PyTorch's SDPA, the eager formula where the
module soft-caps its logits or has attention sinks. Outside an iteration of this runner the
function calls the implementation the module had, so the caller's model keeps working;
:meth:`ModelRunner.close` restores each module's config.

Each forward's batch is the running thread's own, so sub-batches may run at once on threads
(:meth:`ModelRunner.forward_async`): NEO's asymmetric pipelining runs the host decodes' forward
beside the rest's, APEX's asynchronous overlap beside the next iteration's.

The model's mask creation is skipped by passing a 4-D placeholder mask (transformers returns a
prepared 4-D mask as it is); the attention function builds each request's mask itself.
"""

from __future__ import annotations

import copy
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from flexplan.errors import UnsupportedModelError
from flexplan.executor import cpu_attention, native
from flexplan.executor.families import CACHE_KWARG
from flexplan.serving import paged_attention
from flexplan.serving.fused_step import FusedStep
from flexplan.serving.kv_blocks import BlockManager, text_config
from flexplan.serving.ragged_batch import Group, RaggedBatch, Segment

NAME = "flexplan_paged"  # the attention implementation the runner's modules name
RUNNER = "_flexplan_paged_runner"  # module attribute: the runner whose iteration it serves
INNER = "_flexplan_paged_inner"  # config attribute: the implementation the module had
_registered = False


class PagedCache(Cache):
    """The model's cache for one iteration: ``update`` writes the new K/V into the pools."""

    is_compileable = False
    kv_by_caller = True  # the executor's fused decode layers do not attend over it (cpu_decode._decode_call)

    def __init__(self, runner: ModelRunner, batch: RaggedBatch, phase: str | None = None):
        self.runner, self.batch = runner, batch  # no layers: the pools are the storage
        self.layers = []
        self.layer_class_to_replicate = None
        self.offloading = False
        # a model placed by flexplan's executor reads the phase here (flexplan.serving.placed): the
        # scheduler's choice where it made one, else the runner's rule
        self.flexplan_phase = phase or (runner.phase_rule(batch) if runner.phase_rule is not None else None)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.runner.write(self.batch, layer_idx, key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0


def _dispatch(module: nn.Module, query, key, value, attention_mask, **kwargs):
    runner = module.__dict__.get(RUNNER)
    batch = runner.batch() if runner is not None else None
    if batch is not None:
        return runner.attention(batch, module, query, **kwargs)
    name = getattr(module.config, INNER, "eager")
    eager = inspect.getmodule(type(module)).__dict__.get("eager_attention_forward")
    inner = eager if name in (None, "eager") else ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)
    return inner(module, query, key, value, attention_mask, **kwargs)


def _names(f) -> tuple[str, ...]:
    """The global and attribute names a function's code uses."""
    return getattr(getattr(inspect.unwrap(f), "__code__", None), "co_names", ())


def _register() -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(NAME, _dispatch)
        _registered = True


def _eager(q, k, v, mask, scale: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax(cap(q k^T * scale) + mask [, sinks]) v as transformers' eager attention: q [N, hq,
    Q, d], k/v [N, hk, K, d] (grouped heads repeated), mask bool [N, 1, Q, K]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap:
        w = torch.tanh(w / softcap) * softcap
    w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
    if sinks is not None:
        w = torch.cat([w, sinks.reshape(1, -1, 1, 1).expand(w.shape[0], -1, w.shape[2], 1).to(w.dtype)], dim=-1)
        w = w - w.max(dim=-1, keepdim=True).values
        w = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)[..., :-1]
    else:
        w = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)


class ModelRunner:
    """Runs iterations of ``model`` over ragged batches whose KV ``blocks`` hold."""

    def __init__(self, model: nn.Module, blocks: BlockManager):
        self.model = model
        self.blocks = blocks
        self.device = next(model.parameters()).device
        self._local = threading.local()  # the batch this thread's forward runs (sub-batches run in threads)
        # forward_async's one thread, kept for the runner's life: a thread per call would start (and
        # end) its own OpenMP pool for every iteration's host sub-batch
        self._side: ThreadPoolExecutor | None = None
        self._placeholder_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(type(model).forward).parameters
        self.modules = self._install()
        self.phase_rule = None  # RaggedBatch -> an executor phase, for a placed model (flexplan.serving.placed)
        # native layer calls for a covered model on the CPU (not a placed one: its executor's hooks place each layer)
        self.fused = FusedStep.for_model(model) if self.device.type == "cpu" else None

    # ---- installing the attention function on the model's attention modules ----
    def _install(self) -> list[nn.Module]:
        _register()
        mods = cpu_attention.attention_modules(self.model)
        if not mods:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} has no attention module that calls transformers' AttentionInterface, "
                "so the serving engine cannot attend per request over paged KV; run it with flexplan.load().generate()")
        reads_length = [type(m).__name__ for m in mods if "get_seq_length" in _names(type(m).forward)]
        if reads_length:
            raise UnsupportedModelError(
                f"{reads_length[0]} reads the cache's length inside its attention (positions of its own): in a "
                "batch of requests flattened into one sequence that length is no request's, so the serving engine "
                "does not run it; use flexplan.load().generate()")
        chunked = "chunked_attention" in (getattr(text_config(self.model.config), "layer_types", None) or ())
        if chunked:
            raise UnsupportedModelError(
                "chunked-attention layers (Llama 4's attention_chunk_size) are not attended per request by the "
                "serving engine yet; use flexplan.load().generate()")
        for m in mods:
            if RUNNER in m.__dict__:
                raise UnsupportedModelError(f"{type(self.model).__name__} is served by another engine already: "
                                            "close() that engine first")
            config = copy.copy(m.config)
            setattr(config, INNER, m.config._attn_implementation)
            config._attn_implementation_internal = NAME  # this copy only
            m.__dict__["_flexplan_paged_config"] = m.config
            m.config = config
            m.__dict__[RUNNER] = self
        return mods

    def close(self) -> None:
        """Give each attention module its own config back (the model is as it was loaded)."""
        if self._side is not None:
            self._side.shutdown(wait=True)
            self._side = None
        for m in self.modules:
            m.__dict__.pop(RUNNER, None)
            original = m.__dict__.pop("_flexplan_paged_config", None)
            if original is not None:
                m.config = original
        self.modules = []

    # ---- one iteration ----
    def batch(self) -> RaggedBatch | None:
        """The batch of the forward this thread runs now (None: the model runs as it was loaded)."""
        return getattr(self._local, "batch", None)

    @torch.inference_mode()
    def forward(self, segments: list[Segment], phase: str | None = None) -> torch.Tensor:
        """The next-token logits (float32, CPU) of the segments that want them, in their order.
        ``phase``: the executor placement a placed model runs them under (None: ``phase_rule``'s)."""
        if not segments:
            return torch.empty(0, self.model.get_output_embeddings().out_features)
        batch = RaggedBatch(segments, self.blocks, self.device)
        if self.fused is not None and self.phase_rule is None:
            logits = self.fused.logits(self, batch)
            if logits is not None:
                return logits.float()
        dev = self.device
        kwargs = {"input_ids": torch.tensor([batch.ids], device=dev),
                  "position_ids": torch.tensor([batch.positions], device=dev),
                  "attention_mask": self._placeholder_mask, "use_cache": True, CACHE_KWARG: PagedCache(self, batch, phase)}
        keep = torch.tensor(batch.keep, dtype=torch.long, device=dev)
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        self._local.batch = batch
        try:
            logits = self.model(**kwargs).logits[0]
        finally:
            self._local.batch = None
        if not self._takes_logits_to_keep:
            logits = logits.index_select(0, keep)
        return logits.float().cpu()

    def forward_async(self, segments: list[Segment], phase: str | None = None) -> PendingForward:
        """:meth:`forward` on a thread of its own (on an accelerator, its own stream, after the
        work queued so far): ``.result()`` waits for the logits. The CPU's attention kernel and
        PyTorch's ops release the GIL, so it runs beside the caller's own forward."""
        if self._side is None:
            self._side = ThreadPoolExecutor(1, thread_name_prefix="flexplan-sub-batch")
        return PendingForward(self, segments, phase, self._side)

    def forward_sub_batches(self, sub_batches: list[list[Segment]], phase: str | None = None) -> torch.Tensor:
        """NEO's asymmetric pipelining: each sub-batch its own forward, all at once (the first on
        the caller's thread, the others by :meth:`forward_async`), so one's attention on the CPU
        beside the host pool overlaps another's kernels on the accelerator; the logits in the
        order of the segments of all sub-batches."""
        parts = [b for b in sub_batches if b]
        pending = [self.forward_async(b, phase) for b in parts[1:]]
        first = self.forward(parts[0] if parts else [], phase)
        return torch.cat([first] + [p.result() for p in pending])



    def write(self, batch: RaggedBatch, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The layer's new K/V ([1, heads, T, dim]) into each token's slot."""
        for name, (tok, slots) in batch.writes.items():
            pool = self.blocks.pools[name]
            for store, states in ((pool.k_slots, key_states), (pool.v_slots, value_states)):
                # a placed model's layer may compute off the runner's device (flexplan.serving.placed)
                new = states[0].transpose(0, 1).index_select(0, tok.to(states.device))  # [n, heads, dim]
                store[layer].index_copy_(0, slots, new.to(pool.device, store.dtype))

    def _past(self, g: Group, module: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's keys and values, [N, heads, maxK, dim] (padded; the mask hides the pad).
        A module that caches a latent (MLA) expands it with its own ``expand_kv``, on its device."""
        n, max_k = g.kv_slots.shape
        flat = g.kv_slots.flatten()
        k, v = (s[layer].index_select(0, flat) for s in (g.pool.k_slots, g.pool.v_slots))
        k = k.view(n, max_k, *k.shape[1:]).transpose(1, 2)  # a strided view: [N, heads, maxK, dim]
        v = v.view(n, max_k, *v.shape[1:]).transpose(1, 2)
        if hasattr(module, "expand_kv"):  # in the module's own dtype (the pool's may be narrower: kv_dtype)
            dtype = next(module.parameters()).dtype
            k, v = module.expand_kv(k.to(self.device, dtype), v.to(self.device, dtype))
        return k, v

    def attention(self, batch: RaggedBatch, module: nn.Module, query: torch.Tensor,
                  **kwargs) -> tuple[torch.Tensor, None]:
        """Each request's queries against its own keys; [1, T, heads, v_dim] as transformers'
        attention functions return."""
        layer = module.layer_idx
        _, hq, t, d = query.shape
        out = None
        scale = kwargs.get("scaling") or getattr(module, "scaling", None) or d ** -0.5
        window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
        sinks = getattr(module, "sinks", None)
        # the groups in the device pool first: their kernels queue on the accelerator and run while the
        # CPU attends beside the host pool (the CPU's queries copied before, so no copy waits on them)
        host_q = {id(g): self._cpu_rows(g, query) for g in batch.groups
                  if g.pool.device.type == "cpu" and query.device.type != "cpu"}
        for g in sorted(batch.groups, key=lambda g: g.pool.device.type == "cpu"):
            q = host_q.get(id(g), query)
            res = None if softcap or sinks is not None else self._decode_paged(g, module, q, layer, window, scale)
            if res is None:
                res = self._attend(g, module, q, layer, window, scale, softcap, sinks)
            if out is None:
                out = query.new_zeros(t, hq, res.shape[-1])
            res = res.transpose(1, 2).to(out.device, out.dtype)  # [N, maxQ, hq, v_dim]
            out.index_copy_(0, g.rows.to(out.device), res[:, 0] if g.decode else res[g.q_valid.to(res.device)])
        return out.unsqueeze(0), None

    @staticmethod
    def _cpu_rows(g: Group, query: torch.Tensor) -> torch.Tensor:
        """A copy of ``query`` on the CPU with the group's rows (the others zero): one device-to-host
        copy of what the host pool's requests need."""
        rows = g.rows
        q = torch.zeros(query.shape, dtype=query.dtype)
        q[:, :, rows.cpu()] = query[:, :, rows].cpu()
        return q

    def _attend(self, g: Group, module: nn.Module, query, layer: int, window, scale: float, softcap,
                sinks) -> torch.Tensor:
        """The group's past gathered, then attended: [N, hq, maxQ, v_dim]."""
        if not g.decode and not (softcap or sinks is not None or hasattr(module, "expand_kv")):
            return self._prefill_each(g, query, layer, window, scale)
        keys, values = self._past(g, module, layer)
        n, max_q = g.q_index.shape
        hq, d = query.shape[1], query.shape[-1]
        rows = g.q_index.flatten().to(query.device)
        q = query[0].index_select(1, rows).view(hq, n, max_q, d).transpose(0, 1).to(keys.device)
        res = None if softcap or sinks is not None else self._decode_native(g, q, keys, values, window, scale)
        if res is None:
            if keys.dtype != q.dtype:  # a pool narrower than the model (kv_dtype): widened for SDPA
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            mask = g.mask(window).to(keys.device)
            if softcap or sinks is not None:
                res = _eager(q, keys, values, mask, scale, softcap, sinks)
            else:
                res = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                                                 enable_gqa=hq != keys.shape[1])
        return res

    @staticmethod
    def _prefill_each(g: Group, query, layer: int, window, scale: float) -> torch.Tensor:
        """A prefill group attended request by request, each on its own keys: [N, hq, maxQ, d].
        Rule: never pad prompts to the group's longest; padded to maxQ x maxK under one mask, a chunk
        of one long prompt beside a few short ones does the long one's work for each. A prompt
        computed from its first token is causal (SDPA's own is_causal, as generate() runs it); a
        chunk after cached or earlier keys gets its lower-right causal mask, and a window narrows
        either."""
        n, max_q = g.q_index.shape
        hq, pool, flat = query.shape[1], g.pool, query[0]
        k_all, v_all = pool.k_slots[layer], pool.v_slots[layer]
        res = query.new_zeros(n, hq, max_q, v_all.shape[-1])
        for r, (q_len, slots, rows, mask) in enumerate(_each_request(g, window, k_all.device)):
            k = k_all.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, hk, k_len, d]
            v = v_all.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            q = flat.index_select(1, rows).unsqueeze(0).to(k.device)  # [1, hq, q_len, d]
            if k.dtype != q.dtype:  # a pool narrower than the model (kv_dtype): widened for SDPA
                k, v = k.to(q.dtype), v.to(q.dtype)
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                             scale=scale, enable_gqa=hq != k.shape[1])
            res[r, :, :q_len] = out[0].to(res.device, res.dtype)
        return res

    def _decode_paged(self, g: Group, module: nn.Module, query, layer: int, window, scale: float):
        """A decode group in a CPU pool by the paged kernel, reading its blocks where they lie:
        [N, hq, 1, d], or None where it does not apply (prefill, an accelerator pool, a latent
        cache, K and V of other widths than the query)."""
        pool = g.pool
        k, v = pool.k_slots[layer], pool.v_slots[layer]
        d = query.shape[-1]
        if not (g.decode and pool.device.type == "cpu" and k.dtype in paged_attention.KV_DTYPES
                and not hasattr(module, "expand_kv") and k.shape[-1] == v.shape[-1] == d and k.stride() == v.stride()):
            return None
        ops = paged_attention.status()[0]
        if ops is None:
            return None
        rows = g.q_index[:, 0].to(query.device)
        q = query[0].index_select(1, rows).transpose(0, 1).to("cpu", torch.float32).contiguous()
        out = ops(q, k, v, g.tables, g.kv_len, g.kv_lo(window), pool.block_size_tokens, float(scale))
        return out.unsqueeze(2).to(query.dtype)

    @staticmethod
    def _decode_native(g: Group, q, keys, values, window, scale: float) -> torch.Tensor | None:
        """One query per request on the CPU by flexplan's native decode kernel: [N, hq, 1, d]."""
        if not (g.decode and q.device.type == "cpu" and keys.dtype in native.ATTENTION_KV_DTYPES
                and keys.shape[-1] == values.shape[-1] == q.shape[-1] and keys.stride() == values.stride()):
            return None
        ops = native.decode_status()[0]
        if ops is None:
            return None
        mask = g.mask(window)[:, 0, 0, :].contiguous()
        n, hq, _, d = q.shape
        out = ops.decode_attention(q.reshape(n, hq, d).to(torch.float32).contiguous(), keys, values, mask, scale)
        return out.view(n, hq, 1, d).to(q.dtype)


def _each_request(g: Group, window, device) -> list:
    """Per request of a prefill group: (its query count, key slots, query rows, and mask or None
    for SDPA's is_causal), made once per iteration and window (every layer reads the same)."""
    key = ("each", window)
    if key not in g.masks:
        each = []
        for r, (q_len, k_len) in enumerate(zip(g.q_valid.sum(1).tolist(), g.kv_len.tolist())):
            start = k_len - q_len  # the first query's position: keys before it are cached or earlier chunks'
            mask = None
            if start or (window and window < k_len):
                i = torch.arange(start, k_len, device=device)[:, None]
                j = torch.arange(k_len, device=device)[None, :]
                mask = (j <= i) & ((j > i - window) if window else True)
            each.append((q_len, g.kv_slots[r, :k_len], g.q_index[r, :q_len], mask))
        g.masks[key] = each
    return g.masks[key]


class PendingForward:
    """A forward running on the runner's side thread (:meth:`ModelRunner.forward_async`)."""

    def __init__(self, runner: ModelRunner, segments: list[Segment], phase: str | None,
                 side: ThreadPoolExecutor):
        self.segments = segments
        dev = runner.device
        stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(dev))  # the swaps queued before it

        def run() -> torch.Tensor:
            if stream is None:
                return runner.forward(segments, phase)
            with torch.cuda.stream(stream):
                return runner.forward(segments, phase)

        self._future = side.submit(run)

    def result(self) -> torch.Tensor:
        """The logits; an exception the forward raised, raised again here, in the caller's thread."""
        return self._future.result()
