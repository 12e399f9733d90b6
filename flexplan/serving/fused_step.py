"""One iteration of a Llama-style model over a ragged batch in flexplan's native layer calls.

The model runner's general path runs transformers' forward: per decoder layer a few dozen small
PyTorch ops dispatched from Python besides the GEMVs: on a small model, as costly as reading its
weights. For a model whose every decoder layer the native layer calls
cover (:func:`flexplan.executor.cpu_decode.covered_layer`: pre-norm residual blocks, q/k/v/o
projections, rotate-half rotary, SwiGLU MLP or Qwen3-MoE's / Mixtral's / Qwen2-MoE's routed experts on GGUF blocks,
RMSNorm) with blocked weights on the CPU or a GGUF
file's blocks that flexplan's kernels read, an iteration here is, per layer, four calls whatever
the batch:

- ``layer_pre_attention``: RMSNorm, the q/k/v GEMVs over every token of the batch (the weights
  read once for all rows), rotary at each token's own position;
- the new K/V written into the requests' blocks (:meth:`ModelRunner.write`);
- attention per request against its own blocks (:meth:`ModelRunner.attention`: the paged kernel
  for decodes in a CPU pool, SDPA for prefill chunks, exactly as the general path attends);
- ``layer_post_attention``: o GEMV + residual, RMSNorm, gate/up GEMVs, SiLU * up, down GEMV +
  residual.

The embedding, final norm and head are the model's own modules (the head on the kept rows only).
What differs from the general path is only the norms', rotary's and SiLU's float32 arithmetic
(native_decode.c, within an ulp or two of PyTorch's); the GEMVs are the same kernel.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import nn

from flexplan.executor import cpu_decode, native
from flexplan.executor.rebinds import rebinds
from flexplan.serving import paged_attention
from flexplan.serving.ragged_batch import RaggedBatch

# a decode-only iteration in one native call for all the layers (paged_stack.c, beside the layer ops
# it calls: the native decode sources and the paged attention kernel)
STACK_SOURCES = (*native.DECODE_SOURCES, Path(__file__).with_name("paged_attention.c"),
                 Path(__file__).with_name("paged_stack.c"))


class PagedDecodeStack:
    """The loaded ``flexplan_paged_decode_stack_f32`` and ``_bf16`` (paged_stack.c), by pool dtype."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn = {}
        for dtype, suffix in paged_attention.KV_DTYPES.items():
            fn = getattr(lib, f"flexplan_paged_decode_stack_{suffix}")
            fn.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, i64, ptr, ptr] + [i64] * 6 + [ptr] * 13
            fn.restype = ctypes.c_int
            self._fn[dtype] = fn
        self._lib = lib

    def __call__(self, layers, n: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                 kv_len: torch.Tensor, kv_lo: torch.Tensor, bs: int, dims: tuple[int, ...], scales,
                 cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor, s: dict[str, torch.Tensor]) -> None:
        hidden, _, hq, hk, d = dims
        rc = self._fn[k.dtype](layers, n, k.data_ptr(), v.data_ptr(), k.stride(0), slots.data_ptr(), tables.data_ptr(),
                      tables.shape[1], kv_len.data_ptr(), kv_lo.data_ptr(), bs, x.shape[0], hidden, hq, hk, d,
                      scales, cos.data_ptr(), sin.data_ptr(), x.data_ptr(),
                      *(s[n].data_ptr() for n in ("y", "xn", "tmp", "q", "attn", "k", "v", "g", "u")))
        if rc:
            raise MemoryError(f"paged decode stack: out of memory for {x.shape[0]} requests' attention partials "
                              "or quantised activations")


@functools.cache
def stack_status() -> tuple[PagedDecodeStack | None, str]:
    """(the paged decode stack or None, a one-line reason). Its parts are each checked by their
    own libraries (native.decode_status, paged_attention.status); the whole is tested against the
    per-layer path (tests/test_serving_engine.py)."""
    if native.decode_status()[0] is None:
        return None, native.decode_status()[1]
    if paged_attention.status()[0] is None:
        return None, paged_attention.status()[1]
    return native._load("native paged decode stack", "paged_stack", STACK_SOURCES, PagedDecodeStack, lambda lib: None)


