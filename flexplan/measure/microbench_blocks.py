"""The GGUF block kernels' micro-benchmark for ``flexplan calibrate`` (rows ``cpu_block_gemm``).

A layer a GGUF file holds as blocks runs on ``flexplan/quant/kernels.py`` (``quant_gemv.c`` /
``quant_kquants.c``: the activation quantised to int8 per block, integer dots), not on the float
GEMV/GEMM the ``cpu_gemv`` / ``cpu_gemm`` rows time, and at another rate (an integer dot product
per block, not a streamed FMA: a block GEMV can be held by its arithmetic well below the memory's
rate where a float32 GEMV is not). So each format of ``Sizes.block_formats`` is timed as the native
decoder layers run it: the kernel of a :class:`~flexplan.quant.quant_linear.QuantLinear` over random
valid blocks, called on its blocks as they call it (:func:`_kernel_call`)
(``kernels.random_blocks``: random bytes, float16 scales small and finite; the kernels' speed does
not depend on the values), at the float rows' weight shapes and GEMV and GEMM row counts, the
weights cycled through copies that exceed the last-level cache as the float rows' are. Rows as the
float rows, ``dtype`` the activations' (float32), ``format`` the blocks', ``dtype_bytes`` its bytes
per weight (Q4_1: 0.625): ``factors.efficiency`` derives each format's factors from them as from
the float rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from flexplan.estimator.terms import c_gemm
from flexplan.measure import microbench as mb
from flexplan.quant import kernels
from flexplan.quant.formats import BY_NAME
from flexplan.quant.gguf_weights import QuantTensor
from flexplan.quant.quant_linear import QuantLinear

RANDOM_ROWS = 64  # rows of random blocks a weight is tiled from


def kernel_name() -> str:
    """The block kernels' build ("quant-avx2"), or a RuntimeError saying why none loads (the
    executor then dequantises every block to float32: there is nothing of its own to time)."""
    native, why = kernels.status()
    if native is None:
        raise RuntimeError(f"no native block kernels ({why}): a GGUF file's layers run dequantised to float32")
    return f"quant-{native.isa}"


def _kernel_call(lin: QuantLinear, x: torch.Tensor, y: torch.Tensor) -> None:
    """The kernel of one QuantLinear call on its blocks, into y: the call the native decoder layers
    make from C. Not the module's forward, whose Python around the kernel (the output's allocation,
    reshapes) a 2048 x 2048 block GEMV's time would take in as the kernel's own and the stack never pays."""
    lin.native.gemm(lin.blocks, lin.format, x, lin.bias, lin.float_act, lin.interleaved, y=y)


def block_gemm(sizes: mb.Sizes, format_name: str, tick: Callable[[], None] | None = None) -> list[dict]:
    """One row per (rows, k, n) of ``sizes.block_rows()`` x ``sizes.weight_shapes``: ``time_s`` per
    call of a QuantLinear holding ``format_name``'s blocks of that weight, achieved ``flops_per_s``
    and the ``weight_bytes_per_s`` its blocks streamed at; suspect points timed again
    (``microbench.rechecks``), as the float rows are."""
    kernel = kernel_name()
    fmt = BY_NAME[format_name]
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for k, n in sizes.weight_shapes:
            # 64 random rows repeated down the weight: valid blocks made in ms (the whole at random: ~0.1 s)
            band = kernels.random_blocks(fmt, math.gcd(n, RANDOM_ROWS), k, generator=g).data
            data = band.repeat(n // band.shape[0], 1)
            count = mb.copies_for(data.numel(), mb.rotate_bytes(sizes))
            layers = mb.Cycle(QuantLinear(QuantTensor("", data.clone(), (n, k), fmt)) for _ in range(count))
            xs = {t: torch.randn(t, k, generator=g) for t in sizes.block_rows()}
            ys = {t: torch.empty(t, n) for t in sizes.block_rows()}
            timed: dict[int, dict] = {}
            for t in xs:
                timed[t] = mb.time_call(lambda t=t, layers=layers: _kernel_call(layers.next(), xs[t], ys[t]),
                                        sizes.repeats, sizes.budget_s)
                if tick:
                    tick()
            for t in mb.rechecks(timed):  # once more, after the others; the typical run of the two kept
                again = mb.time_call(lambda t=t, layers=layers: _kernel_call(layers.next(), xs[t], ys[t]),
                                     sizes.repeats, sizes.budget_s)
                timed[t] = dict(min(timed[t], again, key=lambda r: r["time_median_s"]), rechecked=True)
            for t, r in timed.items():
                rows.append({"dtype": "float32", "format": fmt.name, "tokens": t, "k": k, "n": n,
                             "dtype_bytes": fmt.bytes_per_weight, "kernel": kernel, **mb.probed(r),
                             "time_s": mb._sig(r["time_s"]), "time_median_s": mb._sig(r["time_median_s"]),
                             "runs": r["runs"], "flops_per_s": mb._sig(c_gemm(t, k, n) / r["time_s"]),
                             "weight_bytes_per_s": mb._sig(data.numel() / r["time_s"]),
                             **({"rechecked": True} if r.get("rechecked") else {})})
    return rows
