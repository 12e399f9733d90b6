"""One request inside the engine: its prompt and the tokens it generated, how many of them its KV
blocks hold, its sampler state, and when it finishes (an end-of-sequence token, a stop string,
max_tokens, or the model's context full)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flexplan.serving.sampling import Detokenizer
from flexplan.serving.state import RequestState
from flexplan.serving.types import (
    FINISH_LENGTH,
    FINISH_STOP,
    RequestOutput,
    SamplingParams,
)


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: int  # order of add_request
    generator: torch.Generator | None  # its own draws (None: greedy)
    detok: Detokenizer
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV the blocks hold
    new_tokens: list[int] = field(default_factory=list)  # since the last output
    finish_reason: str | None = None
    # the prefix cache's names of its whole blocks, for the tokens it had then: (token count, names)
    block_names: tuple[int, list[bytes]] = field(default_factory=lambda: (-1, []), repr=False, compare=False)
    # how many of those names the cache held when last looked, and the caches' forgotten-names count then
    names_cached: tuple[int, int] = field(default=(-1, 0), repr=False, compare=False)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def decoding(self) -> bool:
        """Its KV holds every token but the last generated one: its next step is a decode."""
        return bool(self.output) and self.computed == len(self.prompt) + len(self.output) - 1

    def view(self, pool: str | None, shared_blocks: int = 0) -> RequestState:
        """What a scheduler sees of it (``pool``: where its blocks are, None while it waits;
        ``shared_blocks``: its blocks other requests hold too)."""
        left = 0 if self.decoding and pool is not None else len(self.prompt) + len(self.output) - self.computed
        return RequestState(self.request_id, len(self.prompt), left, self.computed, len(self.output),
                            self.params.max_tokens, pool, self.arrival, shared_blocks)

    def append(self, token: int, eos: frozenset[int], max_model_len: int) -> None:
        """A sampled token; finished by EOS (unless ignore_eos) or a stop string ("stop"), else by
        max_tokens or a full context ("length")."""
        self.output.append(token)
        self.new_tokens.append(token)
        self.detok.push(token)
        if (token in eos and not self.params.ignore_eos) or self.detok.stopped:
            self.finish_reason = FINISH_STOP
        elif len(self.output) >= self.params.max_tokens or len(self.prompt) + len(self.output) >= max_model_len:
            self.finish_reason = FINISH_LENGTH

    def take_output(self) -> RequestOutput:
        """Its tokens and text since the last output (the text held back for a stop string is
        released once it finishes)."""
        done = self.finish_reason is not None
        out = RequestOutput(self.request_id, tuple(self.new_tokens), self.detok.new_text(final=done), done,
                            self.finish_reason, len(self.prompt), len(self.output))
        self.new_tokens = []
        return out
