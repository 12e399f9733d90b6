"""A small deterministic stand-in for flexplan.serving.engine.Engine (the same methods), so the
HTTP front's tests run in a fraction of a second and without torch: each step() gives every
running request its next letter ('a', 'b', ...), a request holds one KV block per 4 tokens.

Also runnable as a server (``python tests/serving_double.py PORT``) for the SIGTERM test."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque

from flexplan.errors import InvalidInputError
from flexplan.serving.types import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    MODE_CPU_ONLY,
    EngineStats,
    RequestOutput,
    SamplingParams,
)

BLOCK_TOKENS = 4


class CharTokenizer:
    """One token per character (its code point); a chat template that prefixes roles."""

    chat_template = "{role}: {content}\n"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(self.chat_template.format(**m) for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


class DoubleEngine:
    def __init__(self, max_model_len: int = 64, max_running: int = 4, blocks: int = 64, step_s: float = 0.005):
        self.tokenizer, self.max_model_len, self.max_running = CharTokenizer(), max_model_len, max_running
        self.blocks, self.step_s = blocks, step_s
        self.gate = threading.Event()  # cleared: step() waits (a test holds requests in the queue)
        self.gate.set()
        self.fail_next = False  # the next step() raises, as an engine bug would
        self.main_thread_only = False  # step() refuses any thread but the main one (server.run's rule)
        self.waiting: deque = deque()
        self.running: dict[str, dict] = {}
        self.aborted: list[dict] = []
        self.iterations = self.prompt_total = self.generated_total = 0

    def add_request(self, request_id: str, prompt, params: SamplingParams) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(ids) >= self.max_model_len:
            raise InvalidInputError(f"the prompt has {len(ids)} tokens; this model's context is "
                                    f"{self.max_model_len} tokens")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidInputError(f"max_tokens={params.max_tokens} exceeds the context")
        self.waiting.append({"id": request_id, "n": len(ids), "params": params, "out": [], "text": ""})
        self.prompt_total += len(ids)

    def abort(self, request_id: str) -> bool:
        r = self.running.pop(request_id, None) or next((w for w in self.waiting if w["id"] == request_id), None)
        if r is None:
            return False
        if r in self.waiting:
            self.waiting.remove(r)
        self.aborted.append(r)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.aborted)

    def _used(self) -> int:
        return sum(-(-(r["n"] + len(r["out"])) // BLOCK_TOKENS) for r in self.running.values())

    def stats(self) -> EngineStats:
        used = self._used()
        return EngineStats(waiting=len(self.waiting), running_by_device={"accelerator": 0, "cpu": len(self.running)},
                           blocks_used={"host": used}, blocks_free={"host": self.blocks - used},
                           iterations=self.iterations, last_mode=MODE_CPU_ONLY if self.iterations else "",
                           prompt_tokens_total=self.prompt_total, generated_tokens_total=self.generated_total,
                           blocks_cached={"host": 0})

    def step(self) -> list[RequestOutput]:
        if self.main_thread_only and threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"step() on {threading.current_thread().name}, not the main thread")
        self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("a bug in the engine")
        outs = [RequestOutput(r["id"], (), "", True, FINISH_ABORT, r["n"], len(r["out"])) for r in self.aborted]
        self.aborted = []
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting.popleft()
            self.running[r["id"]] = r
        time.sleep(self.step_s)
        self.iterations += 1
        for rid, r in list(self.running.items()):
            letter = chr(ord("a") + len(r["out"]) % 26)
            r["out"].append(ord(letter))
            r["text"] += letter
            self.generated_total += 1
            p, reason, text = r["params"], None, letter
            hit = next((s for s in p.stop if s in r["text"]), None)
            if hit:
                reason, text = FINISH_STOP, letter[:max(0, len(letter) - len(hit))]
            elif len(r["out"]) >= p.max_tokens:
                reason = FINISH_LENGTH
            outs.append(RequestOutput(rid, (r["out"][-1],), text, reason is not None, reason, r["n"], len(r["out"])))
            if reason:
                del self.running[rid]
        return outs


if __name__ == "__main__":  # a server over the double, for the SIGTERM test
    from flexplan.serving import server

    engine = DoubleEngine(max_model_len=4096, step_s=0.05)
    engine.main_thread_only = True  # server.run steps the engine on the thread that calls it
    server.run(server.create_app(engine, "double", drain_s=float(sys.argv[2])), port=int(sys.argv[1]),
               log_level="warning")
