"""Serving under load: flexplan's engine against one request at a time, llama-server and transformers serve.

An asyncio client replays request lengths from the Azure LLM code trace (``../shared/traces``) with
Poisson arrivals at each ``--rates`` value (requests/s), against each target in turn, round after
round (interleaved), a STREAM triad sample beside each run:

- ``flexplan``: ``flexplan serve`` (the engine, continuous batching) over HTTP; ``flexplan:OPTIONS``
  passes the server options after the colon, e.g. ``flexplan:--tpot-target-ms=150`` beside ``flexplan``;
- ``sequential``: flexplan's own ``generate()``, one request at a time, in a process of its own;
- ``llama-server``: llama.cpp's server (continuous batching, ``-np`` slots) on the same weights in the
  same precision (an F32 GGUF made from the shipped Q4_1 file with ``llama-quantize``: the values
  flexplan's float32 folder holds), the same threads;
- ``transformers``: ``transformers serve --continuous-batching`` on the same float32 folder;
- ``flexplan-q4_1``, ``llama-server-q4_1`` and ``sequential-q4_1`` (with ``--targets``): both servers
  and the one-at-a-time loop on the embedded model's own Q4_1 GGUF file, its blocks as they are
  (int8 activations in all).

Prompts are texts of random one-token words of the trace's lengths (the trace gives lengths, not
text), the output length forced (``ignore_eos``; transformers serve refuses the field, so its outputs
may end early: ``short_outputs`` counts them). The trace is scaled to the model and machine: each input length
divided by ``--input-scale`` and capped at ``--input-cap``, each output capped at ``--output-cap``
(the result says so). Per target and rate: request and token throughput, TTFT / TPOT / inter-token
latency p50 / p90 / p99 and goodput under the SLO (``--slo-ttft-s``, ``--slo-tpot-s``).

    python benchmarks/bench_serving_load.py --requests 32 --rates 0.5,1,2 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import functools
import json
import math
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import LLAMA_CPP_HOW, REPO_ROOT, llama_cpp_tool, machine_description, triad_gbs, write_result  # noqa: E402

TRACE = REPO_ROOT.parent / "shared" / "traces" / "azure_llm_2023_code.csv"
F32_GGUF = Path.home() / ".cache" / "flexplan" / "bench" / "SmolLM2-135M-Instruct.F32.gguf"
TARGETS = ("flexplan", "sequential", "llama-server", "transformers")
# the embedded model's own Q4_1 file served as it is by both engines (int8 activations in both)
GGUF_TARGETS = ("flexplan-q4_1", "llama-server-q4_1", "sequential-q4_1")


def trace_requests(n: int, input_scale: float, input_cap: int, output_cap: int, seed: int) -> list[tuple[int, int]]:
    """(input tokens, output tokens) of ``n`` consecutive trace requests from a seeded start, scaled."""
    with open(TRACE, newline="") as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    start = random.Random(seed).randrange(0, len(rows) - n)
    return [(max(1, min(input_cap, math.ceil(c / input_scale))), max(1, min(output_cap, g)))
            for c, g in rows[start:start + n]]


def arrivals_s(n: int, rate_per_s: float, seed: int) -> list[float]:
    """Poisson arrivals: exponential gaps of mean 1 / rate."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


