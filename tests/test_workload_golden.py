"""Golden values: per-layer FLOPs and bytes against hand calculations written out here."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexplan.workload import catalog_names, costs, resolve_model


def test_llama2_7b_by_hand():
    m = resolve_model("meta-llama/Llama-2-7b-hf")
    h, i, heads, hd, v = 4096, 11008, 32, 128, 32000
    assert (m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim) == (h, i, heads, heads, hd)
    # q, k, v, o are h x h (no GQA in Llama-2-7B); SwiGLU has gate, up, down of h x i.
    linear = 4 * h * h + 3 * h * i
    assert linear == 202_375_168
    assert m.params_per_layer == linear + 2 * h  # two RMSNorm weights
    # embeddings + untied LM head + final norm: the published 6,738,415,616 parameters
    assert m.total_params == 32 * (linear + 2 * h) + 2 * v * h + h == 6_738_415_616

    # C_Prefill, batch 1, 512 tokens: 2 x tokens x weights + causal attention 4 x heads x hd x s(s+1)/2
    assert costs.c_prefill(m, 1, 512) == 2 * 512 * linear + 4 * heads * hd * (512 * 513 // 2) == 209_383_849_984
    # C_Decode at 1024 keys, batch 4
    assert costs.c_decode(m, 4, 1024) == 4 * (2 * linear + 4 * heads * hd * 1024) == 1_686_110_208
    # D_KVCache at 1024 tokens, batch 1, bf16: K and V, 32 heads x 128
    assert costs.d_kv_cache(m, 1, 1024, 2) == 2 * 1024 * 4096 * 2 == 16_777_216
    # weights in bf16 and fp32
    assert costs.d_weights(m, 2) == 2 * (linear + 2 * h) == 404_766_720
    assert costs.d_weights(m, 4) == 809_533_440
    # D_Output: batch 8, one token, bf16 hidden state
    assert costs.d_output(m, 8, 1, 2) == 8 * 4096 * 2
    # D_CPU->GPU in decode with the KV on the host: weights + KV of 1000 cached tokens
    assert costs.d_cpu_to_gpu(m, 1, 1000, 2, 2, kv_on_host=True) == 404_766_720 + 2 * 1000 * 4096 * 2
    assert costs.d_cpu_to_gpu(m, 1, 1000, 2, 2, kv_on_host=False) == 404_766_720


def test_opt_66b_by_hand():
    m = resolve_model("facebook/opt-66b")
    h, f, heads, v, pos = 9216, 36864, 72, 50272, 2048
    linear = 4 * h * h + 2 * h * f  # q, k, v, out_proj; fc1, fc2 (plain ReLU MLP)
    assert m.linear_weight_params_per_layer == linear == 1_019_215_872
    biases = 4 * h + f + h  # q, k, v, out_proj biases; fc1 (f) and fc2 (h)
    layer_norms = 2 * 2 * h  # self_attn_layer_norm and final_layer_norm, weight + bias
    assert m.params_per_layer == linear + biases + layer_norms == 1_019_335_680
    # tied LM head; learned positions have max_position_embeddings + 2 rows
    assert m.total_params == 64 * (linear + biases + layer_norms) + v * h + (pos + 2) * h + 2 * h == 65_719_701_504
    s = 512
    assert costs.c_prefill(m, 16, s) == 16 * (2 * s * linear + 4 * h * (s * (s + 1) // 2))
    assert costs.d_kv_cache(m, 16, 544, 2) == 2 * 16 * 544 * h * 2
    # LM head (tied embedding) FLOPs for the last position only, and bytes with the final norm
    assert costs.c_lm_head(m, 16) == 2 * 16 * h * v
    assert costs.d_lm_head(m, 2) == (v * h + 2 * h) * 2


def test_gqa_and_head_dim_override():
    m = resolve_model("meta-llama/Meta-Llama-3-70B")
    assert (m.num_heads, m.num_kv_heads, m.head_dim, m.kv_dim) == (64, 8, 128, 1024)
    # GQA: k and v projections are h x (kv heads x head_dim)
    assert m.linear_weight_params_per_layer == 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    from flexplan.workload.model import ModelSpec

    cfg = dict(model_type="llama", hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=96, intermediate_size=512, vocab_size=1000)
    s = ModelSpec.from_config(cfg)
    assert (s.q_dim, s.kv_dim) == (384, 192)
    assert s.linear_weight_params_per_layer == 256 * 384 + 2 * 256 * 192 + 384 * 256 + 3 * 256 * 512


def test_decode_terms_grow_with_context():
    m = resolve_model("meta-llama/Llama-2-7b-hf")
    ctx = np.array([100.0, 200.0, 400.0])
    c = costs.c_decode(m, 1, ctx)
    kv = costs.d_kv_cache(m, 1, ctx, 2)
    assert np.all(np.diff(c) > 0) and np.all(np.diff(kv) > 0)
    assert kv[1] == 2 * kv[0]


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-7B", "mistralai/Mistral-7B-v0.1", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_other_families_parse(name):
    m = resolve_model(name)
    assert m.total_params > 0 and costs.c_prefill(m, 1, 16) > 0


def test_sliding_window_layers_by_hand():
    """Gemma 3 27B: 52 of its 62 layers see the last 1024 tokens, 10 see everything."""
    m = resolve_model("google/gemma-3-27b-it")
    h, heads, kvh, hd, i = 5376, 32, 16, 128, 21504
    assert m.layer_types.count("sliding_attention") == 52 and m.sliding_window == 1024
    assert [k for k, t in enumerate(m.layer_types) if t == "full_attention"] == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    linear = h * heads * hd + 2 * h * kvh * hd + heads * hd * h + 3 * h * i
    assert m.linear_weight_params_per_layer == linear
    per_pair = 4 * heads * hd  # QK^T + AV, K and V heads both 128 wide

    # Prefill, 2048 tokens: a full layer has s(s+1)/2 pairs; a sliding one 1024*1025/2 for
    # the first 1024 queries, then 1024 keys for each of the other 1024.
    full, sliding = 2048 * 2049 // 2, 1024 * 1025 // 2 + 1024 * 1024
    assert (full, sliding) == (2_098_176, 1_573_376)
    mean_pairs = (10 * full + 52 * sliding) / 62
    assert costs.c_prefill(m, 1, 2048) == pytest.approx(2 * 2048 * linear + per_pair * mean_pairs, rel=1e-12)
    # Below the window nothing is capped.
    assert costs.c_prefill(m, 1, 512) == pytest.approx(2 * 512 * linear + per_pair * 512 * 513 / 2, rel=1e-12)

    # Decode at 4096 keys, batch 2: sliding layers read 1024 keys.
    keys = (10 * 4096 + 52 * 1024) / 62
    assert costs.c_decode(m, 2, 4096) == pytest.approx(2 * (2 * linear + per_pair * keys), rel=1e-12)
    kv_per_token = 2 * kvh * hd * 2  # K and V, bf16
    assert costs.d_kv_cache(m, 2, 4096, 2) == pytest.approx(2 * kv_per_token * keys, rel=1e-12)
    # The KV cache MEMORY stays full-length in every layer (the executor keeps the context).
    assert costs.kv_cache_bytes_per_layer(m, 2, 4096, 2) == 2 * 4096 * kv_per_token
    assert costs.d_kv_write(m, 2, 4096, 2) == 2 * 4096 * kv_per_token


def test_mistral_window_caps_kv_reads_at_4096():
    m = resolve_model("mistralai/Mistral-7B-v0.1")
    assert m.sliding_window == 4096 and set(m.layer_types) == {"sliding_attention"}
    assert costs.d_kv_cache(m, 1, 8192, 2) == costs.d_kv_cache(m, 1, 4096, 2) == 2 * 4096 * 1024 * 2
    assert costs.kv_cache_bytes_per_layer(m, 1, 8192, 2) == 2 * 8192 * 1024 * 2


def test_moe_mixtral_by_hand_batch_1_and_8():
    """Mixtral 8x7B: 8 experts of SwiGLU width 14336, 2 per token, every layer MoE."""
    m = resolve_model("mistralai/Mixtral-8x7B-v0.1")
    h, i, e, k, heads, kvh, hd = 4096, 14336, 8, 2, 32, 8, 128
    attn = 2 * h * h + 2 * h * kvh * hd  # q, o: h x h; k, v: h x 1024
    expert = 3 * h * i
    router = e * h
    layer = attn + router + e * expert + 2 * h  # + two RMSNorms
    assert (m.expert_params, m.params_per_layer) == (expert, layer) == (176_160_768, 1_451_270_144)
    # FLOPs count what a token runs: attention, router, k = 2 experts.
    active_linear = attn + router + k * expert
    assert m.linear_weight_params_per_layer == active_linear == 394_297_344
    assert costs.c_decode(m, 8, 100) == 8 * (2 * active_linear + 4 * heads * hd * 100)
    assert costs.c_prefill(m, 1, 64) == 2 * 64 * active_linear + 4 * heads * hd * 64 * 65 / 2

    # Activations per token: q, k, v, o in/out + attention Q read and output write, then the
    # router (h in, E out) and per expert 2(h+i) + (i+h) + 2i.
    act = (h + h) + 2 * (h + kvh * hd) + (h + h) + 2 * h + (h + e) + k * (2 * (h + i) + (i + h) + 2 * i)
    assert costs.activation_elems_per_token(m) == act == 206_856

    # Decode weight bytes (bf16): batch 1 reads its 2 experts; batch 8 the expected distinct
    # experts 8 * (1 - (6/8)^8) = 7.199 of 8.
    assert costs.expected_experts_read(m, 1) == pytest.approx(2.0)
    distinct_8 = 8 * (1 - 0.75 ** 8)
    assert costs.expected_experts_read(m, 8) == pytest.approx(distinct_8) and distinct_8 == pytest.approx(7.19909668)
    assert costs.d_decode(m, 1, 2, 2) == pytest.approx(2 * (layer - 6 * expert) + 1 * act * 2, rel=1e-12)
    assert costs.d_decode(m, 8, 2, 2) == pytest.approx(2 * (layer - (8 - distinct_8) * expert) + 8 * act * 2,
                                                        rel=1e-12)
    # Prefill reads every expert; memory and streaming hold every expert.
    assert costs.d_prefill(m, 1, 64, 2, 2) == 2 * layer + 64 * act * 2
    assert costs.d_weights(m, 2) == 2 * layer
    assert costs.d_cpu_to_gpu(m, 1, 10, 2, 2, kv_on_host=False) == 2 * layer


def test_moe_dense_first_layers_average_into_per_layer_values():
    """DeepSeek-V3: 3 dense layers then 58 MoE layers; per-layer values are the mean."""
    m = resolve_model("deepseek-ai/DeepSeek-V3")
    assert m.moe_layers == (False,) * 3 + (True,) * 58
    h, heads, nope, rope, v, q_rank, kv_rank = 7168, 128, 128, 64, 128, 1536, 512
    # MLA: q_a, its norm, q_b; kv_a (latent + shared rope key), its norm, kv_b; o
    attn = (h * q_rank + q_rank + q_rank * heads * (nope + rope) + h * (kv_rank + rope) + kv_rank
            + kv_rank * heads * (nope + v) + heads * v * h)
    assert attn == 187_107_328
    dense = attn + 3 * h * 18432 + 2 * h
    moe = attn + 256 * h + 256 * 3 * h * 2048 + 3 * h * 2048 + 2 * h  # router, 256 experts, 1 shared
    assert (m.layer_params(0), m.layer_params(3)) == (dense, moe) == (583_483_392, 11_507_286_016)
    assert m.params_per_layer == pytest.approx((3 * dense + 58 * moe) / 61)
    assert 61 * costs.d_weights(m, 1) == pytest.approx(m.layers_params)


def test_moe_decode_at_batch_1_reads_the_active_layer_weights():
    """Qwen3-30B-A3B: a single token reads its 8 experts of 128 per layer, not all of them."""
    m = resolve_model("Qwen/Qwen3-30B-A3B")
    active_layers = sum(m.active_layer_params(i) for i in range(m.num_layers))
    assert m.num_layers * costs.d_weights_read_decode(m, 1, 2) == pytest.approx(2 * active_layers, rel=1e-12)
    assert m.num_layers * costs.d_weights(m, 2) == 2 * m.layers_params
    assert costs.d_weights_read_decode(m, 1, 2) < costs.d_weights(m, 2) / 8


# Properties that hold for every catalog model.
MODELS = st.sampled_from(catalog_names())


@settings(max_examples=60, deadline=None)
@given(MODELS, st.integers(1, 256), st.integers(1, 256))
def test_more_tokens_never_read_fewer_weights(name, b1, b2):
    m = resolve_model(name)
    lo, hi = sorted((b1, b2))
    assert costs.d_weights_read_decode(m, lo, 2) <= costs.d_weights_read_decode(m, hi, 2) <= costs.d_weights(m, 2)
    if m.is_moe:
        assert m.experts_per_token <= costs.expected_experts_read(m, lo) + 1e-9
        assert costs.expected_experts_read(m, hi) <= m.num_experts


@settings(max_examples=60, deadline=None)
@given(MODELS, st.integers(1, 200_000), st.integers(1, 4096))
def test_kv_reads_never_exceed_kv_memory_and_grow_with_context(name, ctx, extra):
    m = resolve_model(name)
    read = float(costs.d_kv_cache(m, 2, ctx, 2))
    ulps = 1 + 1e-12  # a mean over layers (sliding ones capped at their window): CI met 5914624.000000001
    assert read <= costs.kv_cache_bytes_per_layer(m, 2, ctx, 2) * ulps
    assert read <= float(costs.d_kv_cache(m, 2, ctx + extra, 2)) * ulps
    assert costs.c_decode(m, 2, ctx) <= costs.c_decode(m, 2, ctx + extra)
    assert costs.c_prefill(m, 1, min(ctx, 8192)) <= costs.c_prefill(m, 1, min(ctx, 8192) + extra)


def test_chunked_attention_layers_by_hand():
    """Llama 4 style: 3 of 4 layers attend within chunks of 8 tokens, 1 over everything."""
    from flexplan.workload.model import ModelSpec

    m = ModelSpec.from_config(dict(
        model_type="llama4_text", hidden_size=64, intermediate_size=96, intermediate_size_mlp=80, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=4, vocab_size=128, attention_chunk_size=8,
        layer_types=["chunked_attention"] * 3 + ["full_attention"], num_local_experts=4, num_experts_per_tok=1))
    assert [m.layer_chunk(i) for i in range(4)] == [8, 8, 8, None]
    per_pair = 4 * 4 * 16
    # 20 tokens: chunks of 8, 8 and 4 -> 36 + 36 + 10 pairs; a full layer 20*21/2 = 210.
    pairs = (3 * (36 + 36 + 10) + 210) / 4
    gemm = 2 * 20 * m.linear_weight_params_per_layer
    assert costs.c_prefill(m, 1, 20) == pytest.approx(gemm + per_pair * pairs, rel=1e-12)
    # Decode at context 20 (the new token is 20th): a chunked layer sees keys 17..20, 4 of them.
    keys = (3 * 4 + 20) / 4
    assert costs.d_kv_cache(m, 1, 20, 2) == pytest.approx(2 * 2 * 16 * 2 * keys, rel=1e-12)
    assert costs.kv_cache_bytes_per_layer(m, 1, 20, 2) == 20 * 2 * 2 * 16 * 2
