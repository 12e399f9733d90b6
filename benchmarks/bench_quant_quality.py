"""Quality and decode speed of a GGUF file run on its own blocks (issue 40, items 3 and 5).

Per GGUF file (SmolLM2's shipped Q4_1; Q4_0 and Q8_0 made from it by llama-quantize
--allow-requantize into ~/.cache/flexplan/bench, not the repo), teacher-forced over the committed
text (benchmarks/data/austen_pride_and_prejudice_ch1.txt):
- the KL divergence KL(ref || quant) and top-1 agreement of next-token distributions of the
  quantised model (QuantLinear, int8 activation as llama.cpp; and the exact float-activation path)
  against the float32 model of the same file (every block dequantised);
- against llama.cpp on the same file (``llama-server``, the same token ids, one position at a time
  with its prompt cache; its flash attention on, as by default, and off, and its own agreement
  between the two: the ceiling a second implementation can reach where the int8 activation's
  roundings turn on float16 noise): top-1 agreement of the next token at each position, and over llama.cpp's
  top 8 tokens (its probabilities renormalised over them, ours likewise) the KL divergence
  KL(llama.cpp || flexplan): llama-server reports at most the top ``n_probs`` tokens, not full logits;
- decode TPOT (batch 1, 32 greedy tokens after a short prompt, transformers' generate on the bare
  models, median of interleaved rounds) of the quantised and the float32 model, and llama-bench
  -t 2 -n 32 on the same file; a STREAM triad sample beside each figure.

    python benchmarks/bench_quant_quality.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LLAMA_CPP_HOW, llama_cpp_tool, machine_description, median, write_result  # noqa: E402

from flexplan.measure.stream import stream_triad_bytes_per_s  # noqa: E402
from flexplan.quant.gguf_model import load_gguf_model  # noqa: E402
from flexplan.quant.quant_linear import set_float_activation  # noqa: E402
from flexplan.smollm import cache_dir, gguf_path  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "austen_pride_and_prejudice_ch1.txt"
NEW_TOKENS = 32


def _files() -> dict[str, Path]:
    src = gguf_path()
    out = {"Q4_1": src}
    dest = cache_dir() / "bench"
    dest.mkdir(parents=True, exist_ok=True)
    for qtype in ("Q4_0", "Q8_0", "Q4_K_M"):
        path = dest / f"SmolLM2-135M-Instruct.{qtype}.gguf"
        if not path.exists():
            quantize = llama_cpp_tool("llama-quantize")
            if quantize is None:
                raise SystemExit(f"making {path.name} needs llama.cpp's llama-quantize: {LLAMA_CPP_HOW}")
            subprocess.run([str(quantize), "--allow-requantize", str(src), str(path), qtype, "2"],
                           check=True, capture_output=True)
        out[qtype] = path
    return out


def _quality(quant, ref, ids) -> dict:
    with torch.no_grad():
        lr = ref(ids).logits[0].float().log_softmax(-1)
        res = {}
        for name, float_act in (("int8_activation", False), ("float_activation", True)):
            set_float_activation(quant, float_act)
            lq = quant(ids).logits[0].float().log_softmax(-1)
            res[name] = {"kl_mean": float((lr.exp() * (lr - lq)).sum(-1).mean()),
                         "top1_agreement": float((lq.argmax(-1) == lr.argmax(-1)).float().mean())}
        set_float_activation(quant, False)
    return res


def _tpot(model, ids) -> float:
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=NEW_TOKENS + 1, min_new_tokens=NEW_TOKENS + 1, do_sample=False)
        t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / NEW_TOKENS


def _llama_bench(path: Path) -> float | None:
    bench = llama_cpp_tool("llama-bench")
    if bench is None:
        return None
    r = subprocess.run([str(bench), "-m", str(path), "-t", "2", "-p", "0", "-n", str(NEW_TOKENS),
                        "-r", "3", "-o", "json"], capture_output=True, text=True, timeout=600)
    if r.returncode:
        return None
    rows = json.loads(r.stdout)
    return 1.0 / rows[0]["avg_ts"]


TOP_K = 8  # llama-server's n_probs: the tokens the comparison with llama.cpp sees at each position
LLAMA_KV = "f32"  # llama.cpp's KV cache type (its default f16 rounds K and V; flexplan's cache is float32)


def _llama_tops(server: Path, path: Path, tokens: list[int], flash_attn: str) -> list[list[tuple[int, float]]]:
    """llama.cpp's top TOP_K (token id, logprob) after each prefix of ``tokens`` (llama-server on
    ``path``, one position at a time with its prompt cache; ``flash_attn`` its -fa: "on" rounds Q, K,
    V and the output's accumulator to float16 on the CPU, "off" attends in float32 as flexplan)."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(server), "-m", str(path), "-t", "2", "-c", str(len(tokens) + 16), "-np", "1",
                             "-ctk", LLAMA_KV, "-ctv", LLAMA_KV, "-fa", flash_attn, "--port", str(port),
                             "--host", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def post(body: dict) -> dict:
        req = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    try:
        for _ in range(600):  # the model loads in seconds
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        tops = []
        for k in range(1, len(tokens)):
            out = post({"prompt": tokens[:k], "n_predict": 1, "n_probs": TOP_K, "temperature": 0.0,
                        "cache_prompt": True})
            tops.append([(t["id"], t["logprob"]) for t in out["completion_probabilities"][0]["top_logprobs"]])
        return tops
    finally:
        proc.send_signal(subprocess.signal.SIGTERM)
        proc.wait(timeout=30)


