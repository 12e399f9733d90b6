"""A random Qwen3-MoE GGUF made with llama.cpp's own tools, for the MoE rows of
``bench_gguf_vs_llama_cpp.py`` (no MoE GGUF can be downloaded here).

A Qwen3-MoE of random weights (hidden 1024, 8 layers, 32 experts of width 512, 4 a token, QK-norm,
SmolLM2's tokenizer), written by transformers, converted by llama.cpp's convert_hf_to_gguf.py to F16
(as tests/test_gguf_archs.py runs it) and quantised by llama-quantize to Q4_K_M and Q8_0. Speed only:
its tokens mean nothing.

    python benchmarks/make_random_moe_gguf.py /tmp/moe     # then --gguf /tmp/moe/qwen3moe-rand.Q4_K_M.gguf
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/flexplan-moe")
    out.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    import test_gguf_archs as helpers  # llama.cpp's converter as the tests run it, SmolLM2's tokenizer

    if not (helpers.CONVERTER.is_file() and helpers.QUANTIZE.is_file()):
        raise SystemExit(f"needs llama.cpp's convert_hf_to_gguf.py and llama-quantize under {helpers.LLAMA_CPP} "
                         "(FLEXPLAN_LLAMA_CPP)")
    cfg = transformers.Qwen3MoeConfig(vocab_size=helpers.SMOLLM_VOCAB, hidden_size=1024, intermediate_size=2048,
                                      moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4,
                                      num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                      max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                                      initializer_range=0.02, norm_topk_prob=True)
    torch.manual_seed(0)
    folder = out / "qwen3moe-rand"
    helpers.save_for_the_converter(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(), folder)
    stub = out / "stub"
    stub.mkdir(exist_ok=True)
    (stub / "sentencepiece.py").write_text("class SentencePieceProcessor:  # stand-in: never called\n    pass\n")
    script = helpers._CONVERT.format(root=str(helpers.LLAMA_CPP), gguf_py=str(helpers.LLAMA_CPP / "gguf-py"),
                                     converter=str(helpers.CONVERTER))
    f16 = out / "qwen3moe-rand.F16.gguf"
    subprocess.run([sys.executable, "-c", script, str(folder), "--outfile", str(f16), "--outtype", "f16"],
                   env=dict(os.environ, PYTHONPATH=str(stub)), check=True, capture_output=True)
    for q in ("Q4_K_M", "Q8_0"):
        path = out / f"qwen3moe-rand.{q}.gguf"
        subprocess.run([str(helpers.QUANTIZE), str(f16), str(path), q], check=True, capture_output=True)
        print(f"{path} ({path.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
