"""The paged KV pools: sizes worked by hand, allocation, growth, freeing, swaps that carry the
data, clear errors when a pool is full, and no block ever lost or shared (a property)."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from flexplan.errors import DoesNotFitError, InvalidInputError
from flexplan.serving.kv_blocks import (
    DEVICE,
    HOST,
    BlockManager,
    activation_reserve_bytes,
    block_bytes,
    blocks_in_bytes,
    pool_blocks,
)

# 2 layers, 2 KV heads of 16 dims: one token of one layer stores K and V, 2 x 2 x 16 = 64 elements
CONFIG = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def manager(device_blocks=4, host_blocks=4, bs=4, prefix_caching=True) -> BlockManager:
    return BlockManager(CONFIG, device_blocks=device_blocks, host_blocks=host_blocks, dtype=torch.float32,
                        device="cpu", block_size_tokens=bs, prefix_caching=prefix_caching)


def test_prefix_cache_by_hand():
    """Blocks of 4 tokens: a's 10 computed tokens name 2 full blocks; b's prompt shares 9 of them and
    takes those 2 (8 tokens); c's equal to a's first 8 takes 1 only (never the last token); the
    named blocks outlive their requests and are taken back last, the least recently released first."""
    m = manager(device_blocks=0, host_blocks=6, bs=4)
    a = list(range(10))
    m.append("a", 10, HOST)
    m.commit("a", a, 10)
    pool = m.pools[HOST]
    assert pool.cached_blocks == 2 and m.pools[HOST].free_blocks == 3
    assert m.match_prefix("b", a[:9] + [99], HOST) == 8
    assert m.tables["b"].blocks == m.tables["a"].blocks[:2] and m.shared_blocks("b") == 2
    assert m.match_prefix("c", a[:8], HOST) == 4
    assert m.shared_blocks("a") == 2 and pool.holders(m.tables["a"].blocks[0]) == 3
    m.free("a")
    assert pool.free_blocks == 4  # a's own third block only: the shared two are still held
    m.free("b"), m.free("c")
    assert pool.free_blocks == 6 and pool.used_blocks == 0 and pool.cached_blocks == 2
    first, second = (m.match_prefix("d", a, HOST), m.tables["d"].blocks)
    assert first == 8 and pool.free_blocks == 4
    m.free("d")
    names = m.prefix_names(a)
    assert len(names) == 2 and all(m.cached(n) for n in names) and m.names_forgotten == 0
    taken = pool.take(5)  # the 4 free blocks, then the evictable one released first (d's second block)
    assert second[1] in taken and second[0] not in taken and pool.cached_blocks == 1
    assert m.names_forgotten == 1 and m.cached(names[0]) and not m.cached(names[1])
    assert m.match_prefix("e", a, HOST) == 4  # its first block is still named
    assert m.prefix_hit_tokens == 8 + 4 + 8 + 4 and m.prefix_query_tokens == 10 + 8 + 10 + 10


def test_prefix_caching_off_matches_nothing():
    m = manager(device_blocks=0, host_blocks=6, bs=4, prefix_caching=False)
    m.append("a", 10, HOST)
    m.commit("a", list(range(10)), 10)
    assert m.match_prefix("b", list(range(10)), HOST) == 0 and m.pools[HOST].cached_blocks == 0


def test_block_bytes_by_hand():
    # 2 layers x 16 tokens x 64 elements x 4 bytes = 8192 bytes a block
    assert block_bytes(CONFIG, torch.float32, 16) == 2 * 16 * 64 * 4 == 8192
    assert block_bytes(CONFIG, torch.bfloat16, 16) == 4096
    assert blocks_in_bytes(8192 * 10 + 8191, CONFIG, torch.float32, 16) == 10
    assert blocks_in_bytes(0, CONFIG, torch.float32) == 0
    m = manager(3, 5, bs=16)
    assert m.pools[DEVICE].k.shape == m.pools[DEVICE].v.shape == (2, 3, 16, 2, 16)
    assert (m.pools[HOST].k.numel() + m.pools[HOST].v.numel()) * 4 == 5 * 8192


def test_a_latent_cache_has_k_and_v_of_their_own_widths():
    """MLA caches a latent: K the kv_lora_rank (16), V the shared rotary key (8), one head each."""
    cfg = transformers.DeepseekV3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                                        q_lora_rank=None)
    assert block_bytes(cfg, torch.float32, 16) == 1 * 16 * (16 + 8) * 4
    m = BlockManager(cfg, device_blocks=0, host_blocks=3, dtype=torch.float32, device="cpu", block_size_tokens=16)
    assert m.pools[HOST].k.shape == (1, 3, 16, 1, 16) and m.pools[HOST].v.shape == (1, 3, 16, 1, 8)


def test_append_grows_by_blocks_and_free_returns_them():
    m = manager()
    m.append("a", 5, DEVICE)  # 5 tokens: 2 blocks of 4
    assert len(m.tables["a"].blocks) == 2 and m.num_tokens("a") == 5
    assert m.extra_blocks("a", 3) == 0 and m.extra_blocks("a", 4) == 1
    m.append("a", 3)
    assert len(m.tables["a"].blocks) == 2
    m.append("a", 1)
    assert len(m.tables["a"].blocks) == 3
    assert m.usage() == ({DEVICE: 3, HOST: 0}, {DEVICE: 1, HOST: 4})
    slots = m.slots("a", 0, 9).tolist()
    b = m.tables["a"].blocks
    assert slots == [b[0] * 4 + i for i in range(4)] + [b[1] * 4 + i for i in range(4)] + [b[2] * 4]
    assert m.slots("a", 3, 6).tolist() == slots[3:6]
    m.free("a")
    assert m.usage() == ({DEVICE: 0, HOST: 0}, {DEVICE: 4, HOST: 4})
    m.free("a")  # freeing twice is harmless


def test_a_full_pool_says_so_and_changes_nothing():
    m = manager(device_blocks=2)
    m.append("a", 8, DEVICE)
    assert not m.can_allocate(DEVICE, "b", 1) and m.can_allocate(HOST, "b", 16)
    with pytest.raises(DoesNotFitError, match="can_allocate"):
        m.append("b", 1, DEVICE)
    assert "b" not in m.tables and m.num_tokens("a") == 8
    with pytest.raises(InvalidInputError, match="name the pool"):
        m.append("c", 1)
    with pytest.raises(InvalidInputError, match="swap"):
        m.append("a", 1, HOST)
    with pytest.raises(InvalidInputError, match="pools are"):
        m.append("d", 1, "gpu")
    with pytest.raises(InvalidInputError, match="block_size_tokens"):
        manager(bs=0)


def test_swap_moves_the_data_between_pools():
    m = manager(device_blocks=4, host_blocks=4)
    m.append("x", 6, DEVICE)  # a neighbour so the blocks differ between pools
    m.append("a", 6, DEVICE)
    dev = m.pools[DEVICE]
    k, v = torch.randn(2, 6, 2, 16), torch.randn(2, 6, 2, 16)
    dev.k_slots[:, m.slots("a", 0, 6)], dev.v_slots[:, m.slots("a", 0, 6)] = k, v
    m.swap("a", HOST)
    assert m.pool_of("a") == HOST and m.usage()[0] == {DEVICE: 2, HOST: 2}
    host = m.pools[HOST]
    assert torch.equal(host.k_slots[:, m.slots("a", 0, 6)], k) and torch.equal(host.v_slots[:, m.slots("a", 0, 6)], v)
    m.append("h", 4, HOST)
    m.swap("a", DEVICE)
    assert torch.equal(dev.k_slots[:, m.slots("a", 0, 6)], k) and torch.equal(dev.v_slots[:, m.slots("a", 0, 6)], v)
    m.append("y", 4, HOST)  # the device pool is full (x and a): y stays where it is
    with pytest.raises(DoesNotFitError):
        m.swap("y", DEVICE)
    assert m.pool_of("y") == HOST and m.usage()[0] == {DEVICE: 4, HOST: 2}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "free", "swap", "commit", "match"]), st.integers(0, 3),
                          st.integers(1, 9)), max_size=40))
def test_blocks_are_never_lost_and_shared_only_through_the_prefix_cache(ops):
    """Any appends, frees, swaps, commits of computed tokens and prefix matches (every request's
    tokens a prefix of one sequence, so matches happen): a block is held by exactly the requests
    that count it, free or evictable when none does, never both; each table covers its tokens."""
    m = manager(device_blocks=5, host_blocks=5, bs=4)
    tokens = list(range(100, 140))
    for op, r, n in ops:
        rid = f"r{r}"
        try:
            if op == "append":
                m.append(rid, n, None if rid in m.tables else (DEVICE if n % 2 else HOST))
            elif op == "free":
                m.free(rid)
            elif op == "commit" and rid in m.tables:
                m.commit(rid, tokens, m.num_tokens(rid))
            elif op == "match" and rid not in m.tables:
                got = m.match_prefix(rid, tokens[:4 * n + 1], DEVICE if n % 2 else HOST)
                assert got % 4 == 0 and got <= 4 * n
            elif op == "swap" and rid in m.tables:
                m.swap(rid, HOST if m.pool_of(rid) == DEVICE else DEVICE)
        except DoesNotFitError:
            pass
        for name, pool in m.pools.items():
            held = [b for t in m.tables.values() if t.pool == name for b in t.blocks]
            assert all(held.count(b) == pool.holders(b) for b in held) and len(set(held)) == pool.used_blocks
            idle = set(pool._free) | set(pool._evictable)
            assert set(held).isdisjoint(idle) and len(pool._free) + len(pool._evictable) == len(idle)
            assert len(idle) + len(set(held)) == pool.num_blocks
            assert set(pool._evictable) <= set(pool._name_of) and set(pool._free).isdisjoint(pool._name_of)
        for rid, t in m.tables.items():
            assert len(t.blocks) == m.blocks_for(t.num_tokens)
            # shared_blocks scans the named blocks only: no other block of the table is shared
            assert m.shared_blocks(rid) == sum(1 for b in t.blocks if m.pools[t.pool].holders(b) > 1)


def test_pool_sizes_from_a_memory_budget_by_hand():
    """A device budget of the weights + one iteration's activations + 10.5 blocks gives 10 blocks.
    Activations for a budget of 8 tokens, hidden 64, intermediate 128, vocab 128, 4 running, fp32:
    8 x (8 x 64 + 3 x 128) x 4 + 4 x 128 x 4 = 28672 + 2048 bytes."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(CONFIG).eval()
    weights = sum(p.numel() * 4 for p in model.parameters()) + sum(b.numel() * b.element_size()
                                                                   for b in model.buffers())
    reserve = activation_reserve_bytes(CONFIG, 8, 4, torch.float32)
    assert reserve == 8 * (8 * 64 + 3 * 128) * 4 + 4 * 128 * 4
    block = block_bytes(CONFIG, torch.float32, 16)
    got = pool_blocks(model, device=torch.device("cpu"), block_size_tokens=16, token_budget=8, max_running=4,
                      device_memory_bytes=weights + reserve + 10 * block + block // 2, host_memory_bytes=3 * block)
    assert got == (10, 3)
    assert pool_blocks(model, device=torch.device("cpu"), block_size_tokens=16, token_budget=8, max_running=4,
                       device_memory_bytes=weights, host_memory_bytes=0) == (0, 0)  # nothing left for KV
    # no budget, the model on the CPU: no device pool; the host pool within its default cap
    dev, host = pool_blocks(model, device=torch.device("cpu"), block_size_tokens=16, token_budget=8, max_running=4)
    assert dev == 0 and 0 < host * block <= 2 * 2**30
