"""Golden values: per-layer FLOPs and bytes against hand calculations written out here."""

import numpy as np
import pytest

from flexplan.workload import costs, resolve_model


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
