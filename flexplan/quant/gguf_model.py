"""A GGUF file as a transformers causal LM whose decoder linears run on the file's own blocks.

:func:`load_gguf_model` builds the model skeleton on the meta device from the file's config (read
from its header by :mod:`flexplan.workload.gguf_config`, the planner's reading of the same file), so
no float weight is materialised for a linear; then every ``nn.Linear`` becomes a
:class:`~flexplan.quant.quant_linear.QuantLinear` holding its raw blocks, and the remaining
parameters (norms, the embedding, a MoE router) are dequantised from the file. The GGUF name of each
HF module is asked of the ``gguf`` package's own tensor-name map (``get_tensor_name_map``), walking
the model's modules; what transformers does to a tensor after dequantising it (Gemma's norms stored
as ``w + 1``) is asked of its own GGUF tensor processor: no hand-written list.

An architecture is supported where its linear weights are stored as transformers holds them (rows
permuted whole, for llama: :func:`~flexplan.quant.gguf_weights.hf_rows`), since blocks cannot be
rewritten value by value: :data:`SUPPORTED_ARCHITECTURES`, each tested on small files.

The embedding (``token_embd``, small) is dequantised once; the head, when the file has no
``output`` tensor (tied, as SmolLM2), runs on ``token_embd``'s blocks through a QuantLinear. Routed
experts (one tensor per layer and projection, or one per expert in older files) become a
:class:`~flexplan.quant.quant_experts.QuantExperts` on their blocks where a kernel reads their
format, else they are dequantised at load. Formats without a kernel are dequantised at load with
one printed line naming them; a Llama 3.1+ file's ``rope_freqs`` scale the rotary frequencies; a
tensor the model has no place for is named in one line. DeepSeek's MLA kv_b_proj, which llama.cpp's
converter writes split in two halves (one transposed), is put back together dequantised.
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from flexplan.errors import InvalidInputError
from flexplan.quant import kernels, quant_experts
from flexplan.quant.formats import BY_NAME
from flexplan.quant.gguf_weights import GGUFWeights, read_gguf
from flexplan.quant.quant_linear import QuantLinear
from flexplan.workload.gguf_config import KV_B_HALVES, hf_config
from flexplan.workload.gguf_header import read_header

# the GGUF architectures whose tensors this loader maps (general.architecture; llama.cpp writes
# Mistral, SmolLM and Mixtral as "llama"), each checked against transformers on small files (tests/test_gguf_archs.py)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen2moe", "qwen3moe", "gpt-oss", "phi3",
                           "deepseek2")
ARCHITECTURE_NOTE = ("llama (Llama, Mistral, SmolLM, Mixtral), qwen2, qwen3, gemma2, gemma3, qwen2moe, qwen3moe, gpt-oss, "
                     "phi3 (without LongRoPE factors), deepseek2 (DeepSeek V2, V3, R1)")
# LongRoPE's per-frequency factors (llama.cpp's Phi3MiniModel writes them for the 128k Phi-3 / 3.5
# files): not mapped to transformers' longrope parameters yet, so such a file is refused, not run wrong
LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# fused routed experts (transformers 5 holds [experts, out, in] per layer, or [experts, in, out] where
# the module says ``is_transposed``) and their biases: GGUF keeps gate and up apart ([experts, out, in]
# each); concatenated gate first on the out axis, as transformers' Qwen2MoeTensorProcessor does
FUSED_EXPERTS = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "down_proj": ("ffn_down_exps",),
                 "gate_up_proj_bias": ("ffn_gate_exps", "ffn_up_exps"), "down_proj_bias": ("ffn_down_exps",)}
# the architectures whose converter split gate_up by alternate rows, not halves (llama.cpp's
# GptOssModel.modify_tensors: gate = [:, ::2], up = [:, 1::2]): interleaved back
INTERLEAVED_GATE_UP = ("gpt-oss",)


def _arch_enum(name: str) -> gguf.MODEL_ARCH:
    for arch, arch_name in gguf.MODEL_ARCH_NAMES.items():
        if arch_name == name:
            return arch
    raise InvalidInputError(f"GGUF architecture {name!r} is unknown to the gguf package")


def _check(path: Path) -> GGUFWeights:
    if not path.is_file():
        raise InvalidInputError(f"{path}: no such GGUF file; pass the path of a .gguf file "
                                f"(architectures flexplan runs from GGUF: {ARCHITECTURE_NOTE})")
    weights = read_gguf(path)  # refuses, naming it, a tensor type flexplan does not read
    if weights.architecture not in SUPPORTED_ARCHITECTURES:
        raise InvalidInputError(f"{path}: GGUF architecture {weights.architecture!r} is not supported; flexplan runs "
                                f"{ARCHITECTURE_NOTE} GGUF files (or load a HuggingFace folder)")
    longrope = [n for n in LONGROPE_FACTORS if n in weights.tensors]
    if longrope:
        raise InvalidInputError(f"{path}: holds LongRoPE factors ({', '.join(longrope)}), which flexplan does not map "
                                "yet; load the model's HuggingFace folder instead (its config carries them)")
    return weights


def gguf_tokenizer(path: Path, config):
    """transformers' tokenizer of the file, built from its metadata by the class ``AutoTokenizer``
    picks for ``config`` (``AutoTokenizer.from_pretrained(dir, gguf_file=)`` would first read the
    config again with transformers' full metadata reader: seconds for a large vocabulary); padded
    on the left, as decoder-only generation pads. None, with the reason, where the file has none."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = (TOKENIZER_MAPPING[type(config)] if type(config) in TOKENIZER_MAPPING else None) or TokenizersBackend
    try:
        tok = cls.from_pretrained(str(path.parent), gguf_file=path.name)
    except (KeyError, ValueError, TypeError) as e:
        return None, f"no tokenizer in {path.name}'s metadata ({type(e).__name__}: {e})"
    tok.padding_side = "left"
    return tok, ""


def gguf_config_and_tokenizer(path: Path, tokenizer: bool = True):
    """transformers' config (and tokenizer, or None) read from the GGUF's metadata."""
    config = hf_config(read_header(path))
    tok = gguf_tokenizer(path, config)[0] if tokenizer else None
    return config, tok


def _skeleton(config) -> nn.Module:
    """The model on the meta device: structure only, no storage; computed buffers (rotary
    frequencies, Gemma's embedding scale) made on the CPU by transformers' own initialiser."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for module in model.modules():
        meta = [k for k, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        for k in meta:
            module._buffers[k] = torch.empty_like(module._buffers[k], device="cpu")
        if meta:
            model._init_weights(module)  # meta parameters stay meta: they are loaded from the file next
    return model.eval()


class _Tensors:
    """The file's tensors as transformers holds them: llama's q/k rows permuted back (on the blocks),
    then transformers' GGUF tensor processor for the architecture applied to dequantised values."""

    def __init__(self, weights: GGUFWeights, config):
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.weights, self.used = weights, set()
        self.processor = TENSOR_PROCESSORS.get(weights.architecture, TensorProcessor)(config=config.to_dict())

    def has(self, key: str) -> bool:
        return key in self.weights.tensors

    def blocks(self, key: str):
        self.used.add(key)
        return self.weights.hf_tensor(key)

    def dense(self, key: str) -> torch.Tensor:
        """float32 values of ``key`` after transformers' processing of the same tensor."""
        values = self.blocks(key).dequantize()
        out = self.processor.process(weights=values.numpy(), name=key)
        return torch.from_numpy(np.ascontiguousarray(out.weights, dtype=np.float32)).reshape(values.shape)


def _check_shape(path: Path, key: str, shape, hf_name: str, want) -> None:
    """The file's tensor must be the shape the config gives the module: a config read wrong shows here."""
    if tuple(shape) != tuple(want):
        raise InvalidInputError(f"{path}: tensor {key} is {list(shape)} but the config read from the file makes "
                                f"{hf_name} {list(want)}; the file's metadata and tensors disagree")


def _expert_parts(tensors: _Tensors, path: Path, layer: str, pname: str, n_experts: int, mod_name: str) -> list:
    """The file's tensors behind fused-experts parameter ``pname`` of a layer (gate and up, or down;
    their weights or biases), each [experts, ...]: stacked tensors, or one per expert stacked here
    (GGUF files before April 2024)."""
    suffix = "bias" if pname.endswith("_bias") else "weight"
    parts = []
    for k in FUSED_EXPERTS[pname]:
        key = f"blk.{layer}.{k}.{suffix}"
        each = [f"blk.{layer}.{k.removesuffix('_exps')}.{e}.{suffix}" for e in range(n_experts)]
        if tensors.has(key):
            parts.append(tensors.blocks(key))
        elif all(tensors.has(e) for e in each):
            qts = [tensors.blocks(e) for e in each]
            if len({q.format for q in qts}) != 1:
                raise InvalidInputError(f"{path}: {each[0]} .. {each[-1]} are not all one format")
            parts.append(replace(qts[0], name=key, data=torch.stack([q.data for q in qts]),
                                 shape=(n_experts, *qts[0].shape)))
        else:
            raise InvalidInputError(f"{path}: no tensor {key} (nor {each[0]} .. {each[-1]}, one per expert) "
                                    f"for {mod_name}.{pname}")
    return parts


def _gate_up(parts: list, interleaved: bool, values: bool) -> torch.Tensor:
    """Gate and up (or the one tensor) as one [experts, rows, ...]: halves, or alternate rows
    (:data:`INTERLEAVED_GATE_UP`); ``values``: dequantised float32, else the raw blocks."""
    ts = [p.dequantize() if values else p.data for p in parts]
    if len(ts) == 2 and interleaved:
        return torch.stack(ts, dim=2).flatten(1, 2)  # gate, up, gate, up, ... on the out axis
    return torch.cat(ts, dim=1)


def _takes_blocks(module: nn.Module, parts: dict) -> bool:
    """Whether the experts run on their blocks (QuantExperts): a module it stands in for
    (:func:`~flexplan.quant.quant_experts.replaceable`) whose weights' formats the kernels read,
    gate and up in one format."""
    formats = [{q.format for q in parts[p]} for p in ("gate_up_proj", "down_proj")]
    return quant_experts.replaceable(module) and all(
        len(f) == 1 and quant_experts.kernel_reads(next(iter(f))) for f in formats)


def _fused_experts(model: nn.Module, tensors: _Tensors, path: Path, float_act: bool,
                   dequantize_all: bool) -> tuple[list[str], list[str]]:
    """Fill every fused-experts module (:data:`FUSED_EXPERTS` parameters) from the file: replaced by a
    :class:`~flexplan.quant.quant_experts.QuantExperts` on the file's blocks where the kernels read
    them (:func:`_takes_blocks`), else its parameters dequantised. (the layers on blocks, the
    layers dequantised)."""
    on_blocks, dense = [], []
    interleaved = tensors.weights.architecture in INTERLEAVED_GATE_UP
    for mod_name, module in list(model.named_modules()):
        params = dict(module.named_parameters(recurse=False))
        if not params or not set(params) <= set(FUSED_EXPERTS):
            continue
        layer = re.search(r"\.layers\.(\d+)\.", f".{mod_name}.")
        if layer is None:
            raise InvalidInputError(f"{path}: experts module {mod_name} is in no decoder layer")
        parts = {p: _expert_parts(tensors, path, layer.group(1), p, params[p].shape[0], mod_name) for p in params}
        transposed = bool(getattr(module, "is_transposed", False))
        for pname, param in params.items():  # the shapes the module holds, checked on the file's
            value_shape = [*parts[pname][0].shape]
            value_shape[1] = sum(q.shape[1] for q in parts[pname])  # gate and up stacked on the rows
            want = list(param.shape)
            if not pname.endswith("_bias") and transposed:
                want = [want[0], want[2], want[1]]
            _check_shape(path, " + ".join(q.name for q in parts[pname]), value_shape, f"{mod_name}.{pname}", want)
        if not dequantize_all and _takes_blocks(module, parts):
            gate_up, down = parts["gate_up_proj"], parts["down_proj"]
            bias = {p: _gate_up(parts[p], interleaved, values=True) for p in ("gate_up_proj_bias", "down_proj_bias")
                    if p in parts}
            experts = quant_experts.QuantExperts(
                module, (_gate_up(gate_up, interleaved, values=False), gate_up[0].format),
                (down[0].data, down[0].format), hidden=down[0].shape[1], intermediate=gate_up[0].shape[1],
                gate_up_bias=bias.get("gate_up_proj_bias"), down_bias=bias.get("down_proj_bias"), float_act=float_act)
            model.set_submodule(mod_name, experts)
            on_blocks.append(mod_name)
            continue
        for pname in params:
            value = _gate_up(parts[pname], interleaved, values=True)
            if not pname.endswith("_bias") and transposed:
                value = value.transpose(1, 2).contiguous()  # [experts, in, out], as the module holds them
            module._parameters[pname] = nn.Parameter(value, requires_grad=False)
        dense.append(mod_name)
    return on_blocks, dense


def _joined_kv_b(tensors: _Tensors, base: str, path: Path) -> torch.Tensor | None:
    """kv_b_proj's float32 weight from the file's split halves (gguf_config's ``KV_B_HALVES``:
    dequantised, since the transposed half's blocks run along the other axis), or None where the file
    has no such pair for ``base`` (blk.N.attn_kv_b)."""
    k_key, v_key = (base.replace("attn_kv_b", half) + ".weight" for half in KV_B_HALVES)
    if not (tensors.has(k_key) and tensors.has(v_key)):
        return None
    k_b, v_b = tensors.dense(k_key), tensors.dense(v_key)
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise InvalidInputError(f"{path}: {k_key} {list(k_b.shape)} and {v_key} {list(v_b.shape)} are not MLA's "
                                "[heads, rank, nope] and [heads, v, rank] halves of one kv_b_proj")
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1]).contiguous()


