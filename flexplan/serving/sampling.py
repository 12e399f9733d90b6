"""Per-request sampling over next-token logits, the end-of-sequence tokens, and incremental
detokenization with stop strings.

Sampling follows transformers' ``generate()``: temperature, then top-k, then top-p (nucleus:
the smallest set of tokens whose probability reaches ``top_p``), then a draw; ``temperature=0``
or ``top_k=1`` is the argmax. Each request draws from its own ``torch.Generator`` on the CPU, so a
seeded request repeats its tokens whatever else shares its batch.

Text comes out incrementally as vLLM's detokenizer does it: the new tokens are decoded together
with a few tokens before them (so a word-piece's leading space or a multi-byte character is
decoded in context), and text ending in an incomplete character (U+FFFD) waits for the next
token. Stop strings are searched in the text so far; the text returned stops before the first
one, and text that might still become a stop string is held back until it cannot.
"""

from __future__ import annotations

import torch

from flexplan.serving.types import SamplingParams

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first new one: its leading space in context


def request_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's own generator: from its seed, else seeded from torch's global generator (so a
    program that calls ``torch.manual_seed`` repeats too); None for greedy requests."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator(device="cpu").manual_seed(seed)


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row of logits [vocab] after temperature, top-k and top-p (removed tokens -inf)."""
    x = logits / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        # transformers' TopPLogitsWarper: drop the tokens whose ascending cumulative probability
        # stays within 1 - top_p; the most likely token always stays
        sorted_x, order = torch.sort(x, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum <= 1 - params.top_p
        drop[-1] = False
        x = x.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return x


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """The next token of each row of ``logits`` [rows, vocab] (float32, CPU)."""
    out = logits.argmax(-1).tolist()  # greedy rows: one op for the batch
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            probs = filtered_logits(logits[i], p).softmax(-1)
            out[i] = int(torch.multinomial(probs, 1, generator=g).item())
    return out


def eos_token_ids(model, tokenizer=None) -> frozenset[int]:
    """The tokens that end a sequence: the model's generation_config (what ``generate()`` stops
    at), else its config, else the tokenizer's."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else (int(e) for e in eos))
    return frozenset()


class Detokenizer:
    """A request's generated text, produced token by token, cut before its first stop string."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix, self._read = 0, len(self._ids)
        self.text = ""  # decoded so far (cut at a stop string once found)
        self._emitted = 0  # characters of text returned so far
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> None:
        """Add a generated token; sets :attr:`stopped` when the text now holds a stop string."""
        if self.tokenizer is None or self.stopped:
            return
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        old = len(self.text)
        self.text += now[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        if self.stop:
            start = max(0, old - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True

    def _held(self) -> int:
        """Characters at the end of the text that begin a stop string (not returned yet)."""
        if self.stopped:
            return 0
        return max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)

    def new_text(self, final: bool = False) -> str:
        """Text not returned before; the tail that could begin a stop string waits unless ``final``."""
        end = len(self.text) if final else len(self.text) - self._held()
        out = self.text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return out
