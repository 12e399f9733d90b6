"""Load a model folder (config.json + *.safetensors) straight into its final places.

The module skeleton is built on the meta device (parameters only; small buffers such as the
rotary frequencies are computed for real), then the shards are read tensor by tensor with
``readinto`` and copied directly into each unit's flat buffers (pinned host, CPU-dtype host or
accelerator). Peak host memory stays near the model's placed size plus one tensor, instead of
a full model loaded first and copied again.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from flexplan.errors import InvalidInputError, MalformedDataError
from flexplan.executor.families import check_supported
from flexplan.executor.link import Link
from flexplan.executor.runner import Executor
from flexplan.plan_types import Plan


def is_model_folder(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def read_config(path):
    from transformers import AutoConfig

    p = Path(path)
    if not (p / "config.json").is_file():
        raise InvalidInputError(f"{p} is not a model folder: it has no config.json (expected config.json + *.safetensors)")
    try:
        return AutoConfig.from_pretrained(str(p))
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise MalformedDataError(f"cannot read {p / 'config.json'}: {e}") from None


def own_module_tree(model: torch.nn.Module) -> torch.nn.Module:
    """A module tree of its own for the executor that runs ``model``: every module, Parameter and
    attribute object new (a deep copy), every parameter's and buffer's data ``model``'s own (shared,
    not copied). The executor fills its buffers from those tensors without writing to them, then
    rebinds, packs, re-forwards and hooks only the copy: ``model`` stays as it was and usable, and
    can be loaded again under another plan. A flexplan-placed tree is refused (:func:`refuse_placed_tree`)."""
    refuse_placed_tree(model)
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach(), requires_grad=False)  # a tied weight stays one Parameter
    for b in model.buffers():
        memo[id(b)] = b
    return copy.deepcopy(model, memo)


def refuse_placed_tree(model: torch.nn.Module) -> torch.nn.Module:
    """``model``, unless an executor already placed it (``FlexModel.model``, a model handed over with
    ``flexplan.load(..., keep_model=False)``, the result of :func:`load_streaming`): its weights are
    then in flexplan's layouts and dtypes, not as loaded, so it cannot be placed again."""
    if getattr(model, "flexplan_executor", None) is not None:
        raise InvalidInputError(
            f"this {type(model).__name__} is a module tree flexplan already placed for a plan (FlexModel.model, a "
            "model loaded with keep_model=False, or load_streaming's result): its weights are held in flexplan's "
            "layouts and dtypes, not as loaded; pass the model you gave flexplan.load (with keep_model=True, the "
            "default, it is left as it was) or the model folder to load it under another plan")
    return model