@functools.lru_cache(maxsize=None)
def _one_token_words(model_dir: Path):
    """(the tokenizer, its words that are one token each: a leading space, letters)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    words = []
    for t, i in sorted(tok.get_vocab().items(), key=lambda x: x[1]):
        w = tok.convert_tokens_to_string([t])
        if len(w) > 3 and w[0] == " " and w[1:].isalpha() and tok.encode(w, add_special_tokens=False) == [i]:
            words.append(w)
    return tok, words


def prompts(lengths: list[tuple[int, int]], model_dir: Path, seed: int) -> list[str]:
    """Texts of the trace's lengths made of words that are one token each: every server gets the
    same text, and it tokenizes to exactly the length asked for. Each run draws its own (a seed per
    round and rate), so no server answers a prompt it has seen: none reuses a cached prefix."""
    tok, words = _one_token_words(model_dir)
    rng = random.Random(seed)
    out = []
    for n, _ in lengths:
        text = "".join(rng.choice(words) for _ in range(n))
        got = len(tok.encode(text, add_special_tokens=False))
        if got != n:
            raise SystemExit(f"a prompt of {n} one-token words tokenized to {got} tokens")
        out.append(text)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- targets


class HttpTarget:
    """A server started as a subprocess, answering OpenAI's /v1/completions with SSE streaming."""

    def __init__(self, name: str, cmd: list[str], port: int, model: str, env: dict | None = None,
                 forces_length: bool = True):
        self.name, self.cmd, self.port, self.model, self.env = name, cmd, port, model, env
        self.forces_length = forces_length  # takes ignore_eos (transformers serve refuses the field)
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log", delete=False)

    def start(self, timeout_s: float = 300.0) -> None:
        import httpx

        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited ({self.proc.returncode}); log: {self.log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} did not become healthy in {timeout_s:.0f} s; log: {self.log.name}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None

    async def request(self, client, ids: str, max_tokens: int) -> tuple[float, list[float], int]:
        """(send time, each streamed chunk's arrival time, completion tokens the server reports)."""
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
        if self.forces_length:
            body.update(ignore_eos=True, stream_options={"include_usage": True})
        t0, times, used = time.perf_counter(), [], None
        async with client.stream("POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{self.name}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    used = chunk["usage"].get("completion_tokens", used)
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
        return t0, times, used if used is not None else len(times)


def _sequential_worker(model: str, threads: int, conn) -> None:
    """The one-at-a-time target's own process: (text, max_tokens) in, (each token's time, tokens) out,
    until None. A process of its own, as every server target has, so the client's event loop never
    shares the GIL or the cores' time slices with the decode it times. The length is forced as
    ``ignore_eos`` forces the servers': no end-of-sequence token to stop at (a generation config
    without one), not ``min_new_tokens``, whose logits processor would cost each step and leave
    flexplan's own greedy loop for transformers'."""
    import copy

    import torch

    sys.path.insert(0, str(REPO_ROOT))
    import flexplan

    torch.set_num_threads(threads)
    lm = flexplan.load(model, dtype="float32")
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        text, max_tokens = msg
        ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
        config = copy.deepcopy(lm.model.generation_config)
        config.update(eos_token_id=None, max_new_tokens=max_tokens, min_new_tokens=None, do_sample=False)
        stamp = _Stamp()
        out = lm.generate(torch.tensor([ids]), generation_config=config, streamer=stamp)
        conn.send((stamp.times, int(out.shape[1]) - len(ids)))


class _Stamp:
    """transformers' streamer protocol: put() per new token, the prompt first. time.perf_counter()
    is CLOCK_MONOTONIC on Linux, the same clock in the client's process."""

    def __init__(self):
        self.times, self.first = [], True

    def put(self, value):
        if self.first:
            self.first = False
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


class SequentialTarget:
    """flexplan's own generate(), one request at a time (FIFO), in a worker process."""

    def __init__(self, model: Path, threads: int, name: str = "sequential"):
        self.model, self.threads, self.name = model, threads, name
        self.proc = self.conn = None
        self.lock = threading.Lock()

    def start(self, timeout_s: float = 300.0) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_sequential_worker, args=(str(self.model), self.threads, child), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(timeout_s):
            self.stop()
            raise SystemExit(f"{self.name}: the generate() worker did not load {self.model} in {timeout_s:.0f} s")
        self.conn.recv()

    def stop(self) -> None:
        if self.proc is not None:
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(20)
            if self.proc.is_alive():
                self.proc.kill()
        self.proc = None

    async def request(self, client, text: str, max_tokens: int) -> tuple[float, list[float], int]:
        t0 = time.perf_counter()

        def run():
            with self.lock:  # one request at a time: the next waits for this one's end
                self.conn.send((text, max_tokens))
                return self.conn.recv()

        times, n = await asyncio.to_thread(run)
        return t0, times, n


# ----------------------------------------------------------------------------- one run


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def replay(target, ids: list[list[int]], lengths, arrivals: list[float]) -> list[dict]:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()

        async def one(k: int) -> dict:
            await asyncio.sleep(max(0.0, start + arrivals[k] - time.perf_counter()))
            t0, times, n = await target.request(client, ids[k], lengths[k][1])
            return {"input": lengths[k][0], "output": n, "asked": lengths[k][1], "send": t0 - start,
                    "times": [t - start for t in times]}

        return await asyncio.gather(*(one(k) for k in range(len(ids))))


def summarise(runs: list[dict], slo_ttft_s: float, slo_tpot_s: float) -> dict:
    ttft = [r["times"][0] - r["send"] for r in runs if r["times"]]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in runs if len(r["times"]) > 1]
    itl = [b - a for r in runs for a, b in zip(r["times"], r["times"][1:])]
    makespan = max(r["times"][-1] for r in runs if r["times"]) - min(r["send"] for r in runs)
    good = sum(1 for r in runs if r["times"] and r["times"][0] - r["send"] <= slo_ttft_s
               and (len(r["times"]) < 2 or (r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) <= slo_tpot_s))
    out = {"requests": len(runs), "makespan_s": makespan, "request_throughput_per_s": len(runs) / makespan,
           "token_throughput_per_s": sum(r["output"] for r in runs) / makespan, "goodput_per_s": good / makespan,
           "short_outputs": sum(r["output"] < r["asked"] for r in runs)}
    for name, xs in (("ttft_s", ttft), ("tpot_s", tpot), ("itl_s", itl)):
        out.update({f"{name}_p{q}": pct(xs, q) for q in (50, 90, 99)})
    return out


