"""Take a routing profile: run prompts through an MoE model and count which experts each layer's
router picks (``flexplan profile``). The profile itself, its file format and its reading by the
planner are ``flexplan.routing_profile``; this is the measuring half, above the executor."""

from __future__ import annotations

import torch

from flexplan.errors import InvalidInputError, UnsupportedModelError
from flexplan.executor.cpu_experts import find_routed_experts
from flexplan.executor.families import decoder_parts
from flexplan.routing_profile import RoutingProfile
from flexplan.workload.model import ModelSpec


def take(model, prompts, tokenizer=None, max_new_tokens: int = 0, run=None) -> RoutingProfile:
    """Run ``model`` (a transformers causal LM) on each prompt (text with ``tokenizer``, or a 1-D
    tensor / list of token ids) and count its routers' choices per MoE layer; with
    ``max_new_tokens`` > 0 the greedy continuation's decode steps are counted too. ``run(ids)``:
    how to run one prompt instead (e.g. a flexplan-loaded model's generate: the hooks sit on
    ``model``'s modules, whoever calls them)."""

    spec = ModelSpec.from_config(model.config)
    if not spec.is_moe:
        raise InvalidInputError(f"{spec.name} is a dense model: it has no routers to profile")
    counts = {i: torch.zeros(spec.num_experts, dtype=torch.long) for i, x in enumerate(spec.moe_layers) if x}
    tokens = dict.fromkeys(counts, 0)
    hooks = []

    def hook(layer):
        def pre(module, args, kwargs):
            idx = (list(args) + list(kwargs.values()))[1] if len(args) + len(kwargs) > 1 else None
            if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype.is_floating_point:
                raise UnsupportedModelError(f"layer {layer}'s experts module of {spec.name} is not called with the "
                                            "router's expert ids (transformers' fused-experts interface)")
            flat = idx.reshape(-1).cpu()
            flat = flat[(flat >= 0) & (flat < spec.num_experts)]
            counts[layer] += torch.bincount(flat, minlength=spec.num_experts)
            tokens[layer] += int(idx.shape[0])
        return pre

    layers = decoder_parts(model).layers
    try:
        for i in counts:
            found = find_routed_experts(layers[i], spec.num_experts)
            if found is None:
                raise UnsupportedModelError(f"layer {i} of {spec.name} is a MoE layer but no routed experts module "
                                            f"with {spec.num_experts} experts was found in it")
            hooks.append(found[1].register_forward_pre_hook(hook(i), with_kwargs=True))
        n = 0
        for p in prompts:
            ids = tokenizer(p, return_tensors="pt").input_ids if isinstance(p, str) else torch.as_tensor(p).reshape(1, -1)
            if ids.numel() == 0:
                continue
            with torch.no_grad():
                if run is not None:
                    run(ids)
                elif max_new_tokens > 0:
                    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                   do_sample=False)
                else:
                    model(input_ids=ids)
            n += 1
    finally:
        for h in hooks:
            h.remove()
    if n == 0:
        raise InvalidInputError("no non-empty prompt to profile the routers on")
    return RoutingProfile(spec.name, spec.num_layers, spec.num_experts, spec.experts_per_token,
                          {i: tuple(c.tolist()) for i, c in counts.items()}, tokens, n)
