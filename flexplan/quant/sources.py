"""Which loader a model path takes for a ``weights=`` choice: the one rule ``flexplan.load`` and the
serving engine (``Engine.from_pretrained``, ``flexplan serve``) share, so a path and a choice load
the same model and are refused with the same words by both.

- a ``.gguf`` file: ``"gguf"`` (default, "auto"): its linears on the file's own blocks
  (``QuantLinear``: the CPU's kernels read them, an accelerator dequantises them); ``"float32"``: every weight dequantised to float32 ``nn.Linear``;
- a model folder (or a loaded model, or a hub name): ``"float32"`` (default, "auto"): its float
  weights, loaded by the caller as it always has; ``"int4"`` / ``"int8"``: a folder's decoder and
  head linears quantised at load to group-wise blocks (:mod:`flexplan.quant.at_load`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from flexplan.errors import InvalidInputError
from flexplan.executor.loading import is_model_folder
from flexplan.quant.at_load import AT_LOAD_FORMATS, load_quantized_folder
from flexplan.quant.gguf_model import load_gguf_model
from flexplan.workload.gguf_header import is_gguf_path

GGUF_BLOCKS = "gguf"  # a .gguf file's own blocks
GGUF_FLOAT32 = "gguf-float32"  # a .gguf file dequantised to float32
DENSE = "dense"  # a folder's (or a loaded model's) float weights, loaded by the caller
GGUF_CHOICES = ("gguf", "float32")
FOLDER_CHOICES = ("float32", *AT_LOAD_FORMATS)


@dataclass(frozen=True)
class WeightsSource:
    """What ``weights_source`` decided for one path: ``kind`` (GGUF_BLOCKS, GGUF_FLOAT32, DENSE, or
    an AT_LOAD_FORMATS key: "int4" / "int8") and the path as given."""

    kind: str
    path: object

    @property
    def blocks(self) -> bool:
        """Whether the linears hold blocks (QuantLinear) rather than float weights."""
        return self.kind == GGUF_BLOCKS or self.kind in AT_LOAD_FORMATS

    @property
    def planned_weights(self) -> str | None:
        """The planner's ``weights=`` for this model (planner.plan): the blocks it holds, or None
        (plain float tensors, a dequantised GGUF file's included)."""
        return self.kind if self.blocks else None

    def load(self, log=None):
        """(model, tokenizer or None) of a GGUF file or a folder quantised at load; a DENSE source
        is loaded by the caller (flexplan.load streams it, the engine reads it with transformers)."""
        if self.kind == GGUF_BLOCKS:
            return load_gguf_model(self.path, log=log)
        if self.kind == GGUF_FLOAT32:
            return load_gguf_model(self.path, dequantize_all=True, log=log)
        if self.kind in AT_LOAD_FORMATS:
            return load_quantized_folder(self.path, self.kind, log=log), folder_tokenizer(self.path)
        raise ValueError(f"a {self.kind} source is loaded by its caller")


def weights_source(model_or_path, weights: str | None) -> WeightsSource:
    """The loader for ``model_or_path`` and ``weights`` (None or "auto": the path's default; see the
    module's docstring); InvalidInputError naming what works for a choice the path does not take.
    Decided by the path's suffix and the choice alone: a missing file is reported by its loader."""
    if weights == "auto":
        weights = None
    if weights is not None and not isinstance(weights, str):
        raise InvalidInputError(f"weights must be a string such as 'int4', got {weights!r}")
    is_path = isinstance(model_or_path, (str, os.PathLike))
    gguf = is_path and is_gguf_path(str(model_or_path))
    if weights in AT_LOAD_FORMATS:
        if not (is_path and is_model_folder(model_or_path)):
            got = repr(str(model_or_path)) if is_path else f"a loaded {type(model_or_path).__name__}"
            also = "; a .gguf file takes weights='gguf' or 'auto' (its own blocks) or 'float32' (dequantised)" \
                if gguf else ""
            raise InvalidInputError(f"weights={weights!r} quantises a model folder (config.json + *.safetensors) at "
                                    f"load; got {got}{also}")
        return WeightsSource(weights, model_or_path)
    if gguf:
        if weights not in (None, *GGUF_CHOICES):
            raise InvalidInputError(f"weights={weights!r} with {model_or_path}: a .gguf file takes weights='gguf' "
                                    "or 'auto' (its own blocks, the default) or 'float32' (dequantised)")
        return WeightsSource(GGUF_FLOAT32 if weights == "float32" else GGUF_BLOCKS, model_or_path)
    if weights == "gguf":
        what = model_or_path if is_path else f"a loaded {type(model_or_path).__name__}"
        raise InvalidInputError(f"weights={weights!r} with {what}: weights='gguf' (the file's own blocks) or "
                                "'float32' (dequantised) take a .gguf file path; a model folder takes "
                                f"{', '.join(map(repr, FOLDER_CHOICES))}")
    if weights not in (None, *FOLDER_CHOICES):
        raise InvalidInputError(f"weights={weights!r}: a model folder takes {', '.join(map(repr, FOLDER_CHOICES))} "
                                f"(float32: not quantised); a .gguf file takes {', '.join(map(repr, GGUF_CHOICES))}")
    return WeightsSource(DENSE, model_or_path)


def folder_tokenizer(path):
    """transformers' tokenizer of a folder, or None where it has no tokenizer files."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception:  # noqa: BLE001 - a folder without tokenizer files is fine
        return None
