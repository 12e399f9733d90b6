"""The serving engine's prefix cache on a shared system prompt, on and off, in interleaved rounds.

A chat deployment's requests begin with the same system prompt; each adds its own user turn.
``--requests`` such requests (a ``--system``-token system prompt of random ids, fresh each round,
then ``--user`` random ids of their own; ``--new`` tokens each, greedy, no EOS) are added to one
``flexplan.Engine`` at once (an offline batch) and stepped until every one finished, with
``prefix_caching=True`` and ``False`` one after the other in each round, a STREAM triad sample
before each run. Reported per run: wall time, requests/s, TTFT (from the batch's start to the
step that gave a request's first token) p50 / p90 / max, prompt tokens computed and the tokens the
cache held. Writes ``benchmarks/results/<name>.json``.

    python benchmarks/bench_prefix_cache.py --rounds 3 --requests 16 --system 512 --user 64 --new 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import triad_gbs, use_threads, write_result  # noqa: E402



def serve_batch(engine, prompts: list[list[int]], new: int) -> dict:
    """Every prompt added at once, stepped to the end: wall time, TTFTs, tokens computed."""
    from flexplan import SamplingParams

    blocks = engine.blocks
    hits0, queries0 = blocks.prefix_hit_tokens, blocks.prefix_query_tokens
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    ttft, computed = {}, 0
    while engine.has_unfinished():
        outs = engine.step()
        computed += engine._scheduled_tokens
        now = time.perf_counter() - t0
        for o in outs:
            ttft.setdefault(o.request_id, now)
    wall = time.perf_counter() - t0
    t = sorted(ttft.values())
    return {"wall_s": wall, "requests_per_s": len(prompts) / wall, "ttft_p50_s": statistics.median(t),
            "ttft_p90_s": t[int(0.9 * (len(t) - 1))], "ttft_max_s": t[-1],
            "tokens_computed": computed, "prefix_hit_tokens": blocks.prefix_hit_tokens - hits0,
            "prefix_query_tokens": blocks.prefix_query_tokens - queries0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a folder or .gguf file (default: the embedded SmolLM2)")
    ap.add_argument("--weights", default=None, help="what Engine.from_pretrained takes (float32, gguf, int4, int8)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--system", type=int, default=512, help="tokens of the shared system prompt")
    ap.add_argument("--user", type=int, default=64, help="tokens of each request's own turn")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--name", default="prefix_cache")
    args = ap.parse_args()
    torch = use_threads(args.threads)
    import flexplan

    engines = {on: flexplan.Engine.from_pretrained(args.model, weights=args.weights, prefix_caching=on)
               for on in (True, False)}
    vocab = engines[True].vocab_size
    g = torch.Generator().manual_seed(0)
    runs = []
    for rnd in range(args.rounds):
        system = torch.randint(100, vocab - 100, (args.system,), generator=g).tolist()  # fresh each round
        prompts = [system + torch.randint(100, vocab - 100, (args.user,), generator=g).tolist()
                   for _ in range(args.requests)]
        for on in ((True, False) if rnd % 2 == 0 else (False, True)):
            triad = triad_gbs()
            r = serve_batch(engines[on], prompts, args.new)
            r.update(round=rnd + 1, prefix_caching=on, triad_gb_per_s=triad)
            runs.append(r)
            print(f"round {rnd + 1} prefix caching {'on ' if on else 'off'}: {r['wall_s']:6.2f} s, "
                  f"{r['requests_per_s']:.2f} req/s, TTFT p50 {r['ttft_p50_s']:.2f} s p90 {r['ttft_p90_s']:.2f} s, "
                  f"{r['tokens_computed']} tokens computed, {r['prefix_hit_tokens']} from the cache "
                  f"(triad {triad} GB/s)", flush=True)
    summary = {}
    for on in (True, False):
        mine = [r for r in runs if r["prefix_caching"] == on]
        summary["on" if on else "off"] = {k: statistics.median(r[k] for r in mine)
                                          for k in ("wall_s", "requests_per_s", "ttft_p50_s", "ttft_p90_s")}
    ratio = summary["on"]["requests_per_s"] / summary["off"]["requests_per_s"]
    print(f"medians: on {summary['on']['requests_per_s']:.2f} req/s, TTFT p50 {summary['on']['ttft_p50_s']:.2f} s; "
          f"off {summary['off']['requests_per_s']:.2f} req/s, TTFT p50 {summary['off']['ttft_p50_s']:.2f} s: "
          f"{ratio:.2f}x the requests per second")
    path = write_result(args.name, {"model": args.model or "embedded SmolLM2-135M-Instruct",
                                    "weights": args.weights, "threads": args.threads, "rounds": args.rounds,
                                    "requests": args.requests, "system_tokens": args.system,
                                    "user_tokens": args.user, "new_tokens": args.new, "runs": runs,
                                    "medians": summary, "requests_per_s_ratio": ratio})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