@functools.cache
def _head_forwards() -> tuple:
    """Causal-LM forwards whose logits are ``lm_head(hidden)`` and nothing else at inference:
    Llama's, and the MoE models' the native layers cover (Qwen3-MoE's, Mixtral's, Qwen2-MoE's: their router
    loss only where router logits are asked for, which this step never is)."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM
    from transformers.models.mixtral.modeling_mixtral import MixtralForCausalLM
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM

    return (LlamaForCausalLM.forward, Qwen3MoeForCausalLM.forward, MixtralForCausalLM.forward,
            Qwen2MoeForCausalLM.forward)


def _window(attn: nn.Module) -> int | None:
    """The sliding window the module's own forward passes to its attention function: its
    attribute (Qwen2), its config's (Mistral: the forward reads ``config.sliding_window``), or none
    (Llama's forward names no window)."""
    if "sliding_window" in attn.__dict__:
        return attn.sliding_window
    code = cpu_decode._code(type(attn).forward)
    if "sliding_window" in code.co_names + code.co_consts:  # config.sliding_window, or getattr(config, "...")
        return getattr(attn.config, "sliding_window", None)
    return None


class FusedStep:
    """The native per-layer iteration of ``model`` (see the module's docstring); build it with
    :meth:`for_model`, which says None where the model is not covered."""

    def __init__(self, model: nn.Module, layers: list[cpu_decode.FusedLayer], ops: native.NativeDecode):
        self.model, self.stack, self.layers, self.ops = model, model.model, layers, ops
        self.windows = [_window(f.attn) for f in layers]
        self.iterations = 0  # iterations run by the native calls
        self.stack_iterations = 0  # ... of which decode-only ones in one call for all the layers
        n = len(layers)
        self._weight_ptrs = (ctypes.POINTER(native.LayerWeights) * n)(*(ctypes.pointer(f.weights) for f in layers))
        self._in_order = [f.attn.layer_idx for f in layers] == list(range(n))  # pool layer l is decoder layer l
        self._scales = (ctypes.c_float * n)(*(float(f.attn.scaling) for f in layers))  # as FusedLayer fills w.scale
        self._ready: tuple[int, bool] | None = None  # (rebinds count, ready) of the last check

    @classmethod
    def for_model(cls, model: nn.Module) -> FusedStep | None:
        """A FusedStep over ``model`` when its head's forward is Llama's (no logit soft-capping or
        scaling of its own), its stack is covered and every decoder layer is, else None."""
        ops = native.decode_status()[0]
        stack = getattr(model, "model", None)
        layers = getattr(stack, "layers", None)
        if (ops is None or layers is None or len(layers) == 0 or not cpu_decode._is_linear(getattr(model, "lm_head", None))
                or not any(cpu_decode._same_code(type(model).forward, f) for f in _head_forwards())
                or not cpu_decode.covered_stack(stack) or not all(cpu_decode.covered_layer(x) for x in layers)):
            return None
        return cls(model, [cpu_decode.FusedLayer(x, ops) for x in layers], ops)

    def ready(self) -> bool:
        """Whether every layer's weights are blocked on the CPU in one dtype the native GEMV reads,
        all with the same sizes: checked again only after a parameter was pointed at other storage
        (:mod:`rebinds`: an executor moving weights, a packing), not every iteration (every
        layer's checks, in Python, each iteration)."""
        count = rebinds()
        if self._ready is None or self._ready[0] != count:
            self._ready = (count, all(f._fill() for f in self.layers) and len({f.dims() for f in self.layers}) == 1)
        return self._ready[1]

    def hidden(self, runner, batch: RaggedBatch) -> torch.Tensor | None:
        """The final norm's output [T, hidden] for the batch's tokens (K/V written into the pools
        on the way), or None where this iteration is not one the native calls take."""
        ids = torch.tensor(batch.ids, dtype=torch.long)
        x = self.stack.embed_tokens(ids)
        if not cpu_decode._cpu_f32(x):
            return None
        positions = torch.tensor([batch.positions], dtype=torch.long)
        cos, sin = self.stack.rotary_emb(x.unsqueeze(0), positions)
        first = self.layers[0]
        d = first.head_dim
        if not (cpu_decode._cpu_f32(cos, sin) and cos.shape[-1] == d):
            return None
        cos, sin = (t.reshape(-1, d).contiguous() for t in (cos, sin))
        t = x.shape[0]
        s = cpu_decode._scratch({}, first.weights, t)  # per call: sub-batches may run at once on threads
        x = x.contiguous()
        if self._stacked(batch, x, cos, sin, s):
            return self.stack.norm(x.unsqueeze(0))[0]
        y = torch.empty_like(x)
        w0 = first.weights
        q4 = s["q"].view(1, t, w0.hq, d).transpose(1, 2)  # the [1, heads, T, d] views transformers' layers pass
        k4 = s["k"].view(1, t, w0.hk, d).transpose(1, 2)
        v4 = s["v"].view(1, t, w0.hk, d).transpose(1, 2)
        for i, f in enumerate(self.layers):
            w, attn = f.weights, f.attn
            self.ops.layer_pre_attention(w, x, cos, sin, s["xn"], s["q"], s["k"], s["v"])
            runner.write(batch, attn.layer_idx, k4, v4)
            out, _ = runner.attention(batch, attn, q4, scaling=w.scale, sliding_window=self.windows[i])
            s["attn"].copy_(out.reshape(t, w.hq * d))
            self.ops.layer_post_attention(w, x, y, s["q"], None, None, None, s)
            x, y = y, x
        return self.stack.norm(x.unsqueeze(0))[0]

    def _stacked(self, batch: RaggedBatch, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 s: dict[str, torch.Tensor]) -> bool:
        """A decode-only iteration of one CPU pool of float32 or bfloat16 K/V without sliding windows,
        in one native call for all the layers (x becomes the last layer's output); False where it is
        not one (the per-layer calls run it)."""
        if len(batch.groups) != 1 or not self._in_order or any(self.windows):
            return False
        g = batch.groups[0]
        pool = g.pool
        if not (g.decode and pool.device.type == "cpu" and pool.k_slots.dtype in paged_attention.KV_DTYPES
                and pool.v_slots.dtype == pool.k_slots.dtype and pool.k_slots.is_contiguous()
                and pool.v_slots.is_contiguous()
                and tuple(pool.k_slots.shape[2:]) == (self.layers[0].weights.hk, self.layers[0].head_dim)
                and pool.v_slots.shape == pool.k_slots.shape):
            return False
        ops = stack_status()[0]
        if ops is None:
            return False
        _, slots = batch.writes[next(iter(batch.writes))]
        n = len(self.layers)
        s["y"] = torch.empty_like(x)
        # the group's rows are the batch's tokens in order (one decode each), as the writes are
        ops(self._weight_ptrs, n, pool.k_slots, pool.v_slots, slots.contiguous(), g.tables.contiguous(),
            g.kv_len.contiguous(), g.kv_lo(None), pool.block_size_tokens, self.layers[0].dims(), self._scales, cos, sin,
            x, s)
        self.stack_iterations += 1
        return True

    def logits(self, runner, batch: RaggedBatch) -> torch.Tensor | None:
        """The kept rows' next-token logits [len(keep), vocab], or None (the general path runs)."""
        if not self.ready():
            return None
        h = self.hidden(runner, batch)
        if h is None:
            return None
        self.iterations += 1
        return self.model.lm_head(h.index_select(0, torch.tensor(batch.keep, dtype=torch.long)))