def _bare_buffers(module: nn.Module, mod_name: str, names, tensors: _Tensors, path: Path) -> None:
    """Fill a module's float buffers that the file holds as a tensor of its own: DeepSeek-V3's
    router ``e_score_correction_bias`` (``blk.N.exp_probs_b.bias``: gguf's map knows the name without
    its ``_bias``, the converter adds ``.bias``)."""
    for bname, buf in list(module.named_buffers(recurse=False)):
        if buf is None or not buf.is_floating_point() or not bname.endswith("_bias"):
            continue
        name = names.get_name(f"{mod_name}.{bname.removesuffix('_bias')}")
        key = f"{name}.bias" if name is not None else None
        if key is not None and tensors.has(key):
            value = tensors.dense(key)
            _check_shape(path, key, value.shape, f"{mod_name}.{bname}", buf.shape)
            module._buffers[bname] = value.to(buf.dtype)


def _bare_parameters(module: nn.Module, mod_name: str, names, tensors: _Tensors, path: Path) -> None:
    """Fill the parameters a module holds itself where the module has no GGUF name but the
    parameter has (gpt-oss's ``self_attn.sinks``: ``blk.N.attn_sinks.weight``, the converter
    adding ``.weight``)."""
    for pname, param in list(module.named_parameters(recurse=False)):
        name = names.get_name(f"{mod_name}.{pname}") if param.is_meta else None
        key = next((k for k in (f"{name}.weight", name) if name is not None and tensors.has(k)), None)
        if key is not None:
            value = tensors.dense(key)
            _check_shape(path, key, value.shape, f"{mod_name}.{pname}", param.shape)
            module._parameters[pname] = nn.Parameter(value, requires_grad=False)


