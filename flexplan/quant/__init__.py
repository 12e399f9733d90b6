"""Compressed weights (issue 40): block formats as data, GGUF tensors read as they are, and the
CPU kernels that run on the compressed blocks.

Rooms: ``formats`` (bytes per weight, block sizes, GGML type ids; torch-free), ``gguf_weights``
(a GGUF file's raw blocks as torch uint8 tensors, dequantised bit for bit as the ``gguf`` package
does, Llama's q/k rows permuted on whole block rows), ``kernels`` (``quant_gemv.c`` and
``quant_kquants.c``: the decode GEMV and the prefill GEMM on Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks
and Q4_K / Q5_K / Q6_K super-blocks, compiled and checked as the executor's native kernels are, with
a dequantise-then-torch fallback).
"""

# no re-exports: `flexplan.quant.formats` stays torch-free for the planner; import the room you need
