"""`flexplan profile-experts MODEL --prompts FILE --out FILE`: take a routing profile
(``flexplan.routing_profile``) by running a MoE model's routers on a few prompts, for
``flexplan explain --routing-profile`` / ``flexplan run --routing-profile`` to size and price the
cache of most-used CPU experts from."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flexplan import routing_profile
from flexplan.api import load
from flexplan.errors import FlexplanError, InvalidInputError
from flexplan.inputs import gib_bytes
from flexplan.measure import routing
from flexplan.run_cmd import model_folder
from flexplan.workload.model import ModelSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="HuggingFace model folder (config.json and weights)")
    parser.add_argument("--prompts", required=True, metavar="FILE", help="text file, one prompt per line")
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write the profile (JSON)")
    parser.add_argument("--new-tokens", type=int, default=16, metavar="N",
                        help="greedy tokens generated per prompt, their decode steps counted too (default 16)")
    parser.add_argument("--accelerator", default=None, metavar="{cuda,cpu,none}",
                        help="run the model with flexplan on this device (default: cuda if available)")
    parser.add_argument("--gpu-memory", type=gib_bytes, default=None, metavar="GiB", help="GPU memory budget in GiB")


def read_prompts(path) -> list[str]:
    """Non-empty lines of ``path``; a clear error for a missing file or one without a prompt."""
    path = Path(path)
    try:
        lines = [ln.strip() for ln in path.read_text().splitlines()]
    except OSError as e:
        raise InvalidInputError(f"cannot read --prompts {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise InvalidInputError(f"--prompts {path} is not UTF-8 text (one prompt per line)") from None
    prompts = [ln for ln in lines if ln]
    if not prompts:
        raise InvalidInputError(f"--prompts {path} holds no prompt (one per line)")
    return prompts


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except FlexplanError as e:
        print(f"flexplan profile-experts: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.new_tokens < 0:
        raise InvalidInputError(f"--new-tokens must be >= 0, got {args.new_tokens}")
    prompts = read_prompts(args.prompts)
    folder = model_folder(args.model)
    from transformers import AutoConfig, AutoTokenizer


    if not ModelSpec.from_config(AutoConfig.from_pretrained(folder)).is_moe:
        raise InvalidInputError(f"{folder} is a dense model: it has no routers to profile")
    import torch


    tokenizer = AutoTokenizer.from_pretrained(folder)
    accelerator = None if args.accelerator == "none" else args.accelerator
    lm = load(folder, accelerator=accelerator, gpu_memory_bytes=args.gpu_memory)

    def one(ids):
        lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max(1, args.new_tokens),
                    do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)

    profile = routing.take(lm.model, prompts, tokenizer, run=one)
    profile = routing_profile.RoutingProfile(folder.name, profile.num_layers, profile.num_experts,
                                             profile.experts_per_token, profile.counts, profile.tokens, profile.prompts)
    path = routing_profile.save(profile, args.out)
    tokens = sum(profile.tokens.values()) // len(profile.tokens)
    top = {i: max(c) / max(1, profile.tokens[i]) for i, c in profile.counts.items()}
    print(f"routing profile of {folder.name}: {profile.prompts} prompts, {tokens} tokens per MoE layer, "
          f"{len(profile.counts)} MoE layers; most-used expert picked by {100 * min(top.values()):.0f}-"
          f"{100 * max(top.values()):.0f}% of tokens (per layer); written to {path}")
    return 0
