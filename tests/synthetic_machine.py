"""A made-up machine whose micro-benchmark rows are computed, not measured.

``SyntheticMachine`` holds the true rates of a machine (weight-streaming and KV-read bandwidth,
FLOP rate per dtype, fixed costs per op, per layer and per generate() step). ``measurements``
times every shape a calibration mode's grid (``flexplan.measure.microbench.MODES``) holds,
in the same row format the real benchmarks write, with multiplicative noise when asked. The
property tests feed these rows to the real derivation, writer and reader.

Times are physical: positive, and never shorter for more work. A GEMM overlaps its compute and
its weight streaming imperfectly (the larger of the two plus a fifth of the smaller).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from flexplan.factors.efficiency import _attention_spec
from flexplan.measure.microbench import MODES, Sizes, thread_counts
from flexplan.estimator.terms import Shape, c_gemm, d_gemm, phase_work
from flexplan.hardware.spec import DTYPE_BYTES, CPUSpec, GPUSpec, Hardware, LinkSpec
from flexplan.workload import costs

OVERLAP = 0.2  # share of the smaller of compute and memory time that does not hide under the larger


def _roofline_s(flops, n_bytes, flops_per_s: float, bytes_per_s: float):
    a, b = flops / flops_per_s, n_bytes / bytes_per_s
    return np.maximum(a, b) + OVERLAP * np.minimum(a, b)


@dataclass(frozen=True)
class SyntheticMachine:
    bytes_per_s: float  # weights stream at
    kv_bytes_per_s: float  # decode attention reads its KV cache at
    flops_per_s: dict  # dtype -> FLOP/s a large GEMM reaches
    op_s: float  # fixed cost of one op call
    layer_s: float  # fixed cost of one decoder layer (Python, norms, rotary, dispatch of its ~15 ops)
    step_s: float  # generate()'s loop per step
    logit_s: float  # ... per logit (batch x vocab)
    gpu: bool = False
    noise: float = 0.0  # relative: each time multiplied by a factor in [1 - noise, 1 + noise]
    seed: int = 0
    # FLOP/s of a prefill layer's attention core (dtype -> rate); None: at the GEMMs' roofline, with the rest
    prefill_attention_flops_per_s: dict | None = None
    # seconds per token and hidden unit of a layer (norms, rotary, activations): weighs more per
    # FLOP in a narrow layer than in a wide one
    token_hidden_s: float = 0.0

    # ------------------------------------------------------------------ true times

    def gemm_s(self, dtype: str, tokens: int, k: int, n: int) -> float:
        nb = DTYPE_BYTES[dtype]
        return self.op_s + float(_roofline_s(c_gemm(tokens, k, n), d_gemm(tokens, k, n, nb), self.flops_per_s[dtype],
                                             self.bytes_per_s))

    def attention_s(self, dtype: str, batch: int, kv_len: int, heads: int, kv_heads: int, head_dim: int) -> float:
        m = _attention_spec(heads, kv_heads, head_dim)
        kv = float(costs.d_kv_cache(m, batch, kv_len, DTYPE_BYTES[dtype]))
        c = float(costs.c_decode(m, batch, kv_len) - costs.c_decode(m, batch, 0))
        return self.op_s + float(_roofline_s(c, kv, self.flops_per_s[dtype], self.kv_bytes_per_s))

    def layer_time_s(self, dtype: str, spec, batch: int, query_len: int, past: int) -> float:
        """One real decoder layer of ``spec`` (ModelSpec) on ``batch`` x ``query_len`` new tokens after
        ``past`` cached ones."""
        attn_s = 0.0
        if query_len == 1:
            w = phase_work(Shape(spec, batch, past, 2, dtype, dtype), "decode")
            flops, kv = float(w.flops[0]), float(w.kv_read_cpu[0])
        else:
            w = phase_work(Shape(spec, batch, query_len, 1, dtype, dtype), "prefill")
            flops, kv = float(w.flops), 0.0
            if self.prefill_attention_flops_per_s:  # the attention core at its own rate, after the GEMMs
                flops -= float(w.prefill_attention_flops)
                attn_s = float(w.prefill_attention_flops) / self.prefill_attention_flops_per_s[dtype]
        return (self.layer_s + float(_roofline_s(flops, w.d_cpu + w.kv_write_cpu, self.flops_per_s[dtype],
                                                 self.bytes_per_s)) + kv / self.kv_bytes_per_s + attn_s
                + self.token_hidden_s * batch * query_len * spec.hidden_size)

    # ------------------------------------------------------------------ rows as the benchmarks write them

    def measurements(self, mode: str | Sizes, cpu_dtypes=("float32",), gpu_dtype: str = "bfloat16") -> dict:
        s = MODES[mode] if isinstance(mode, str) else mode
        calls = [0]

        def t(x: float, *key) -> dict:
            """Times of one shape; the noise is a function of the shape (``key``), so two modes that
            both measure it see the same figures, as on one machine at one moment."""
            calls[0] += 1
            rng = np.random.default_rng([self.seed, zlib.crc32(repr(key or calls[0]).encode())])
            fast = x * (1 + self.noise * rng.uniform(-1, 1))
            return {"time_s": float(fast), "time_median_s": float(fast * (1 + self.noise * rng.uniform(0, 1))),
                    "runs": s.repeats}

        def gemm_rows(dtype, tokens, shapes, device_rate=None):
            rows = []
            for k, n in shapes:
                for tok in tokens:
                    x = (self.gemm_s(dtype, tok, k, n) if device_rate is None
                         else self.op_s / 2 + float(_roofline_s(c_gemm(tok, k, n), d_gemm(tok, k, n, DTYPE_BYTES[dtype]),
                                                                *device_rate)))
                    rows.append({"dtype": dtype, "tokens": tok, "k": k, "n": n, "dtype_bytes": DTYPE_BYTES[dtype],
                                 "kernel": "synthetic", **t(x, "gemm", device_rate is None, dtype, tok, k, n)})
            return rows

        m: dict = {"cpu_stream": {"triad_bytes_per_s": self.bytes_per_s * 1.1, "copy_bytes_per_s": self.bytes_per_s,
                                  "array_bytes": s.stream_bytes},
                   "cpu_op_dispatch": {}, "cpu_gemv": [], "cpu_gemm": [], "cpu_attention": [], "cpu_layers": [],
                   "cpu_head_gemv": []}
        heads, kv_heads, hd = s.attn_heads
        for dt in cpu_dtypes:
            m["cpu_op_dispatch"][dt] = {"linear_call_s": self.op_s, "sdpa_call_s": self.op_s}
            m["cpu_gemv"] += gemm_rows(dt, s.gemv_tokens, s.weight_shapes)
            m["cpu_gemm"] += gemm_rows(dt, s.gemm_tokens, s.weight_shapes)
            for b in s.attn_batches:
                for L in s.attn_kv_lens:
                    m["cpu_attention"].append({"dtype": dt, "batch": b, "kv_len": L, "heads": heads,
                                               "kv_heads": kv_heads, "head_dim": hd, "dtype_bytes": DTYPE_BYTES[dt],
                                               **t(self.attention_s(dt, b, L, heads, kv_heads, hd), "attn", dt, b, L)})
        for dt in cpu_dtypes:
            for (hidden, inter, h, kvh, d), points in s.layer_plan():
                spec = _attention_spec(h, kvh, d, hidden, inter)
                for batch, q, past in points:
                    m["cpu_layers"].append({"dtype": dt, "kernel": "synthetic", "hidden": hidden, "intermediate": inter,
                                            "heads": h, "kv_heads": kvh, "head_dim": d, "batch": batch, "query_len": q,
                                            "kv_len": past + q, "params": spec.params_per_layer, "copies": 8,
                                            **t(self.layer_time_s(dt, spec, batch, q, past), "layer", dt, hidden,
                                                batch, q, past)})
            m["cpu_head_gemv"] += gemm_rows(dt, s.head_tokens, s.head_shapes)
        dt0 = cpu_dtypes[0]
        tiny = _attention_spec(4, 2, 16, 64, 128)
        m["cpu_layer_overhead"] = {**t(self.layer_time_s(dt0, tiny, 1, 1, 16), "tiny layer"), "hidden_size": 64,
                                   "layer": "synthetic"}
        toy = _attention_spec(2, 1, 8, 16, 32)
        m["cpu_generate_step"] = [
            {"dtype": dt0, "vocab": v, "batch": b, "layers": 1, "hidden_size": 16, "steps": 32,
             **{k: x for k, x in t(self.step_s + self.logit_s * b * v + self.layer_time_s(dt0, toy, b, 1, 16)
                                   + self.gemm_s(dt0, b, 16, v), "step", v, b).items() if k != "runs"}}
            for v, b in s.generate_shapes]
        k, n = s.weight_shapes[-1]
        sweep = [{"threads": th, "prefill_time_s": self.gemm_s(dt0, s.sweep_prefill_tokens, k, n) * (1 + 1 / th),
                  "decode_time_s": self.gemm_s(dt0, 1, k, n) * (1 + 0.5 / th)} for th in thread_counts(2)]
        m["cpu_threads"] = {"prefill": {"tokens": s.sweep_prefill_tokens, "k": k, "n": n},
                            "decode": {"tokens": 1, "k": k, "n": n}, "sweep": sweep,
                            "best_prefill_threads": 2, "best_decode_threads": 2}
        if self.gpu:
            rate = (GPU.peak_flops_per_s[gpu_dtype] * 0.6, GPU.memory_bandwidth_bytes_per_s * 0.8)
            m["gpu_gemv"] = gemm_rows(gpu_dtype, s.gemv_tokens, s.weight_shapes, rate)
            m["gpu_gemm"] = gemm_rows(gpu_dtype, s.gemm_tokens, s.weight_shapes, rate)
            m["gpu_memory"] = {"copy_bytes_per_s": rate[1], "array_bytes": 2**28, "time_s": 2**28 / rate[1]}
            m["gpu_layer_overhead"] = {**t(60e-6, "gpu layer"), "hidden_size": 64, "layer": "synthetic"}
            link = LINK.h2d_bandwidth_bytes_per_s * 0.8
            for d in ("h2d", "d2h"):
                m[d] = [{"bytes": b, **t(10e-6 + b / link, d, b), "bytes_per_s": b / (10e-6 + b / link)}
                        for b in s.transfer_bytes]
            m["cpu_under_copy"] = {"factor": 1.1, "gemv_factor": 1.2}
        return {key: rows for key, rows in m.items() if s.measures(key)}  # a mode's parts only (the probe's)


CPU = CPUSpec(name="made-up 16-core", sockets=1, cores=16, peak_flops_per_s={"float32": 1.0e12, "bfloat16": 2.0e12},
              memory_bandwidth_bytes_per_s=100e9, memory_bytes=256 * 2**30, isa=frozenset({"avx512f"}))
GPU = GPUSpec(name="made-up GPU", memory_bytes=80 * 2**30, memory_bandwidth_bytes_per_s=2.0e12,
              peak_flops_per_s={"bfloat16": 400e12, "float16": 400e12, "float32": 50e12})
LINK = LinkSpec(name="made-up PCIe", h2d_bandwidth_bytes_per_s=25e9, d2h_bandwidth_bytes_per_s=25e9)
# names start with "local": calibrations describe the local machine
HW_GPU = Hardware(name="local+made-up-gpu", cpu=CPU, gpu=GPU, link=LINK)
HW_CPU = Hardware(name="local-made-up-cpu", cpu=CPU, gpu=None, link=None)
