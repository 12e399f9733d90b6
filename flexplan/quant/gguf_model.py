"""A GGUF file as a transformers causal LM whose decoder linears run on the file's own blocks.

:func:`load_gguf_model` builds the model skeleton from the file's config (transformers reads a
GGUF's metadata: ``AutoConfig.from_pretrained(dir, gguf_file=...)``) on the meta device, so no
float weight is materialised for a linear; then every ``nn.Linear`` becomes a
:class:`~flexplan.quant.quant_linear.QuantLinear` holding its raw blocks, and the remaining
parameters (norms, the embedding) are dequantised from the file. The GGUF name of each HF module
is asked of the ``gguf`` package's own tensor-name map (``get_tensor_name_map``), walking the
model's modules: no hand-written list.

The embedding (``token_embd``, small) is dequantised once; the head, when the file has no
``output`` tensor (tied, as SmolLM2), runs on ``token_embd``'s blocks through a QuantLinear.
Formats without a kernel are dequantised at load with one printed line naming them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import torch
from torch import nn

from flexplan.errors import InvalidInputError
from flexplan.quant import kernels
from flexplan.quant.gguf_weights import GGUFWeights, read_gguf
from flexplan.quant.quant_linear import QuantLinear

# the architectures whose GGUF tensors this loader maps and whose rows it permutes as transformers does
SUPPORTED_ARCHITECTURES = ("llama",)


def _arch_enum(name: str) -> gguf.MODEL_ARCH:
    for arch, arch_name in gguf.MODEL_ARCH_NAMES.items():
        if arch_name == name:
            return arch
    raise InvalidInputError(f"GGUF architecture {name!r} is unknown to the gguf package")


def _check(path: Path) -> GGUFWeights:
    if not path.is_file():
        raise InvalidInputError(f"{path}: no such GGUF file; pass the path of a .gguf file "
                                f"(architectures flexplan runs from GGUF: {', '.join(SUPPORTED_ARCHITECTURES)})")
    weights = read_gguf(path)  # refuses, naming it, a tensor type flexplan does not read
    if weights.architecture not in SUPPORTED_ARCHITECTURES:
        raise InvalidInputError(f"{path}: GGUF architecture {weights.architecture!r} is not supported; flexplan runs "
                                f"{', '.join(SUPPORTED_ARCHITECTURES)} GGUF files (or load a HuggingFace folder)")
    return weights


def gguf_config_and_tokenizer(path: Path, tokenizer: bool = True):
    """transformers' config (and tokenizer) read from the GGUF's metadata."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name) if tokenizer else None
    return config, tok


def _skeleton(config) -> nn.Module:
    """The model on the meta device: structure only, no storage."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _rebuild_meta_buffers(model: nn.Module) -> None:
    """Modules whose buffers are computed, not loaded (rotary inv_freq): built again on the CPU."""
    for name, module in list(model.named_modules()):
        if any(b is not None and b.is_meta for b in module.buffers(recurse=False)):
            config = getattr(module, "config", None) or model.config
            _set_module(model, name, type(module)(config=config))


def load_gguf_model(path: str | Path, *, tokenizer: bool = True, float_act: bool = False, dequantize_all: bool = False,
                    log=None):
    """(model, tokenizer) from GGUF file ``path``: decoder linears as QuantLinear on the file's blocks
    (``dequantize_all=True``: every weight dequantised to float32 ``nn.Linear``, the reference model)."""
    path = Path(path)
    log = log or (lambda line: print(line, file=sys.stderr))
    weights = _check(path)
    config, tok = gguf_config_and_tokenizer(path, tokenizer)
    model = _skeleton(config)
    names = gguf.get_tensor_name_map(_arch_enum(weights.architecture), config.num_hidden_layers)
    native, why = kernels.status()
    dequantised: dict[str, list[str]] = {}
    used: set[str] = set()
    for mod_name, module in list(model.named_modules()):
        base = names.get_name(mod_name)
        if base is None:
            continue
        if isinstance(module, nn.Linear):
            key = f"{base}.weight"
            if key not in weights.tensors and mod_name == "lm_head":
                key = names.get_name("model.embed_tokens") + ".weight"  # tied head: the embedding's blocks
            if key not in weights.tensors:
                raise InvalidInputError(f"{path}: no tensor {key} for {mod_name}")
            qt = weights.hf_tensor(key)
            bias_t = weights.tensors.get(f"{base}.bias")
            bias = None if bias_t is None else weights.hf_tensor(f"{base}.bias").dequantize()
            used.update({key, f"{base}.bias"})
            if dequantize_all:
                lin = nn.Linear(module.in_features, module.out_features, bias=bias is not None)
                lin.weight = nn.Parameter(qt.dequantize(), requires_grad=False)
                if bias is not None:
                    lin.bias = nn.Parameter(bias, requires_grad=False)
                _set_module(model, mod_name, lin)
                continue
            if native is None or qt.format.name not in kernels.NATIVE_FORMATS:
                dequantised.setdefault(qt.format.name, []).append(key)
            _set_module(model, mod_name, QuantLinear(qt, bias, float_act))
        else:
            for pname, _ in list(module.named_parameters(recurse=False)):
                key = f"{base}.{pname}"
                if key not in weights.tensors:
                    raise InvalidInputError(f"{path}: no tensor {key} for {mod_name}.{pname}")
                used.add(key)
                module._parameters[pname] = nn.Parameter(weights.hf_tensor(key).dequantize(), requires_grad=False)
    _rebuild_meta_buffers(model)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise InvalidInputError(f"{path}: no GGUF tensor found for {', '.join(left[:5])}")
    for fmt, keys in dequantised.items():
        reason = "no native kernel for it" if native is not None else f"native kernels unavailable: {why}"
        log(f"flexplan: {len(keys)} {fmt} linear weights dequantised to float32 at load ({reason})")
    model.config.tie_word_embeddings = False  # the head holds its own blocks; nothing to tie again
    model.flexplan_gguf = {"path": str(path), "formats": weights.formats()}
    return model, tok
