"""FlexModel.generate's own loop for a plain greedy request decoded by the native CPU stack.

Rule: where every decode step runs in the native stack's one call, transformers' ``generate()``
loop around it (its logits processors, stopping criteria and kwargs' bookkeeping, in Python) is a
large share of a small model's time per token, so a request it would decode plainly is decoded
here: transformers' ``generate()`` itself makes the prefill and the first token, then each step is
the model's forward (the executor's hooks and statistics as ever) and an argmax of its logits, as
transformers' greedy search takes it, until an end-of-sequence token or the length.

Taken only where the tokens are transformers' by construction (:func:`plain_greedy`): one prompt
(batch 1, no padding) in flexplan's cache, its generation settings merged by transformers' own
code, greedy, one beam and one sequence, no logits processor or stopping criterion beyond the
end-of-sequence tokens and the length, no argument beyond the prompt, its mask and a streamer, the
sequences tensor returned. Anything else runs transformers' loop. A streamer is fed as transformers'
loop feeds it (the prompt, then each new token as a [1] tensor, then ``end()``): a streamed request
(``flexplan run``'s answer, a ``TextStreamer``) decodes as fast as one that is not.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from flexplan.executor.families import CACHE_KWARG

# Generation settings, as transformers' _prepare_generation_config merges them (the call's, then the
# model's, then its defaults): those that do not change a plain greedy search (the lengths and
# special tokens it follows, sampling's and beams' and an assistant's, which it never reads), and
# those that must hold their no-op values; any other setting away from its default: transformers' loop
ANY_VALUE = frozenset({
    "max_new_tokens", "max_length", "eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id",
    "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h",
    "length_penalty", "early_stopping", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "_from_model_config",
    "transformers_version",
})
NO_OP = {"do_sample": (False,), "num_beams": (1,), "num_return_sequences": (1,), "num_beam_groups": (1,),
         "use_cache": (True,), "min_length": (0,), "min_new_tokens": (0,), "repetition_penalty": (1.0,),
         "encoder_repetition_penalty": (1.0,), "no_repeat_ngram_size": (0,), "encoder_no_repeat_ngram_size": (0,),
         "diversity_penalty": (0.0,), "remove_invalid_values": (False,), "renormalize_logits": (False,),
         "output_attentions": (False,), "output_hidden_states": (False,), "output_scores": (False,),
         "output_logits": (False,), "return_dict_in_generate": (False,)}
MODEL_ARGUMENTS = frozenset({"attention_mask"})  # besides generation settings, what generate()'s call may carry
STREAMER = "streamer"  # generate()'s own argument, not a model's: fed here as transformers' loop feeds it


def plain_greedy(model, inputs, generation_config, kwargs: dict[str, Any]):
    """The merged generation config of a request this loop decodes as transformers would, its
    ``max_new_tokens`` set (from ``max_length`` where only that was given), else None
    (transformers' loop then runs it)."""
    x = inputs if inputs is not None else kwargs.get("input_ids")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != 1 or kwargs.get(CACHE_KWARG) is None:
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and bool(mask.all())):
        return None
    prepare = getattr(model, "_prepare_generation_config", None)  # transformers' own merge, where it has one
    if prepare is None:
        return None
    try:
        gc, model_kwargs = prepare(generation_config, **{k: v for k, v in kwargs.items()
                                                         if k not in ("input_ids", CACHE_KWARG, STREAMER)})
    except Exception:  # noqa: BLE001 - whatever transformers refuses, its own loop says so
        return None
    if set(model_kwargs) - MODEL_ARGUMENTS:
        return None
    for k, v in gc.to_diff_dict().items():
        if k not in ANY_VALUE and v not in NO_OP.get(k, ()):
            return None
    if gc.max_new_tokens is None:
        gc.max_new_tokens = (gc.max_length or 0) - x.shape[1]
    return gc if gc.max_new_tokens >= 1 else None


def eos_ids(gc) -> frozenset[int]:
    e = gc.eos_token_id
    return frozenset() if e is None else frozenset([int(e)] if isinstance(e, int) else map(int, e))


def generate(model, inputs, gc, kwargs: dict[str, Any]) -> torch.Tensor:
    """The sequences [1, prompt + new] transformers' greedy search gives for this plain request."""
    x = inputs if inputs is not None else kwargs["input_ids"]
    args = {k: v for k, v in kwargs.items() if k in MODEL_ARGUMENTS or k == CACHE_KWARG}
    streamer = kwargs.get(STREAMER)
    first = copy.deepcopy(gc)
    first.max_new_tokens, first.max_length = 1, None
    if streamer is not None:  # transformers' order: the prompt, each token as it is chosen, then end()
        streamer.put(x.cpu())
    seq = model.generate(x, generation_config=first, **args)  # the prefill and its token, transformers' own
    cache, eos = args.get(CACHE_KWARG), eos_ids(gc)
    tokens = [seq[:, -1:]]
    if streamer is not None:
        streamer.put(tokens[-1].reshape(-1).cpu())
    with torch.no_grad():
        for _ in range(gc.max_new_tokens - 1):
            if int(tokens[-1]) in eos:
                break
            logits = model(input_ids=tokens[-1], use_cache=True, **{CACHE_KWARG: cache}).logits
            # greedy search's choice: the float32 logits of the last position, their first largest
            tokens.append(torch.argmax(logits[:, -1, :].float(), dim=-1, keepdim=True))
            if streamer is not None:
                streamer.put(tokens[-1].reshape(-1).cpu())
    if streamer is not None:
        streamer.end()
    return torch.cat([seq] + tokens[1:], dim=1) if len(tokens) > 1 else seq