# llama.cpp's rotary frequency divisors (convert_hf_to_gguf writes them for Llama 3.1+'s "llama3"
# rope scaling, whose parameters the metadata does not carry; llama.cpp divides each frequency by its
# factor): the rotary embedding's frequencies divided the same way, as transformers' llama3 scaling sets them
ROPE_FREQS = "rope_freqs.weight"


def _rope_freqs(model: nn.Module, tensors: _Tensors, path: Path) -> None:
    """Divide every rotary embedding's ``inv_freq`` by the file's :data:`ROPE_FREQS`, where it has one."""
    if not tensors.has(ROPE_FREQS):
        return
    factors = tensors.dense(ROPE_FREQS).reshape(-1)
    for name, m in model.named_modules():
        inv = getattr(m, "inv_freq", None)
        if not isinstance(inv, torch.Tensor):
            continue
        if inv.shape != factors.shape:
            raise InvalidInputError(f"{path}: {ROPE_FREQS} holds {factors.numel()} factors but {name} has "
                                    f"{inv.numel()} rotary frequencies; the file's metadata and tensors disagree")
        m.inv_freq = (inv / factors).to(inv.dtype)
        if isinstance(getattr(m, "original_inv_freq", None), torch.Tensor):
            m.original_inv_freq = m.inv_freq.clone()