def build_skeleton(config) -> torch.nn.Module:
    """The ``*ForCausalLM`` module tree with parameters on meta (no memory) and real buffers."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    check_supported(config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def read_safetensors_header(path: Path) -> tuple[dict[str, dict], int]:
    """(tensor name -> {dtype, shape, data_offsets}, byte offset where the data starts)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n < 100 << 20:
                raise ValueError(f"header length {n}")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise MalformedDataError(f"{path} is not a readable safetensors file: {e}") from None
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsSource:
    """``source(name) -> tensor``: one tensor read from the shard that holds it.

    Reads with plain ``readinto`` into a fresh tensor instead of memory-mapping the shards
    (``safe_open``): mapped pages of a shard stay resident (and in RSS) while it is open, which
    doubled peak host memory. Each tensor read here is freed once the caller has copied it into
    its final place, so peak host memory is the placed model plus the largest tensor.
    """

    def __init__(self, folder, tied: dict[str, str] | None = None, reuse_buffer: bool = False):
        """``reuse_buffer``: every call reads into one scratch buffer (sized for the largest
        tensor, freed by ``close``), so the returned tensor is valid only until the next call.
        The loader consumes each tensor at once; one buffer instead of a fresh allocation per
        tensor keeps the heap from fragmenting between the packed weights it is creating."""
        self.folder = Path(folder)
        self.reuse_buffer = reuse_buffer
        self._scratch: torch.Tensor | None = None
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise InvalidInputError(f"{self.folder} has no *.safetensors shards")
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for f in files:
            header, data_start = read_safetensors_header(f)
            for k, meta in header.items():
                self._where[k] = (f, meta, data_start)
        self.tied = tied or {}

    def key_for(self, name: str) -> str:
        for cand in (name, name.removeprefix("model."), f"model.{name}"):
            if cand in self._where:
                return cand
        if name in self.tied:
            return self.key_for(self.tied[name])
        raise MalformedDataError(f"{self.folder}: no tensor {name!r} in the safetensors shards")

    def holds_all(self, names) -> bool:
        """Whether every tensor ``names`` asks for is in the shards under a name we can map."""
        try:
            for name in names:
                self.key_for(name)
        except MalformedDataError:
            return False
        return True

    def _entry(self, name: str) -> tuple[str, Path, torch.dtype, list[int], int, int]:
        key = self.key_for(name)
        path, meta, data_start = self._where[key]
        dtype = SAFETENSORS_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise MalformedDataError(f"{path}: tensor {key!r} has unsupported dtype {meta['dtype']}")
        begin, end = meta["data_offsets"]
        return key, path, dtype, list(meta["shape"]), data_start + begin, end - begin

    @staticmethod
    def _read(path: Path, key: str, offset: int, nbytes: int, out: torch.Tensor) -> None:
        with open(path, "rb") as f:
            f.seek(offset)
            got = f.readinto(out.numpy())
        if got != nbytes:
            raise MalformedDataError(f"{path} is truncated: tensor {key!r} needs {nbytes} bytes, read {got}")

    def __call__(self, name: str) -> torch.Tensor:
        key, path, dtype, shape, offset, nbytes = self._entry(name)
        if self.reuse_buffer:
            if self._scratch is None or self._scratch.numel() < nbytes:
                largest = max(m["data_offsets"][1] - m["data_offsets"][0] for _, m, _ in self._where.values())
                self._scratch = torch.empty(largest, dtype=torch.uint8)
            raw = self._scratch[:nbytes]
        else:
            raw = torch.empty(nbytes, dtype=torch.uint8)
        self._read(path, key, offset, nbytes, raw)
        return raw.view(dtype).reshape(shape)

    def read_into(self, name: str, dst: torch.Tensor) -> bool:
        """Read ``name`` straight into ``dst`` when it is a contiguous host tensor of the same
        dtype and shape (no intermediate copy); False when a conversion is needed instead."""
        key, path, dtype, shape, offset, nbytes = self._entry(name)
        if (dst.device.type != "cpu" or dst.dtype != dtype or list(dst.shape) != shape
                or not dst.is_contiguous() or dst.is_mkldnn):
            return False
        self._read(path, key, offset, nbytes, dst.view(-1).view(torch.uint8))
        return True

    def close(self) -> None:
        self._where.clear()
        self._scratch = None


def load_streaming(path, plan: Plan, accelerator: str | Link = "cuda", *, gpu_memory_bytes: int | None = None,
                   pinned_memory_budget_bytes: int | None = None, cpu_cores: int | None = None,
                   cpu_linear_kernel: str | None = None) -> torch.nn.Module:
    """A ``*ForCausalLM`` whose weights were streamed from ``path`` into the places ``plan``
    needs, with the executor installed (``model.flexplan_executor``); its ``generate()`` runs
    the plan (use ``flexplan.load`` for per-request KV caches and statistics)."""

    link = accelerator if isinstance(accelerator, Link) else Link(accelerator)
    config = read_config(path)
    model = build_skeleton(config)
    tied = {}
    if getattr(config, "tie_word_embeddings", False):
        emb = model.get_input_embeddings()
        emb_name = next(n for n, m in model.named_modules() if m is emb)
        tied["lm_head.weight"] = f"{emb_name}.weight"
    source = SafetensorsSource(path, tied, reuse_buffer=True)
    if not source.holds_all(n for n, _ in model.named_parameters(remove_duplicate=False)):
        # a checkpoint whose tensors transformers converts on load (per-expert weights stacked into one
        # tensor, renamed modules): let transformers load it, then place the loaded model (peak host
        # memory: the whole model once more, until each unit is placed)
        source.close()
        source = None
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto").eval()
    try:
        executor = Executor(model, plan, link, source=source, accelerator_budget_bytes=gpu_memory_bytes,
                            pinned_budget_bytes=pinned_memory_budget_bytes, cpu_cores=cpu_cores,
                            cpu_linear_kernel=cpu_linear_kernel)
    finally:
        if source is not None:
            source.close()
    model.flexplan_executor = executor
    try:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(path))
    except (OSError, ValueError):
        pass
    return model