def make_targets(names: list[str], model_dir: Path, threads: int, slots: int, ctx: int) -> dict:
    from flexplan.smollm import gguf_path

    out = {}
    for name in names:
        port = free_port()
        # a flexplan server's own options after a colon, e.g. "flexplan:--token-budget=64" (compared in one run)
        base, _, options = name.partition(":")
        if base in ("flexplan", "flexplan-q4_1"):
            weights = model_dir if base == "flexplan" else gguf_path()
            out[name] = HttpTarget(name, [sys.executable, "-m", "flexplan", "serve", str(weights), "--host",
                                          "127.0.0.1", "--port", str(port), *shlex.split(options)],
                                   port, weights.name)
        elif name == "sequential":
            out[name] = SequentialTarget(model_dir, threads)
        elif name == "sequential-q4_1":
            out[name] = SequentialTarget(gguf_path(), threads, name)
        elif name in ("llama-server", "llama-server-q4_1"):
            server = llama_cpp_tool("llama-server")
            if server is None:
                raise SystemExit(f"the {name} target needs llama.cpp's llama-server: {LLAMA_CPP_HOW}")
            weights = F32_GGUF if name == "llama-server" else gguf_path()
            if not weights.exists():
                raise SystemExit(f"the llama-server target needs {weights} (see docs/serve.md)")
            out[name] = HttpTarget(name, [str(server), "-m", str(weights), "-t", str(threads),
                                          "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx), "--no-cache-prompt", "--host",
                                          "127.0.0.1", "--port", str(port)], port, model_dir.name)
        elif name == "transformers":
            exe = shutil.which("transformers") or "transformers"
            out[name] = HttpTarget(name, [exe, "serve", "--continuous-batching", str(model_dir), "--host",
                                          "127.0.0.1", "--port", str(port)], port, str(model_dir), forces_length=False)
        else:
            raise SystemExit(f"unknown target {name!r}; use {', '.join(TARGETS + GGUF_TARGETS)}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rates", default="0.5,1,2", help="Poisson arrival rates, requests/s")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-scale", type=float, default=8.0)
    ap.add_argument("--input-cap", type=int, default=384)
    ap.add_argument("--output-cap", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--slots", type=int, default=16, help="llama-server's parallel slots")
    ap.add_argument("--slo-ttft-s", type=float, default=2.0)
    ap.add_argument("--slo-tpot-s", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="serving_load")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO_ROOT))
    from flexplan.smollm import default_model_dir

    model_dir = default_model_dir()
    lengths = trace_requests(args.requests, args.input_scale, args.input_cap, args.output_cap, args.seed)
    warm_ids = prompts(lengths[:2], model_dir, args.seed + 99_991)
    rates = [float(x) for x in args.rates.split(",")]
    ctx = args.input_cap + args.output_cap + 16
    targets = make_targets(args.targets.split(","), model_dir, args.threads, args.slots, ctx)
    print(f"{len(lengths)} trace requests, inputs {min(i for i, _ in lengths)}-{max(i for i, _ in lengths)} tokens "
          f"(trace / {args.input_scale:g}, cap {args.input_cap}), outputs {min(o for _, o in lengths)}-"
          f"{max(o for _, o in lengths)} (cap {args.output_cap}); rates {rates} req/s; {args.rounds} rounds")
    results: list[dict] = []
    try:
        for rnd in range(args.rounds):
            for name, target in targets.items():
                target.start()
                try:
                    asyncio.run(replay(target, warm_ids, [(i, 4) for i, _ in lengths[:2]], [0.0, 0.0]))  # warm-up
                    for k, rate in enumerate(rates):
                        ids = prompts(lengths, model_dir, args.seed + 1000 * rnd + k)  # the same for every target
                        triad = triad_gbs()
                        runs = asyncio.run(replay(target, ids, lengths, arrivals_s(len(ids), rate, args.seed + 1)))
                        s = summarise(runs, args.slo_ttft_s, args.slo_tpot_s)
                        results.append({"round": rnd + 1, "target": name, "rate_per_s": rate, "triad_gb_per_s": triad,
                                        **s})
                        print(f"round {rnd + 1} {name:<13} rate {rate:>4} req/s: {s['request_throughput_per_s']:.2f} "
                              f"req/s, {s['token_throughput_per_s']:.1f} tok/s, TTFT p50/p99 "
                              f"{s['ttft_s_p50']:.2f}/{s['ttft_s_p99']:.2f} s, TPOT p50/p99 "
                              f"{s['tpot_s_p50'] or 0:.3f}/{s['tpot_s_p99'] or 0:.3f} s, goodput "
                              f"{s['goodput_per_s']:.2f} req/s (triad {triad} GB/s)")
                finally:
                    target.stop()
    finally:
        for t in targets.values():
            t.stop()
    path = write_result(args.name, {
        "command": "python benchmarks/bench_serving_load.py " + " ".join(sys.argv[1:]), "model": model_dir.name,
        "precision": "float32 (llama-server: an F32 GGUF dequantised from the shipped Q4_1 by llama-quantize); "
                     "the -q4_1 targets: the shipped Q4_1 file's blocks, int8 activations",
        "trace": TRACE.name, "scaling": {"input_scale": args.input_scale, "input_cap": args.input_cap,
                                         "output_cap": args.output_cap, "requests": args.requests, "seed": args.seed},
        "slo": {"ttft_s": args.slo_ttft_s, "tpot_s": args.slo_tpot_s}, "threads": args.threads,
        "llama_server_slots": args.slots, "results": results, "machine": machine_description()})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
