"""Architecture of a decoder-only model, normalised from a HuggingFace config.

One :class:`ModelSpec` covers the families flexplan plans for: Llama 2/3/3.1, Mistral,
Qwen2/2.5, SmolLM2 (Llama architecture) and OPT. It knows GQA/MQA (``num_kv_heads``),
gated (SwiGLU) and plain MLPs, tied embeddings, ``head_dim`` overrides and biases, and it
counts parameters exactly as the HuggingFace modules hold them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flexplan.errors import MalformedDataError

# model_type -> family traits. "gated": SwiGLU MLP (gate, up, down); "norm": rms (weight)
# or layer (weight + bias); "qkv_bias", "o_bias", "mlp_bias": linear biases.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(gated=True, norm="rms", qkv_bias=None, o_bias=None, mlp_bias=None, learned_pos=False),
    "mistral": dict(gated=True, norm="rms", qkv_bias=False, o_bias=False, mlp_bias=False, learned_pos=False),
    "qwen2": dict(gated=True, norm="rms", qkv_bias=True, o_bias=False, mlp_bias=False, learned_pos=False),
    "opt": dict(gated=False, norm="layer", qkv_bias=None, o_bias=None, mlp_bias=None, learned_pos=True),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # HF model_type
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
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

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> "ModelSpec":
        """From a ``PretrainedConfig``, a config dict, a ``config.json`` path or a model folder."""
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
            # TEMP(wt-exec): replaced by wt-workload. A config's attribute_map aliases (Falcon's num_kv_heads...)
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                        "intermediate_size", "vocab_size", "head_dim", "max_position_embeddings"):
                if cfg.get(key) is None and getattr(text, key, None) is not None:
                    cfg[key] = getattr(text, key)
            name = name or getattr(config, "_name_or_path", None) or None
        else:
            raise MalformedDataError(f"expected a HuggingFace config, dict or path, got {type(config).__name__}")
        name = name or cfg.get("_name_or_path") or cfg.get("model_type", "model")
        try:
            return cls._from_dict(cfg, str(name), any_type=hasattr(config, "to_dict"))  # TEMP(wt-exec)
        except KeyError as e:
            raise MalformedDataError(f"model config {name!r} lacks field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise MalformedDataError(f"model config {name!r} has a bad value: {e}") from None

    @classmethod
    def _from_dict(cls, cfg: dict[str, Any], name: str, any_type: bool = False) -> "ModelSpec":
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            # TEMP(wt-exec): replaced by wt-workload. A loaded model's config (the executor's) of any type
            if not any_type or "num_hidden_layers" not in cfg or "hidden_size" not in cfg:
                raise MalformedDataError(
                    f"model {name!r} has model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
                )
            cfg = dict(cfg)  # TEMP(wt-exec): any other decoder described as Llama-like (approximate sizes)
            cfg["intermediate_size"] = (cfg.get("intermediate_size") or cfg.get("ffn_hidden_size")
                                        or 4 * int(cfg["hidden_size"]))
            fam = FAMILIES["llama"]
        else:
            fam = FAMILIES[model_type]
        if model_type == "opt":
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            bias = bool(cfg.get("enable_bias", True))
            proj = cfg.get("word_embed_proj_dim", hidden)
            spec = dict(
                num_layers=int(cfg["num_hidden_layers"]), hidden_size=hidden,
                intermediate_size=int(cfg["ffn_dim"]), num_heads=heads, num_kv_heads=heads,
                head_dim=hidden // heads, vocab_size=int(cfg["vocab_size"]),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                qkv_bias=bias, o_bias=bias, mlp_bias=bias,
                max_position_embeddings=int(cfg["max_position_embeddings"]),
                learned_pos_embeddings=int(cfg["max_position_embeddings"]) + 2,
                word_embed_proj_dim=None if proj in (None, hidden) else int(proj),
                norm_affine=bool(cfg.get("layer_norm_elementwise_affine", True)),
                final_norm=bool(cfg.get("do_layer_norm_before", True)) and not cfg.get("_remove_final_layer_norm", False),
            )
        else:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            attn_bias = bool(cfg.get("attention_bias", False))
            mlp_bias = bool(cfg.get("mlp_bias", False))
            spec = dict(
                num_layers=int(cfg["num_hidden_layers"]), hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]), num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                vocab_size=int(cfg["vocab_size"]),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=attn_bias if fam["qkv_bias"] is None else fam["qkv_bias"],
                o_bias=attn_bias if fam["o_bias"] is None else fam["o_bias"],
                mlp_bias=mlp_bias if fam["mlp_bias"] is None else fam["mlp_bias"],
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            )
        out = cls(name=name, family=model_type, gated_mlp=fam["gated"], norm=fam["norm"], **spec)
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---- shapes -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    # ---- parameter counts (exact, as the HF modules hold them) -------------------------
    @property
    def linear_weight_params_per_layer(self) -> int:
        """Weights of the GEMMs in one decoder layer (what FLOPs are counted over)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        mlp = (3 if self.gated_mlp else 2) * h * i
        return attn + mlp

    @property
    def params_per_layer(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        bias = 0
        if self.qkv_bias:
            bias += self.q_dim + 2 * self.kv_dim
        if self.o_bias:
            bias += h
        if self.mlp_bias:
            bias += (2 * i if self.gated_mlp else i) + h
        norms = 2 * self._norm_params
        return self.linear_weight_params_per_layer + bias + norms

    @property
    def embedding_params(self) -> int:
        """Token (and learned position) embedding tables, plus OPT's projections if any."""
        emb_dim = self.word_embed_proj_dim or self.hidden_size
        n = self.vocab_size * emb_dim + self.learned_pos_embeddings * self.hidden_size
        if self.word_embed_proj_dim:
            n += 2 * emb_dim * self.hidden_size
        return n

    @property
    def _norm_params(self) -> int:
        if not self.norm_affine:
            return 0
        return self.hidden_size * (2 if self.norm == "layer" else 1)

    @property
    def final_norm_params(self) -> int:
        return self._norm_params if self.final_norm else 0

    @property
    def lm_head_params(self) -> int:
        """Untied LM head weights; 0 when tied to the embedding (stored once)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * (self.word_embed_proj_dim or self.hidden_size)

    @property
    def total_params(self) -> int:
        return self.num_layers * self.params_per_layer + self.embedding_params + self.final_norm_params + self.lm_head_params