def load_gguf_model(path: str | Path, *, tokenizer: bool = True, float_act: bool = False, dequantize_all: bool = False,
                    log=None):
    """(model, tokenizer) from GGUF file ``path``: decoder linears as QuantLinear on the file's blocks
    (``dequantize_all=True``: every weight dequantised to float32 ``nn.Linear``, the reference model)."""
    path = Path(path)
    log = log or (lambda line: print(line, file=sys.stderr))
    weights = _check(path)
    config, tok = gguf_config_and_tokenizer(path, tokenizer)
    model = _skeleton(config)
    tensors = _Tensors(weights, config)
    names = gguf.get_tensor_name_map(_arch_enum(weights.architecture), config.num_hidden_layers)
    native, why = kernels.status()
    dequantised: dict[str, list[str]] = {}
    split_kv_b: list[str] = []
    _, experts = _fused_experts(model, tensors, path, float_act, dequantize_all)
    for mod_name, module in list(model.named_modules()):
        base = names.get_name(mod_name)
        if base is None and mod_name == "lm_head":  # an architecture whose map has no output (gemma2: always tied)
            base = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT]
        if base is None:
            _bare_parameters(module, mod_name, names, tensors, path)
            continue
        _bare_buffers(module, mod_name, names, tensors, path)
        if isinstance(module, nn.Linear):
            key = f"{base}.weight"
            if not tensors.has(key) and mod_name == "lm_head":
                key = names.get_name("model.embed_tokens") + ".weight"  # tied head: the embedding's blocks
            joined = _joined_kv_b(tensors, base, path) if not tensors.has(key) else None
            if joined is not None:
                _check_shape(path, " + ".join(KV_B_HALVES), joined.shape, f"{mod_name}.weight",
                             (module.out_features, module.in_features))
                module.weight = nn.Parameter(joined, requires_grad=False)
                split_kv_b.append(mod_name)
                continue
            if not tensors.has(key):
                raise InvalidInputError(f"{path}: no tensor {key} for {mod_name}")
            qt = tensors.blocks(key)
            if len(qt.shape) == 1 and module.out_features == 1:  # a one-row matrix the converter wrote 1-D
                qt = replace(qt, data=qt.data.reshape(1, -1), shape=(1, *qt.shape))  # (Qwen2-MoE's shared-expert gate)
            _check_shape(path, key, qt.shape, f"{mod_name}.weight", (module.out_features, module.in_features))
            bias = tensors.dense(f"{base}.bias") if tensors.has(f"{base}.bias") else None
            # a format no kernel reads (a float type, or no native kernels here) is a plain float32 linear:
            # the executor packs and runs it as a folder's (QuantLinear would hold it outside the native stack)
            dense = dequantize_all or native is None or qt.format.name not in kernels.NATIVE_FORMATS
            if dense and not dequantize_all:
                dequantised.setdefault(qt.format.name, []).append(key)
            if dense:
                lin = nn.Linear(module.in_features, module.out_features, bias=bias is not None)
                lin.weight = nn.Parameter(qt.dequantize(), requires_grad=False)
                if bias is not None:
                    lin.bias = nn.Parameter(bias, requires_grad=False)
                model.set_submodule(mod_name, lin)
                continue
            model.set_submodule(mod_name, QuantLinear(qt, bias, float_act))
        else:
            for pname, param in list(module.named_parameters(recurse=False)):
                key = f"{base}.{pname}"
                if not tensors.has(key):
                    raise InvalidInputError(f"{path}: no tensor {key} for {mod_name}.{pname}")
                value = tensors.dense(key)
                _check_shape(path, key, value.shape, f"{mod_name}.{pname}", param.shape)
                module._parameters[pname] = nn.Parameter(value, requires_grad=False)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise InvalidInputError(f"{path}: no GGUF tensor found for {', '.join(left[:5])}")
    _rope_freqs(model, tensors, path)
    unused = sorted(set(weights.tensors) - tensors.used)
    if unused:  # said, not refused: what transformers' model of the file has no place for is not computed
        log(f"flexplan: {len(unused)} tensors of the file have no place in transformers' {type(model).__name__} "
            f"and are not used: {', '.join(unused[:6])}{' ...' if len(unused) > 6 else ''}")
    for fmt, keys in dequantised.items():
        if BY_NAME[fmt].is_float:  # stored unquantised: nothing to run on blocks
            log(f"flexplan: {len(keys)} {fmt} linear weights run as float32 (the file stores them unquantised)")
            continue
        reason = "no native kernel for it" if native is not None else f"native kernels unavailable: {why}"
        log(f"flexplan: {len(keys)} {fmt} linear weights dequantised to float32 at load ({reason})")
    if split_kv_b and not dequantize_all:
        log(f"flexplan: MLA's kv_b_proj of {len(split_kv_b)} layers put back together from the file's "
            f"{' and '.join(KV_B_HALVES)} halves, dequantised to float32")
    if experts and not dequantize_all:
        log(f"flexplan: the routed experts of {len(experts)} layers dequantised to float32 at load (a format no "
            "kernel reads here, or an experts module not on transformers' routed interface)")
    model.config.tie_word_embeddings = False  # the head holds its own blocks; nothing to tie again
    model.flexplan_gguf = {"path": str(path), "formats": weights.formats()}
    return model, tok