def _vs_llama_cpp(path: Path, ids: torch.Tensor, logprobs: dict[str, torch.Tensor]) -> dict | None:
    """Top-1 agreement and top-K KL of flexplan's next-token distributions (``logprobs``: name ->
    [positions, vocab] over ``ids``) against llama.cpp's on the same file, with its flash attention
    on and off, and llama.cpp's own agreement between the two (how far a float16 rounding inside
    attention moves the int8 activations' roundings); None without llama-server."""
    server = llama_cpp_tool("llama-server")
    if server is None:
        print(f"llama.cpp comparison skipped: {LLAMA_CPP_HOW}", file=sys.stderr)
        return None
    tokens = ids[0].tolist()
    n = len(tokens) - 1
    out: dict = {"positions": n, "how": f"llama-server -t 2 -ctk/-ctv {LLAMA_KV}, one position at a time (prompt "
                                        f"cache), n_probs {TOP_K}; -fa on and off"}
    tops = {fa: _llama_tops(server, path, tokens, fa) for fa in ("on", "off")}
    for fa, per_position in tops.items():
        agree, kls = {k: 0 for k in logprobs}, {k: [] for k in logprobs}
        for k, top in enumerate(per_position, start=1):
            ids_k = [t for t, _ in top]
            p = torch.tensor([lp for _, lp in top], dtype=torch.float64).softmax(0)
            for name, lp in logprobs.items():
                q = lp[k - 1, ids_k].double().softmax(0)
                kls[name].append(float((p * (p / q).log()).sum()))
                agree[name] += int(int(lp[k - 1].argmax()) == ids_k[0])
        out[f"flash_attn_{fa}"] = {name: {"top1_agreement": agree[name] / n, f"kl_top{TOP_K}_mean": sum(kls[name]) / n}
                                   for name in logprobs}
    out["llama_cpp_fa_on_vs_off_top1_agreement"] = sum(a[0][0] == b[0][0] for a, b in zip(tops["on"], tops["off"])) / n
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quality-only", action="store_true", help="no TPOT rounds (a loaded machine's timings mean little)")
    ap.add_argument("--formats", default="Q4_1,Q4_0,Q8_0,Q4_K_M")
    args = ap.parse_args()
    torch.set_num_threads(2)
    results = {}
    for name, path in _files().items():
        if name not in args.formats.split(","):
            continue
        quant, tok = load_gguf_model(path)
        ref, _ = load_gguf_model(path, tokenizer=False, dequantize_all=True)
        ids = tok(TEXT.read_text(), return_tensors="pt").input_ids
        prompt = tok("The capital of France is", return_tensors="pt").input_ids
        row = {"file": path.name, "text_tokens": int(ids.shape[1]), "quality_vs_float32": _quality(quant, ref, ids)}
        with torch.no_grad():
            lps = {}
            for act, float_act in (("int8_activation", False), ("float_activation", True), ("float32_model", None)):
                if float_act is None:
                    lps[act] = ref(ids).logits[0].float().log_softmax(-1)
                    continue
                set_float_activation(quant, float_act)
                lps[act] = quant(ids).logits[0].float().log_softmax(-1)
            set_float_activation(quant, False)
            row["quality_vs_llama_cpp"] = _vs_llama_cpp(path, ids, lps)
        print(name, "vs llama.cpp", json.dumps(row["quality_vs_llama_cpp"]), flush=True)
        if args.quality_only:
            results[name] = row
            continue
        times: dict[str, list] = {"flexplan_quant": [], "flexplan_float32": [], "llama_bench": []}
        for _ in range(args.rounds):  # interleaved rounds, a triad sample beside each figure
            for key, fn in (("flexplan_quant", lambda: _tpot(quant, prompt)),
                            ("flexplan_float32", lambda: _tpot(ref, prompt)),
                            ("llama_bench", lambda: _llama_bench(path))):
                triad = stream_triad_bytes_per_s()
                times[key].append({"tpot_s": fn(), "triad_gb_s": triad / 1e9})
        row["decode_tpot"] = {k: {"median_s": median([v["tpot_s"] for v in vs if v["tpot_s"] is not None] or [float("nan")]),
                                  "rounds": vs} for k, vs in times.items()}
        results[name] = row
        print(name, json.dumps(row["quality_vs_float32"]),
              {k: round(v["median_s"] * 1e3, 2) for k, v in row["decode_tpot"].items()}, flush=True)
    out = write_result("bench_quant_quality", {
        "machine": machine_description(), "text": TEXT.name, "new_tokens": NEW_TOKENS, "threads": 2,
        "notes": "TPOT: transformers generate() on the bare models (no flexplan executor); llama.cpp compared "
                 f"through llama-server's top {TOP_K} per position; shared 2-core VM, other agents running",
        "files": results})
    print(out)


if __name__ == "__main__":
    main()
