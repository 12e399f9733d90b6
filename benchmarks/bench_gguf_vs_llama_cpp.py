"""A GGUF file's whole-model prefill and decode: flexplan on the file's own blocks against llama.cpp.

For each file (default: the embedded SmolLM2's Q4_1; more with ``--gguf``, e.g. llama-quantize's
Q4_0 / Q8_0 / Q4_K_M of the same weights), in interleaved rounds (every file's flexplan run, then
its ``llama-bench`` run, a STREAM triad sample before each):

- flexplan: ``flexplan.load(file)`` (the cpu policy on the blocks: QuantLinear layers, the native
  decoder-layer calls), one ``generate()`` of ``--new`` tokens after a ``--prompt``-token prompt of
  random ids; TTFT (the prefill) and TPOT as flexplan's run statistics measure them;
- llama.cpp: ``llama-bench`` on the same file, same threads: the prefill time PROMPT / pp tokens/s
  of ``-p PROMPT -n 0`` (from an empty context), the TPOT 1 / tg tokens/s of ``-p 0 -n NEW -d PROMPT``:
  its decode after PROMPT tokens of context, as flexplan's follows its prompt (at ``-d 0`` llama.cpp
  would attend PROMPT fewer keys a token than flexplan does).

Reported per file: medians over the rounds, flexplan / llama.cpp for each phase, and the decode's
compressed bytes per token (a MoE layer's experts: the k of E a token picks) over its TPOT (the GB/s
of weights it reads) as a fraction of the triad. Writes ``benchmarks/results/<name>.json``.

    python benchmarks/bench_gguf_vs_llama_cpp.py --rounds 3 --gguf ~/.cache/flexplan/bench/*.Q4_0.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import LLAMA_CPP_HOW, llama_cpp_tool, machine_description, triad_gbs, use_threads, write_result  # noqa: E402



def flexplan_run(lm, prompt: int, new: int, seed: int) -> dict:
    import copy

    import torch

    ids = torch.randint(100, lm.model.config.vocab_size - 100, (1, prompt), generator=torch.Generator().manual_seed(seed))
    # exactly `new` tokens with no end-of-sequence token to stop at (as llama-bench decodes): greedy, no
    # EOS, rather than min_new_tokens, whose logits processor would add its own cost to every step
    config = copy.deepcopy(lm.model.generation_config)
    config.update(eos_token_id=None, max_new_tokens=new, min_new_tokens=None, do_sample=False)
    lm.generate(ids, generation_config=config)
    s = lm.last_stats
    return {"prefill_s": s.ttft_s, "tpot_s": s.tpot_s, "native_stack_steps": s.native_stack_steps}


def llama_bench_run(tool: Path, path: Path, prompt: int, new: int, threads: int) -> dict:
    def bench(*test: str) -> dict:
        cmd = [str(tool), "-m", str(path), "-t", str(threads), *test, "-r", "1", "-o", "json"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise SystemExit(f"llama-bench {' '.join(test)} failed on {path}: {r.stderr[-400:]}")
        return json.loads(r.stdout)[0]

    pp = bench("-p", str(prompt), "-n", "0")  # the prompt from an empty context
    tg = bench("-p", "0", "-n", str(new), "-d", str(prompt))  # the tokens after it
    return {"prefill_s": prompt / pp["avg_ts"], "tpot_s": 1.0 / tg["avg_ts"], "decode_depth": tg.get("n_depth"),
            "build": pp.get("build_commit")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", nargs="*", default=[], help="more GGUF files (the embedded Q4_1 always runs)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--name", default="gguf_vs_llama_cpp")
    args = ap.parse_args()
    use_threads(args.threads)
    import flexplan
    from flexplan.quant.quant_experts import QuantExperts
    from flexplan.quant.quant_linear import QuantLinear
    from flexplan.smollm import gguf_path

    tool = llama_cpp_tool("llama-bench")
    if tool is None:
        raise SystemExit(f"this benchmark needs llama.cpp's llama-bench: {LLAMA_CPP_HOW}")
    files = [Path(gguf_path())] + [Path(f).expanduser() for f in args.gguf]
    models = {}
    for f in files:
        lm = flexplan.load(str(f))
        # a token's blocks: every linear's, and of a MoE layer's experts the share its k of E read
        k = getattr(lm.model.config, "num_experts_per_tok", 0) or 0
        weight_bytes = sum(m.nbytes if isinstance(m, QuantLinear) else m.nbytes * k / m.num_experts
                           for m in lm.model.modules() if isinstance(m, (QuantLinear, QuantExperts)))
        models[f] = (lm, weight_bytes)
        flexplan_run(lm, 8, 4, 0)  # warm: first-use compile and caches
    runs = []
    for rnd in range(args.rounds):
        for f in files:
            lm, weight_bytes = models[f]
            for target in ("flexplan", "llama.cpp"):
                triad = triad_gbs()
                r = (flexplan_run(lm, args.prompt, args.new, rnd) if target == "flexplan"
                     else llama_bench_run(tool, f, args.prompt, args.new, args.threads))
                rec = {"round": rnd + 1, "file": f.name, "target": target, "triad_gb_per_s": triad,
                       "decode_weight_bytes": weight_bytes, **r}
                runs.append(rec)
                print(f"round {rnd + 1} {f.name:<34} {target:<9}: prefill {args.prompt} tokens "
                      f"{r['prefill_s'] * 1e3:7.1f} ms, TPOT {r['tpot_s'] * 1e3:6.2f} ms (triad {triad} GB/s)",
                      flush=True)
    summary = []
    for f in files:
        mine = [r for r in runs if r["file"] == f.name]
        med = {t: {k: statistics.median(r[k] for r in mine if r["target"] == t) for k in ("prefill_s", "tpot_s")}
               for t in ("flexplan", "llama.cpp")}
        weight_bytes = models[f][1]
        triad = statistics.median(r["triad_gb_per_s"] for r in mine)
        gbs = weight_bytes / med["flexplan"]["tpot_s"] / 1e9
        row = {"file": f.name, "flexplan": med["flexplan"], "llama.cpp": med["llama.cpp"],
               "tpot_ratio": med["flexplan"]["tpot_s"] / med["llama.cpp"]["tpot_s"],
               "prefill_ratio": med["flexplan"]["prefill_s"] / med["llama.cpp"]["prefill_s"],
               "decode_weight_gb_per_s": gbs, "triad_gb_per_s_median": triad, "decode_fraction_of_triad": gbs / triad}
        summary.append(row)
        print(f"{f.name}: TPOT {med['flexplan']['tpot_s'] * 1e3:.2f} vs {med['llama.cpp']['tpot_s'] * 1e3:.2f} ms "
              f"({row['tpot_ratio']:.2f}x llama.cpp), prefill {med['flexplan']['prefill_s'] * 1e3:.0f} vs "
              f"{med['llama.cpp']['prefill_s'] * 1e3:.0f} ms ({row['prefill_ratio']:.2f}x); decode reads "
              f"{gbs:.1f} GB/s of blocks, {row['decode_fraction_of_triad']:.2f} of the triad ({triad} GB/s)")
    path = write_result(args.name, {
        "command": "python benchmarks/bench_gguf_vs_llama_cpp.py " + " ".join(sys.argv[1:]),
        "threads": args.threads, "prompt_tokens": args.prompt, "new_tokens": args.new, "rounds": args.rounds,
        "summary": summary, "runs": runs, "machine": machine_description()})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
