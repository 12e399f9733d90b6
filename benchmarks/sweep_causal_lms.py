"""Which causal LMs of the installed transformers the executor runs: a compatibility sweep.

For every model type in transformers' causal-LM mapping (or those named on the command line),
build a tiny random model from the type's default config with small widths (hidden 64, 2
layers, 4 heads, 2 KV heads, 4-token windows, 4 experts), generate 6 greedy tokens for a
left-padded batch of 3 with transformers, then with flexplan on the CPU stand-in for three
policy pairs (cpu/cpu, gpu-offload-partial/gpu-offload with M=1, gpu/splitgen with M=1), and
record per type: ``ok`` (token-identical for every pair), ``diff``, ``refused`` (flexplan's
one-line UnsupportedModelError), ``error`` (flexplan failed otherwise) or ``skipped``
(transformers itself could not build or generate with the tiny config, the model is over 30M
parameters, or it took over 60 s). Writes ``benchmarks/results/sweep_causal_lms.json``.

    python benchmarks/sweep_causal_lms.py [model_type ...]
"""

from __future__ import annotations

import copy
import signal
import sys
import warnings

from common import write_result

SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=160, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             n_embd=64, n_layer=2, n_head=4, d_model=64, moe_intermediate_size=32, num_experts=4, num_local_experts=4,
             n_routed_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=64, sliding_window=4)
MAX_PARAMS = 30e6  # larger models are skipped (counted on the meta device, never built)
PAIRS = (("cpu", "cpu"), ("gpu-offload-partial", "gpu-offload"), ("gpu", "splitgen"))
# multimodal wrappers: their vision/audio towers are slow to build at default sizes and not what this tests
MULTIMODAL = ("vl", "vision", "omni", "audio", "speech", "mllama", "idefics", "llava", "paligemma", "chameleon", "emu",
              "fuyu", "blip", "kosmos", "moshi", "musicgen", "whisper", "trocr")


class _Timeout(Exception):
    pass


def _tiny_model(model_type: str):
    import torch
    import transformers

    base = transformers.AutoConfig.for_model(model_type)
    kw = {k: v for k, v in SIZES.items() if hasattr(base, k) or k in base.attribute_map}
    try:
        config = transformers.AutoConfig.for_model(model_type, **kw)
    except Exception:  # noqa: BLE001 - some configs refuse the small widths: keep the defaults
        config = base
    with torch.device("meta"):  # count first: a config the small widths do not reach stays full size
        n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if n > MAX_PARAMS:
        raise _TooLarge(f"{n / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


class _TooLarge(Exception):
    pass


def sweep_one(model_type: str) -> tuple[str, str]:
    import torch

    import flexplan.api as api
    from flexplan.errors import UnsupportedModelError
    from flexplan.executor.families import check_supported
    from flexplan.executor.plans import fixed_plan

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))
    from conftest import left_padded_batch

    try:
        ref = _tiny_model(model_type)
    except _TooLarge as e:
        return "skipped", str(e)
    except Exception as e:  # noqa: BLE001
        return "skipped", f"transformers cannot build it: {e!r}"[:200]
    ids, mask = left_padded_batch()
    ids = ids.clamp(max=min(150, ref.get_input_embeddings().num_embeddings - 1))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    try:
        expected = ref.generate(**kw)
    except Exception as e:  # noqa: BLE001
        return "skipped", f"transformers cannot generate: {e!r}"[:200]
    try:
        check_supported(ref.config)  # what flexplan.load checks first
    except UnsupportedModelError as e:
        return "refused", str(e)
    for prefill, decode in PAIRS:
        model = copy.deepcopy(ref)
        try:
            plan = fixed_plan(model.config, prefill, decode, 1, batch_size=3, input_len=9, output_len=6,
                              gpu_memory_bytes=1 << 30)
            lm = api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=1 << 30)
            out = lm.generate(**kw)
        except UnsupportedModelError as e:
            return "refused", str(e)
        except _Timeout:
            raise
        except Exception as e:  # noqa: BLE001
            return "error", f"{prefill}/{decode}: {e!r}"[:300]
        if not torch.equal(out, expected):
            return "diff", f"{prefill}/{decode}"
    return "ok", ""


def main(argv: list[str]) -> None:
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import flexplan.api as api

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    api.local_cpu_cores = lambda: 1
    types = argv or sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if not any(m in t for m in MULTIMODAL))

    def timeout(*_):
        raise _Timeout()

    signal.signal(signal.SIGALRM, timeout)
    results = {}
    for mt in types:
        signal.alarm(60)
        try:
            status, detail = sweep_one(mt)
        except _Timeout:
            status, detail = "skipped", "over 60 s"
        except Exception as e:  # noqa: BLE001 - a config class that cannot even be made
            status, detail = "skipped", f"no config: {e!r}"[:200]
        finally:
            signal.alarm(0)
        results[mt] = {"status": status, "detail": detail}
        print(f"{mt:28s} {status:8s} {detail[:110]}", flush=True)
    counts = {s: sum(r["status"] == s for r in results.values()) for s in ("ok", "diff", "refused", "error", "skipped")}
    print(counts)
    path = write_result("sweep_causal_lms", {"pairs": [list(p) for p in PAIRS], "counts": counts, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
