"""Streaming a safetensors folder straight into place, without a full copy first."""

from __future__ import annotations

import pytest
import torch

import flexplan.api as api
from flexplan.executor import cpu_linear, loading
from flexplan.executor.link import Link
from flexplan.executor.plans import fixed_plan

from conftest import left_padded_batch

GIB = 1 << 30


@pytest.fixture
def saved(reference_models, more_models, tmp_path_factory, one_thread):
    def save(family, shard="100KB"):
        path = tmp_path_factory.mktemp(family)
        ref = reference_models[family] if family in reference_models else more_models[family]
        ref.save_pretrained(path, max_shard_size=shard)
        return path, ref
    return save


@pytest.mark.parametrize("family,prefill,decode", [
    ("llama", "gpu-offload", "splitgen"),  # tied embeddings, several shards
    ("opt350", "cpu", "gpu-offload-partial"),
    ("qwen2", "gpu", "cpu"),
    ("gemma2", "gpu-offload", "splitgen"),  # tied, scaled embedding, sliding layers: streamed tensor by tensor
    ("falcon", "splitgen", "gpu-offload-partial"),  # "transformer.h" layers
    ("mixtral", "gpu-offload", "splitgen"),  # per-expert checkpoint tensors: transformers converts them on load
])
def test_load_from_folder_matches_transformers(saved, family, prefill, decode):
    path, ref = saved(family)
    assert len(list(path.glob("*.safetensors"))) > 1
    plan = fixed_plan(ref.config, prefill, decode, 2, batch_size=3, input_len=9, output_len=5)
    lm = api.load(path, plan=plan, accelerator="cpu", gpu_memory_bytes=GIB)
    ids, mask = left_padded_batch()
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False), expected)
    assert not any(p.device.type == "meta" for p in lm.model.parameters())


def test_streaming_reads_each_tensor_once_into_its_flat_buffer(saved, monkeypatch):
    path, ref = saved("llama")
    reads, direct = [], []
    original, original_into = loading.SafetensorsSource.__call__, loading.SafetensorsSource.read_into

    def read_into(self, name, dst):
        done = original_into(self, name, dst)
        if done:
            reads.append(name)
            direct.append(name)
        return done

    monkeypatch.setattr(loading.SafetensorsSource, "__call__", lambda self, name: reads.append(name) or original(self, name))
    monkeypatch.setattr(loading.SafetensorsSource, "read_into", read_into)
    plan = fixed_plan(ref.config, "splitgen", "splitgen", 2, batch_size=1, input_len=8, output_len=4)
    link = Link("cpu")
    model = loading.load_streaming(path, plan, link, gpu_memory_bytes=GIB)
    names = [n for n, _ in model.named_parameters()]
    # each tensor read once; the tied LM head is read once more, for its accelerator copy
    assert sorted(reads) == sorted(names)
    assert "lm_head.weight" in names
    # fp32 on disk, fp32 flat buffers: every tensor of a flat buffer is read straight into it
    # (packed CPU linears go through a temporary: they are reordered into their own memory)
    packed = {n for n, p in model.named_parameters() if cpu_linear.is_packed(p)}
    assert direct and set(direct) | packed >= set(names) - {"lm_head.weight"}
    placed = sum(b.nbytes for b in link.live_buffers())
    weights = sum(p.numel() * 4 for p in ref.parameters())  # tied: the embedding counted once
    # nothing beyond the flat buffers; the head (norm + tied LM head) lives on the accelerator only,
    # so the embedding matrix exists twice (host lookup, accelerator LM head). Blocked on the host, the
    # embedding holds whole blocks of 64 rows (zero past the vocabulary) outside the embedding unit's
    # flat buffer, which is then empty (one byte: Link.alloc(max(n, 1)))
    emb = model.get_input_embeddings().weight
    blocked_extra = ((cpu_linear.blocked_rows(emb_rows := ref.config.vocab_size) - emb_rows) * emb.shape[1] * 4 + 1
                     if cpu_linear.is_blocked(emb) else 0)
    assert placed == weights + ref.lm_head.weight.numel() * 4 + blocked_extra
    ids, mask = left_padded_batch((6,))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False))
