"""Bundled HuggingFace configs (no hub is reachable): ``catalog/<org>--<name>.json``."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from flexplan.errors import MalformedDataError, UnknownModelError, suggest
from flexplan.workload.gguf_config import hf_config_dict, spec_from_gguf
from flexplan.workload.gguf_header import is_gguf_path, read_header
from flexplan.workload.model import ModelSpec


def _catalog_dir():
    return resources.files("flexplan.workload") / "catalog"


@lru_cache(maxsize=1)
def _catalog_files() -> dict[str, Any]:
    out = {}
    for entry in _catalog_dir().iterdir():
        if entry.name.endswith(".json"):
            out[entry.name[: -len(".json")].replace("--", "/")] = entry
    return out


def catalog_names() -> list[str]:
    return sorted(_catalog_files())


@lru_cache(maxsize=64)
def _load_catalog_spec(model_id: str) -> ModelSpec:
    entry = _catalog_files()[model_id]
    try:
        cfg = json.loads(entry.read_text())
    except json.JSONDecodeError as e:
        raise MalformedDataError(f"bundled config for {model_id} is corrupt: {e}") from None
    return ModelSpec.from_config(cfg, name=model_id)


def config_dict(model: str) -> dict | None:
    """The HuggingFace config of a catalog id (as :func:`resolve_model` matches it), of a
    ``config.json`` / model folder path or of a GGUF file (its metadata); None for anything else."""
    if is_gguf_path(model) and Path(model).expanduser().is_file():
        return hf_config_dict(read_header(Path(model).expanduser()))
    files = _catalog_files()
    key = ({k.lower(): k for k in files}.get(model.lower())
           or {k.split("/")[-1].lower(): k for k in files}.get(model.lower()))
    path = Path(model).expanduser()
    source = files[key] if key else (path / "config.json" if path.is_dir() else path)
    try:
        return json.loads(source.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def resolve_model(model: Any) -> ModelSpec:
    """A catalog id (case-insensitive, org optional), a config.json / model folder path, a GGUF
    file (its metadata only, never its tensors), a ``PretrainedConfig``, a loaded model (its
    ``.config``) or a :class:`ModelSpec`."""
    if isinstance(model, ModelSpec):
        return model
    if hasattr(model, "config") and hasattr(model.config, "to_dict"):
        return ModelSpec.from_config(model.config)
    if not isinstance(model, (str, Path)):
        return ModelSpec.from_config(model)
    if is_gguf_path(model):
        return spec_from_gguf(model)
    text = str(model)
    files = _catalog_files()
    lowered = {k.lower(): k for k in files}
    short = {k.split("/")[-1].lower(): k for k in files}
    key = lowered.get(text.lower()) or short.get(text.lower())
    if key:
        return _load_catalog_spec(key)
    path = Path(text).expanduser()
    if path.exists():
        return ModelSpec.from_config(path)
    raise UnknownModelError(
        f"unknown model {text!r}: not in the bundled catalog and not a local config.json or model folder."
        + suggest(text, files) + " (`flexplan models` lists the catalog)"
    )
