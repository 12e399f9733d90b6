"""The accelerator's cache of a CPU-experts layer's most-used routed experts (``Plan.expert_cache``,
chosen by ``flexplan.plan_expert_cache``).

A layer whose routed experts compute on the CPU (``executor.cpu_experts``) keeps a copy of K of
them in accelerator memory, in the accelerator dtype, as a second experts module of the same class
whose expert-indexed parameters hold only those K ([K, ...], ascending expert id). A step then
maps each (token, choice) to its cache slot: the pairs whose expert is cached compute on the
accelerator (``cpu_experts.split_forward``: ``routed_experts_forward`` of the cached module, the others skipped as sentinels),
the rest go to the host as before, the cached ones there replaced by a sentinel; the two partial
outputs add up on the accelerator. A step whose every pair hits does not go to the host at all.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from flexplan.errors import InvalidInputError, UnsupportedModelError
from flexplan.executor.link import ACCELERATOR, H2D


class CachedExperts:
    """K routed experts of one layer's experts ``module`` on the accelerator."""

    def __init__(self, module: nn.Module, ids, dense_of, link, dtype: torch.dtype, layer: int):
        """``ids``: the expert ids to cache; ``dense_of(leaf)``: the [E, ...] host tensor of the
        module's parameter ``leaf`` in its stored (unblocked) layout; ``link``: allocates the
        accelerator buffer and logs the copies."""

        num_experts = int(next(p for p in module._parameters.values() if p is not None).shape[0])
        self.ids = tuple(sorted(int(e) for e in ids))
        if not self.ids or not all(0 <= e < num_experts for e in self.ids) or len(set(self.ids)) != len(self.ids):
            raise UnsupportedModelError(f"expert cache of layer {layer}: expert ids {list(ids)} are not distinct ids "
                                        f"in 0..{num_experts - 1}")
        leaves = [n for n, p in module._parameters.items() if p is not None]
        others = [n for n, p in module.named_parameters() if "." in n]
        if others:
            raise UnsupportedModelError(f"layer {layer}'s experts module holds parameters of submodules ({others[0]}); "
                                        "its experts cannot be cached apart; plan without a routing profile")
        dense = {n: dense_of(n) for n in leaves}
        if any(t.shape[0] != num_experts for t in dense.values()):
            raise UnsupportedModelError(f"layer {layer}'s experts module has a parameter not indexed by expert")
        # expert-indexed buffers too (QuantExperts' biases); float tensors in the cache's dtype, blocks as they are
        indexed = {n: b for n, b in module._buffers.items() if b is not None and b.dim() and b.shape[0] == num_experts}
        tensors = {**dense, **indexed}
        kinds = {n: dtype if t.is_floating_point() else t.dtype for n, t in tensors.items()}
        k = len(self.ids)
        sizes = {n: -(-k * t[0].numel() * torch.empty(0, dtype=kinds[n]).element_size() // 64) * 64
                 for n, t in tensors.items()}  # 64-byte aligned views, whatever each one's element
        self.nbytes = sum(sizes.values())
        self.buffer = link.alloc(self.nbytes, ACCELERATOR, f"expert cache, layer {layer}")
        self.module = copy.copy(module)
        self.module.__dict__["_parameters"] = {}
        self.module.__dict__["_buffers"] = dict(module._buffers)
        self.module.__dict__.pop("forward", None)  # the executor's instance-level forward
        index = torch.tensor(self.ids)
        offset = 0
        for n, t in tensors.items():
            nbytes = k * t[0].numel() * torch.empty(0, dtype=kinds[n]).element_size()
            view = self.buffer.tensor[offset:offset + nbytes].view(kinds[n]).view(k, *t.shape[1:])
            link.copy(view, t.index_select(0, index).to(kinds[n]), H2D, "expert cache", layer)
            (self.module._parameters if n in dense else self.module._buffers)[n] = view
            offset += sizes[n]
        self.slot_of = torch.full((num_experts,), -1, dtype=torch.long)
        self.slot_of[index] = torch.arange(k)
        self.slot_of = self.slot_of.to(link.device)
        self.num_experts = num_experts
        self.dtype = dtype

    def release(self, link) -> None:
        link.free(self.buffer)
        self.buffer = None


def place_caches(expert_modules: list, layers: list, placement, cache, link, dtype: torch.dtype) -> None:
    """Give each layer ``cache`` (a Plan's ExpertCache; None: none) names a :class:`CachedExperts`
    built from its host copy (``layers[i]``: its GroupWeights); the previous caches are freed first.
    ``expert_modules[i]``: (experts module, cpu_experts.ExpertsPlace) or None."""

    for found in expert_modules:
        if found is not None and found[1].cached is not None:
            found[1].cached.release(link)
            found[1].cached = None
    if cache is None:
        return
    for i, ids in cache.experts.items():
        if not (0 <= i < len(expert_modules) and expert_modules[i] is not None
                and ACCELERATOR not in placement.expert_places(i)):
            raise InvalidInputError(f"the plan's expert cache names layer {i}, which has no routed experts kept off "
                                    "the accelerator under this plan; plan again with the routing profile")
        module, place = expert_modules[i]
        g = layers[i]
        st = next(st for p, st in g.storages.items() if p != ACCELERATOR and st.part != "rest")
        prefix = next(iter(g.experts)).rsplit(".", 1)[0]
        place.cached = CachedExperts(module, ids, lambda leaf, g=g, st=st, prefix=prefix: g.dense(
            f"{prefix}.{leaf}", st.views[f"{prefix}.{leaf}"]), link, dtype, i)
