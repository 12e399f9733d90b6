"""Architecture of a decoder-only causal LM, normalised from a HuggingFace config.

One :class:`ModelSpec` describes any decoder-only causal LM of transformers 5 whose layers
keep a KV cache: GQA/MQA and MLA attention, explicit ``head_dim`` and separate value-head
widths, QK-norm, biases, Gemma-style post-norms, parallel attention+MLP blocks, attention
sinks, tied embeddings, sliding-window and mixed local/global layers, and mixtures of
experts (routed and shared experts, dense first layers). It counts parameters exactly as
the transformers modules hold them (tests compare with the modules on the meta device).
The config fields are read in :mod:`flexplan.workload.config_fields`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from flexplan.errors import MalformedDataError
from flexplan.workload import weight_formats
from flexplan.workload.config_fields import reject_non_layerwise, spec_fields, text_config


# The families whose decoder layers executor.cpu_decode covers (Llama's q/k/v/o, rotate-half rotary,
# SwiGLU, RMSNorm; Qwen3's QK-norm; Qwen3-MoE's, Mixtral's and Qwen2-MoE's top-k softmax router, whose
# experts on kernel blocks the native layer reads): the executor's native stack runs their whole float32
# decode step on the CPU in one call, priced apart (estimator.phase_costs); tests/test_native_stack_pricing.py
# and tests/test_native_moe_decode.py check this set against what the executor runs
NATIVE_STACK_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe"})
NATIVE_BLOCK_ROWS = 64  # executor.cpu_linear's native block: a float32 linear packs (and the stack runs) only then


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only causal LM, as its transformers modules hold them.

    Layers may differ: ``layer_types[i]`` says whether layer i attends over the whole
    context ("full_attention") or over the last ``sliding_window`` tokens
    ("sliding_attention"); ``moe_layers[i]`` whether its MLP is a mixture of experts.
    Per-layer figures that the estimator multiplies by a layer count
    (``params_per_layer``, ``linear_weight_params_per_layer``) are means over the layers;
    :meth:`layer_params` gives one layer's exact count.
    """

    name: str
    family: str  # HF model_type
    num_layers: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (MoE models without dense layers: the expert width)
    num_heads: int
    num_kv_heads: int
    head_dim: int  # query/key head width (MLA: qk_nope_head_dim + qk_rope_head_dim)
    vocab_size: int
    tie_word_embeddings: bool
    gated_mlp: bool
    norm: str  # "rms" | "layer"
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    learned_pos_embeddings: int = 0  # rows of a learned position table (OPT: max_pos + 2)
    word_embed_proj_dim: int | None = None  # OPT-350m style projection, None when equal to hidden
    norm_affine: bool = True  # OPT's layer_norm_elementwise_affine=False: norms hold no parameters
    final_norm: bool = True  # OPT builds decoder.final_layer_norm only with do_layer_norm_before
    norm_bias: bool | None = None  # a LayerNorm with a bias (Cohere's has none); None: norm == "layer"
    norms_per_layer: int = 2  # 1 for GPT-J / Phi / Cohere parallel blocks, 4 for Gemma 2/3
    qk_norm: str = ""  # "" | "head": q, k norms of head_dim weights | "full": of q_dim, kv_dim | "head_ln": LayerNorms of head_dim
    parallel_block: bool = False  # attention and MLP read the same input (GPT-J, GPT-NeoX, Falcon, Cohere)
    attention_sinks: bool = False  # gpt-oss: one learned sink logit per head
    lm_head_bias: bool = False  # GPT-J, Phi
    v_head_dim: int = 0  # value head width; 0: head_dim
    layer_types: tuple[str, ...] = ()  # per layer; (): all "full_attention"
    sliding_window: int | None = None  # keys a "sliding_attention" layer sees
    attention_chunk_size: int | None = None  # Llama 4 "chunked_attention": queries see their chunk only
    num_experts: int = 0  # routed experts per MoE layer (0: dense model)
    experts_per_token: int = 0  # k: routed experts each token runs
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # one always-on MLP of this width (DeepSeek: n_shared x width)
    shared_expert_gate: bool = False  # Qwen2-MoE: a (hidden -> 1) gate on the shared expert
    moe_layers: tuple[bool, ...] = ()  # per layer; (): none
    router_bias: bool = False
    expert_bias: bool = False  # gpt-oss: biases on the expert projections
    embedding_norm: bool = False  # BLOOM's word_embeddings_layernorm
    extra_layer_params: int = 0  # per-layer parameters outside the usual groups (BitNet's sub-norms)
    kv_lora_rank: int = 0  # DeepSeek MLA (0: standard attention)
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    kv_latent: bool = False  # MLA whose cache holds the latent (kv_lora_rank + rope per token), not per-head K, V
    # how a GGUF file stores the weights (workload.gguf_config.stored_weights): (operator group, GGUF format,
    # parameters) triples; (): every weight in the plan's dtype (a HuggingFace folder). The hook for pricing
    # compressed weights: bytes = parameters * flexplan.quant.formats.BY_NAME[format].bytes_per_weight
    stored_weights: tuple[tuple[str, str, int], ...] = ()

    def __post_init__(self) -> None:
        fix = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass defaults)
        if self.norm_bias is None:
            fix("norm_bias", self.norm == "layer")
        if not self.v_head_dim:
            fix("v_head_dim", self.head_dim)
        if not self.layer_types:
            fix("layer_types", ("full_attention",) * self.num_layers)
        if not self.moe_layers:
            fix("moe_layers", (False,) * self.num_layers)
        fix("layer_types", tuple(self.layer_types))
        fix("moe_layers", tuple(bool(x) for x in self.moe_layers))
        fix("stored_weights", tuple((str(g), str(f), int(n)) for g, f, n in self.stored_weights))

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> "ModelSpec":
        """From a ``PretrainedConfig``, a config dict, a ``config.json`` path or a model folder
        (a nested ``text_config``, as in Gemma 3, is read)."""
        if isinstance(config, (str, Path)):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            try:
                cfg = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise MalformedDataError(f"cannot read model config {path}: {e}") from None
            name = name or (path.parent.name if path.name == "config.json" else path.stem)
        elif isinstance(config, dict):
            cfg = dict(config)
        elif hasattr(config, "to_dict"):
            cfg = config.to_dict()
            name = name or getattr(config, "_name_or_path", None) or None
        else:
            raise MalformedDataError(f"expected a HuggingFace config, dict or path, got {type(config).__name__}")
        if not isinstance(cfg, dict):
            raise MalformedDataError(f"model config {name!r} is not a JSON object")
        name = str(name or cfg.get("_name_or_path") or cfg.get("model_type", "model"))
        reject_non_layerwise(cfg, name)
        cfg = text_config(cfg)
        reject_non_layerwise(cfg, name)
        try:
            fields = spec_fields(cfg)
        except KeyError as e:
            raise MalformedDataError(f"model config {name!r} lacks field {e.args[0]!r}") from None
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise MalformedDataError(f"model config {name!r} has a bad value: {e}") from None
        out = cls(name=name, **fields)
        out._validate()
        return out

    def _validate(self) -> None:
        for field in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, field) <= 0:
                raise MalformedDataError(f"model config {self.name!r}: {field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise MalformedDataError(
                f"model config {self.name!r}: num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        for field in ("layer_types", "moe_layers"):
            if len(getattr(self, field)) != self.num_layers:
                raise MalformedDataError(f"model config {self.name!r}: {field} has {len(getattr(self, field))} "
                                         f"entries for {self.num_layers} layers")
        if any(self.moe_layers) and not (0 < self.experts_per_token <= self.num_experts):
            raise MalformedDataError(f"model config {self.name!r}: {self.experts_per_token} experts per token "
                                     f"of {self.num_experts}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---- shapes -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of one token's keys in one layer (values: ``num_kv_heads * v_head_dim``)."""
        return self.num_kv_heads * self.head_dim

    @property
    def kv_elems_per_token(self) -> int:
        """K and V elements one layer caches per token (an MLA latent cache: the latent and the rotary key)."""
        if self.kv_latent:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def native_decode_stack(self) -> bool:
        """Whether the executor's native stack runs this model's all-CPU float32 decode step (one
        call for every layer) with the weights as stored (:meth:`native_decode_stack_with`)."""
        return self.native_decode_stack_with(self.stored_weights)

    def native_decode_stack_with(self, weights: tuple = ()) -> bool:
        """Whether the executor's native stack runs this model's all-CPU float32 decode step with
        ``weights`` held as blocks (Shape.weights; (): in their dtypes): :data:`NATIVE_STACK_FAMILIES`,
        a QK-norm per head or none, every float projection's rows a multiple of
        :data:`NATIVE_BLOCK_ROWS` (packable; a group on kernel blocks needs no packing), no sliding
        layers (the stack steps aside once a window cuts the keys); a MoE model with every layer
        routed, no shared expert or a gated one (Qwen2-MoE's), and its experts on kernel blocks (the
        native layer reads QuantExperts' blocks, not float experts)."""
        on_blocks = {g for g, f, _ in weights if f in weight_formats.KERNEL_FORMATS}
        rows = ((self.q_dim, self.kv_dim, self.hidden_size) if "attention" not in on_blocks else ()) + \
            ((self.intermediate_size,) if "mlp" not in on_blocks and not self.is_moe else ())
        moe_ok = not self.is_moe or (all(self.moe_layers) and (not self.shared_expert_intermediate_size
                                                               or self.shared_expert_gate)
                                     and not self.router_bias and not self.expert_bias
                                     and weight_formats.experts_on_kernel_blocks(weights))
        return (self.family in NATIVE_STACK_FAMILIES and self.qk_norm in ("", "head") and moe_ok
                and all(n % NATIVE_BLOCK_ROWS == 0 for n in rows)
                and all(t == "full_attention" for t in self.layer_types))

    def stored_formats(self, group: str) -> dict[str, int]:
        """{GGUF format: parameters} of operator ``group`` as its file stores them ({}: a HuggingFace
        folder, weights in the plan's dtype); a tied head has none, it reads "embedding"'s."""
        return {fmt: n for g, fmt, n in self.stored_weights if g == group}

    def layer_window(self, i: int) -> int | None:
        """Keys layer ``i`` attends over at most (None: the whole context)."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def layer_chunk(self, i: int) -> int | None:
        """Chunk length of a "chunked_attention" layer (queries see keys of their chunk only)."""
        return self.attention_chunk_size if self.layer_types[i] == "chunked_attention" else None

    # ---- parameter counts by operator group (exact, as the HF modules hold them) -----
    @property
    def attention_params(self) -> int:
        """q, k, v, o projections with their biases, QK-norms and sinks of one layer (MLA:
        its low-rank projections and their norms)."""
        h, hd, vd, heads, kvh = self.hidden_size, self.head_dim, self.v_head_dim, self.num_heads, self.num_kv_heads
        o = heads * vd * h + (h if self.o_bias else 0)
        if self.kv_lora_rank:
            r, qr, rope = self.kv_lora_rank, self.q_lora_rank, self.qk_rope_head_dim
            b = 1 if self.qkv_bias else 0
            q = (h * qr + b * qr + qr + qr * heads * hd) if qr else h * heads * hd
            kv = h * (r + rope) + b * (r + rope) + r + r * heads * (hd - rope + vd)
            return q + kv + o
        qkv = h * (heads * hd + kvh * hd + kvh * vd)
        if self.qkv_bias:
            qkv += heads * hd + kvh * hd + kvh * vd
        qk_norm = {"": 0, "head": 2 * hd, "full": (heads + kvh) * hd, "head_ln": 4 * hd}[self.qk_norm]
        sinks = heads if self.attention_sinks else 0
        return qkv + o + qk_norm + sinks

    def _mlp_params(self, width: int, bias: bool) -> int:
        h = self.hidden_size
        n = (3 if self.gated_mlp else 2) * h * width
        return n + ((2 * width if self.gated_mlp else width) + h if bias else 0)

    @property
    def dense_mlp_params(self) -> int:
        """The MLP of a dense layer."""
        return self._mlp_params(self.intermediate_size, self.mlp_bias)

    @property
    def expert_params(self) -> int:
        """One routed expert."""
        return self._mlp_params(self.expert_intermediate_size, self.expert_bias) if self.num_experts else 0

    @property
    def router_params(self) -> int:
        return self.num_experts * (self.hidden_size + (1 if self.router_bias else 0))

    @property
    def shared_expert_params(self) -> int:
        """The always-on shared expert(s) of an MoE layer, with Qwen2-MoE's gate."""
        if not self.shared_expert_intermediate_size:
            return 0
        gate = self.hidden_size if self.shared_expert_gate else 0
        return self._mlp_params(self.shared_expert_intermediate_size, self.mlp_bias) + gate

    @property
    def layer_norm_params(self) -> int:
        """The norms of one layer (input / post-attention / Gemma's pre- and post-feedforward)."""
        return self.norms_per_layer * self._norm_params

    def mlp_params(self, i: int) -> int:
        """MLP (or router + experts + shared expert) of layer ``i``."""
        if self.moe_layers[i]:
            return self.router_params + self.num_experts * self.expert_params + self.shared_expert_params
        return self.dense_mlp_params

    def layer_group_params(self, i: int) -> dict[str, int]:
        """Parameters of layer ``i`` by operator group, as a placement moves them: "attention"
        (projections, QK-norms, sinks), "mlp" (a dense layer's MLP), "router", "experts" (all
        routed experts), "shared_experts", "norms" (the layer's norms and any other parameters).
        The values sum to :meth:`layer_params`."""
        moe = self.moe_layers[i]
        return {
            "attention": self.attention_params,
            "mlp": 0 if moe else self.dense_mlp_params,
            "router": self.router_params if moe else 0,
            "experts": self.num_experts * self.expert_params if moe else 0,
            "shared_experts": self.shared_expert_params if moe else 0,
            "norms": self.layer_norm_params + self.extra_layer_params,
        }

    def layer_params(self, i: int) -> int:
        """Every parameter of decoder layer ``i``."""
        return self.attention_params + self.mlp_params(i) + self.layer_norm_params + self.extra_layer_params

    def active_layer_params(self, i: int) -> int:
        """Parameters of layer ``i`` one token uses: all but the routed experts it skips."""
        skipped = (self.num_experts - self.experts_per_token) * self.expert_params if self.moe_layers[i] else 0
        return self.layer_params(i) - skipped

    @property
    def _attention_linear_params(self) -> int:
        h, hd, vd, heads, kvh = self.hidden_size, self.head_dim, self.v_head_dim, self.num_heads, self.num_kv_heads
        if self.kv_lora_rank:
            r, qr, rope = self.kv_lora_rank, self.q_lora_rank, self.qk_rope_head_dim
            q = h * qr + qr * heads * hd if qr else h * heads * hd
            return q + h * (r + rope) + r * heads * (hd - rope + vd) + heads * vd * h
        return h * (heads * hd + kvh * hd + kvh * vd) + heads * vd * h

    def linear_weight_params(self, i: int) -> int:
        """GEMM weights one token multiplies in layer ``i`` (what FLOPs are counted over): the
        attention projections and the dense MLP, or the router, the shared expert and k experts."""
        w = (3 if self.gated_mlp else 2) * self.hidden_size
        if self.moe_layers[i]:
            mlp = (self.num_experts * self.hidden_size + w * self.experts_per_token * self.expert_intermediate_size
                   + w * self.shared_expert_intermediate_size + (self.hidden_size if self.shared_expert_gate else 0))
        else:
            mlp = w * self.intermediate_size
        return self._attention_linear_params + mlp

    @staticmethod
    def _mean(values: list[int]) -> int | float:
        total = sum(values)
        return total // len(values) if total % len(values) == 0 else total / len(values)

    @cached_property  # the dataclass is frozen: computed once
    def linear_weight_params_per_layer(self) -> int | float:
        """Mean over layers of :meth:`linear_weight_params` (an int when all layers agree)."""
        return self._mean([self.linear_weight_params(i) for i in range(self.num_layers)])

    @cached_property
    def params_per_layer(self) -> int | float:
        """Mean over layers of :meth:`layer_params` (an int when all layers agree)."""
        return self._mean([self.layer_params(i) for i in range(self.num_layers)])

    @cached_property
    def layers_params(self) -> int:
        """All decoder layers together."""
        return sum(self.layer_params(i) for i in range(self.num_layers))

    @property
    def embedding_params(self) -> int:
        """Token (and learned position) embedding tables, plus OPT's projections and BLOOM's
        embedding LayerNorm if any."""
        emb_dim = self.word_embed_proj_dim or self.hidden_size
        n = self.vocab_size * emb_dim + self.learned_pos_embeddings * self.hidden_size
        if self.word_embed_proj_dim:
            n += 2 * emb_dim * self.hidden_size
        return n + (self._norm_params if self.embedding_norm else 0)

    @property
    def _norm_params(self) -> int:
        if not self.norm_affine:
            return 0
        return self.hidden_size * (2 if self.norm == "layer" and self.norm_bias else 1)

    @property
    def final_norm_params(self) -> int:
        return self._norm_params if self.final_norm else 0

    @property
    def lm_head_params(self) -> int:
        """Untied LM head weights (and bias); 0 when tied to the embedding (stored once)."""
        bias = self.vocab_size if self.lm_head_bias else 0
        return bias + (0 if self.tie_word_embeddings else self.vocab_size * (self.word_embed_proj_dim or self.hidden_size))

    @cached_property
    def total_params(self) -> int:
        return self.layers_params + self.embedding_params + self.final_norm_params + self.lm_head_params

    @cached_property
    def active_params(self) -> int:
        """Parameters one token uses (embeddings and head included, as model cards count
        "activated" parameters): ``total_params`` less the routed experts it skips."""
        return self.total_params - sum(self.layer_params(i) - self.active_layer_params(i) for i in range(self.num_layers))
