"""flexplan's native CPU kernels: compiled on first use, cached, checked, optional.

Two libraries from C files shipped inside the package: the blocked GEMV (``native_gemv.c``,
:func:`status`) and the fused decode-step ops (``native_decode.c``: RMSNorm, rotary embedding,
one-query attention, whole decoder layers; :func:`decode_status`), compiled together with the GEMV
and :mod:`flexplan.quant`'s kernels on GGUF blocks, which its layers call. The first process that
needs one compiles it with the
system C compiler (``$CC``, else ``cc``/``gcc``) for this CPU (``-O3 -march=native -fopenmp``,
under a second) into the user cache (``<cache>/native/``), keyed by a hash of the source, the
compiler's version and the CPU's flags; the library is written under a temporary name and renamed,
so a crash never leaves a half-written one. It is loaded with ctypes (no torch headers, no build
step at ``pip install``) and checked against ``F.linear`` before first use.

When anything fails (no compiler, no OpenMP, not Linux/x86, a failed check, or
``FLEXPLAN_NATIVE=0``), :func:`status` says why and the CPU executor falls back to oneDNN's packed
weights (and the decoder layers keep transformers' own ops): the native kernels are an
accelerator, never a requirement.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from flexplan.smollm import cache_dir

SOURCE = Path(__file__).with_name("native_gemv.c")
# the fused layer calls the blocked GEMV, or the quantised GEMM on a GGUF file's blocks (flexplan.quant's sources)
QUANT_SOURCES = tuple(Path(__file__).parent.parent / "quant" / n for n in ("quant_gemv.c", "quant_kquants.c"))
DECODE_SOURCES = (SOURCE, Path(__file__).with_name("native_decode.c"), *QUANT_SOURCES)
# -fno-trapping-math: no floating-point trap is ever enabled here, and without it GCC does not
# if-convert the exp's clamps, so the SiLU and softmax loops stay scalar. It licenses no reassociation
# or other change of rounding (that is -ffast-math's -fassociative-math and kin, not used here).
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-shared", "-fPIC", "-std=gnu11")
DISABLE_ENV = "FLEXPLAN_NATIVE"


WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # native_gemv.c's WEIGHT_*


class NativeGemv:
    """The loaded library: ``gemv(P, x, bias)`` on blocked float32, bfloat16 or float16 weights,
    computed in float32."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        lib.flexplan_gemv_isa.restype = ctypes.c_char_p
        lib.flexplan_gemv_block.restype = ctypes.c_int
        self.isa = lib.flexplan_gemv_isa().decode()
        self.block = int(lib.flexplan_gemv_block())
        self._gemv = lib.flexplan_blocked_gemv
        self._gemv.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
        self._gemv.restype = ctypes.c_int
        self._dense = lib.flexplan_dense_gemv
        self._dense.argtypes = self._gemv.argtypes
        self._dense.restype = ctypes.c_int
        try:
            self._grouped = lib.flexplan_grouped_gemv
            self._route = lib.flexplan_route_experts
            self._scatter = lib.flexplan_scatter_experts
        except AttributeError:  # built from an older source (bench_cpu_linear.py --dense-source)
            self._grouped = self._route = self._scatter = None
        else:
            self._grouped.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 2
                                      + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2)
            self._grouped.restype = ctypes.c_int
            self._route.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64]
                                    + [ctypes.c_void_p] * 4)
            self._route.restype = ctypes.c_int64
            self._scatter.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64]
            self._scatter.restype = None
        self.has_expert_calls = self._grouped is not None  # grouped_gemv, route_experts, scatter_experts
        self.vector_width = {"avx512f": 16, "avx2": 8}.get(self.isa, 1)
        self._lib = lib  # keeps the library loaded

    def gemv(self, blocked: torch.Tensor, x2d: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x2d @ W.float().T (+ bias)`` for ``blocked`` = W as [out/64, in, 64] (a dtype of
        :data:`WEIGHT_TYPES`); x2d [batch, in] and bias float32, contiguous. Returns a new
        [batch, out] float32 tensor."""
        n_blocks, k, block = blocked.shape
        out = n_blocks * block
        y = torch.empty(x2d.shape[0], out, dtype=torch.float32)
        self._gemv(blocked.data_ptr(), WEIGHT_TYPES[blocked.dtype], x2d.data_ptr(), y.data_ptr(),
                   None if bias is None else bias.data_ptr(), out, k, x2d.shape[0])
        return y

    def grouped_gemv(self, blocked: torch.Tensor, experts: torch.Tensor, row_start: torch.Tensor, x2d: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        """Experts ``experts`` (int64 ids) of a stack of blocked weights [E, out/64, in, 64] (a dtype
        of :data:`WEIGHT_TYPES`, contiguous), expert j on rows ``row_start[j]:row_start[j + 1]`` of
        x2d [rows, in] (int64 ``row_start`` of len(experts) + 1), each with its row of ``bias``
        [E, out] when given; x2d and bias float32, contiguous. Returns a new [rows, out] float32
        tensor, each expert's rows as :meth:`gemv` on that expert gives them."""
        e, n_blocks, k, block = blocked.shape
        out = n_blocks * block
        y = torch.empty(x2d.shape[0], out, dtype=torch.float32)
        self._grouped(blocked.data_ptr(), WEIGHT_TYPES[blocked.dtype], blocked.stride(0), experts.data_ptr(),
                      row_start.data_ptr(), experts.numel(), x2d.data_ptr(), y.data_ptr(),
                      None if bias is None else bias.data_ptr(), out, k)
        return y

    def route_experts(self, top_k_index: torch.Tensor, n_experts: int, x: torch.Tensor | None):
        """The routing ``top_k_index`` [tokens, k] (int64, contiguous) grouped by expert as the eager
        loop takes it (native_gemv.c's flexplan_route_experts): (pairs, experts, row_start, h) with
        pairs the kept (choice * tokens + token) ids stably sorted by expert, experts the selected
        ids ascending, row_start their offsets (len(experts) + 1) and h [len(pairs), in] the rows of
        x [tokens, in] (float32, contiguous) for those pairs (None without x). Experts outside
        [0, n_experts) run nowhere."""
        tokens, k = top_k_index.shape
        slots = tokens * k
        n_ids = min(slots, n_experts)
        ints = torch.empty(slots + 2 * n_ids + 1, dtype=torch.int64)
        h = torch.empty(slots, x.shape[1], dtype=torch.float32) if x is not None else None
        n = self._route(top_k_index.data_ptr(), tokens, k, n_experts, None if x is None else x.data_ptr(),
                        0 if x is None else x.shape[1], ints.data_ptr(), ints[slots:].data_ptr(),
                        ints[slots + n_ids:].data_ptr(), None if h is None else h.data_ptr())
        if n < 0:
            raise MemoryError("routing the experts: out of memory for the per-expert counters")
        row_start = ints[slots + n_ids:slots + n_ids + n + 1]
        kept = int(row_start[n])
        return ints[:kept], ints[slots:slots + n], row_start, None if h is None else h[:kept]

    def scatter_experts(self, h: torch.Tensor, weights: torch.Tensor, pairs: torch.Tensor, tokens: int) -> torch.Tensor:
        """[tokens, width] float32: 0, then row r of h [rows, width] times its routing weight
        (``weights`` [tokens, k] float32, contiguous) added to its token's row in row order, each
        product rounded before the sum: torch's ``h * w`` then ``index_add_``, bit for bit."""
        rows, width = h.shape
        out = torch.empty(tokens, width, dtype=torch.float32)
        self._scatter(h.data_ptr(), weights.data_ptr(), pairs.data_ptr(), rows, tokens, weights.shape[1],
                      out.data_ptr(), width)
        return out

    def dense_gemv(self, weight: torch.Tensor, x2d: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x2d @ weight.float().T (+ bias)`` for a dense contiguous [out, in] ``weight`` (a dtype
        of :data:`WEIGHT_TYPES`, ``in`` a multiple of :attr:`vector_width`); x2d [batch, in] and bias
        float32, contiguous. Returns a new [batch, out] float32 tensor."""
        out, k = weight.shape
        y = torch.empty(x2d.shape[0], out, dtype=torch.float32)
        rc = self._dense(weight.data_ptr(), WEIGHT_TYPES[weight.dtype], x2d.data_ptr(), y.data_ptr(),
                         None if bias is None else bias.data_ptr(), out, k, x2d.shape[0])
        if rc:
            raise ValueError(f"dense GEMV: in={k} is not a multiple of {self.vector_width}, or {weight.dtype} "
                             "is not a weight type of the kernel")
        return y


class LayerWeights(ctypes.Structure):
    """``flexplan_layer`` of native_decode.c: one decoder layer's weights and sizes. Each of the
    seven linears (q k v o gate up down) is blocked, the blocked ones of one dtype (``wtype`` its
    :data:`WEIGHT_TYPES` code), or a GGUF file's raw blocks (``qtype[j]`` its ggml type id, 0 for
    blocked; ``float_act`` the exact float-activation path); ``qn`` / ``kn`` a QK-norm's weights
    (None: none) over the last ``qn_width`` / ``kn_width`` elements of q's and k's rows. With
    ``n_experts`` > 0 the layer's feed-forward is a routed mixture of experts instead of gate/up/down:
    ``router`` [E, hidden] float32, each expert's gate_up / down blocks at ``egu`` / ``ed`` (GGUF
    types ``egu_type`` / ``ed_type``, expert strides in bytes), biases ``begu`` / ``bed`` or None; a shared
    expert (Qwen2-MoE's) in the gate/up/down slots, scaled by sigmoid(``sgate`` . x) where given."""

    _fields_ = ([(n, ctypes.c_void_p) for n in ("ln1", "ln2", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo",
                                                "wg", "wu", "wd", "bg", "bu", "bd")]
                + [(n, ctypes.c_int64) for n in ("hidden", "inter", "hq", "hk", "d", "wtype")]
                + [(n, ctypes.c_float) for n in ("eps1", "eps2", "scale")]
                + [("qtype", ctypes.c_int64 * 7), ("float_act", ctypes.c_int64)]
                + [("qn", ctypes.c_void_p), ("kn", ctypes.c_void_p), ("qn_width", ctypes.c_int64),
                   ("kn_width", ctypes.c_int64), ("eps_q", ctypes.c_float), ("eps_k", ctypes.c_float)]
                + [(n, ctypes.c_void_p) for n in ("router", "egu", "ed", "begu", "bed")]
                + [(n, ctypes.c_int64) for n in ("n_experts", "top_k", "norm_topk", "moe_inter", "egu_type", "ed_type",
                                                 "egu_stride", "ed_stride", "moe_float_act")]
                + [("sgate", ctypes.c_void_p)])


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


ATTENTION_KV_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # caches the decode attention reads: its suffix


class NativeDecode:
    """The loaded fused decode ops (``native_decode.c``), float32 CPU tensors only (the decode
    attention also reads a bfloat16 KV cache)."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._rmsnorm = lib.flexplan_rmsnorm_f32
        self._rmsnorm.argtypes = [ptr, ptr, ptr, i64, i64, f32]
        self._rmsnorm.restype = None
        self._rope = lib.flexplan_rope_f32
        self._rope.argtypes = [ptr, ptr, ptr, i64, i64, i64]
        self._rope.restype = None
        self._attention = {}  # KV dtype -> its kernel
        for dtype, name in ATTENTION_KV_DTYPES.items():
            fn = getattr(lib, f"flexplan_decode_attention_{name}")
            fn.argtypes, fn.restype = [ptr] * 5 + [i64] * 8 + [f32], ctypes.c_int
            self._attention[dtype] = fn
        self._pre = lib.flexplan_layer_pre_attention_f32
        self._pre.argtypes = [ctypes.POINTER(LayerWeights)] + [ptr] * 3 + [i64] + [ptr] * 4
        self._pre.restype = ctypes.c_int
        self._post = lib.flexplan_layer_post_attention_f32
        self._post.argtypes = [ctypes.POINTER(LayerWeights)] + [ptr] * 6 + [i64] * 5 + [ptr] * 5
        self._post.restype = ctypes.c_int
        self._stack = lib.flexplan_decode_stack_f32
        self._stack.argtypes = [ptr, i64, ptr, ptr, i64, i64] + [ptr] * 13 + [i64, ptr, ctypes.c_float, ptr]
        self._stack.restype = ctypes.c_int
        self._moe_silu = lib.flexplan_moe_silu_f32
        self._moe_silu.argtypes = [ptr, ptr, i64, i64, i64] + [ptr] * 4 + [i64] * 3 + [ptr, i64, i64, ptr]
        self._moe_silu.restype = ctypes.c_int
        self._quant_moe_silu = lib.flexplan_quant_moe_silu
        self._quant_moe_silu.argtypes = [ptr, i64, i64, ptr, i64, i64] + [ptr] * 4 + [i64] * 3 + [ptr, i64, i64, ptr, i64]
        self._quant_moe_silu.restype = ctypes.c_int
        self._lib = lib

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * x / sqrt(mean(x**2, -1) + eps)`` for a contiguous x [..., n] and weight [n]."""
        n = x.shape[-1]
        y = torch.empty_like(x)
        self._rmsnorm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
        return y

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotary embedding in place on x [tokens, heads, d] (contiguous) with cos/sin [tokens, d]."""
        tokens, heads, d = x.shape
        self._rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, d)

    def moe_silu(self, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None,
                 down_bias: torch.Tensor | None, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 x: torch.Tensor) -> torch.Tensor:
        """One MoE layer's routed experts with transformers' default gate, SiLU(gate) * up, in one
        call (native_decode.c's flexplan_moe_silu_f32): blocked gate_up [E, 2I/64, H, 64] and down
        [E, H/64, I, 64] of one :data:`WEIGHT_TYPES` dtype, contiguous; biases [E, 2I] and [E, H]
        float32 or None; top_k_index [T, k] int64 and top_k_weights [T, k] float32, x [T, H]
        float32, all contiguous. Returns [T, H] float32."""
        e, nb, hidden, bl = gate_up.shape
        tokens, k = top_k_index.shape
        out = torch.empty(tokens, hidden, dtype=torch.float32)
        rc = self._moe_silu(gate_up.data_ptr(), down.data_ptr(), WEIGHT_TYPES[gate_up.dtype], gate_up.stride(0),
                            down.stride(0), _ptr(gate_up_bias), _ptr(down_bias), top_k_index.data_ptr(),
                            top_k_weights.data_ptr(), tokens, k, e, x.data_ptr(), hidden, nb * bl // 2, out.data_ptr())
        if rc:
            raise MemoryError(f"routed experts: out of memory for the scratch of {tokens} x {k} routed rows")
        return out

    def quant_moe_silu(self, gate_up: torch.Tensor, gate_up_type: int, down: torch.Tensor, down_type: int,
                       gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor, x: torch.Tensor, intermediate: int, float_act: bool) -> torch.Tensor:
        """:meth:`moe_silu` on a GGUF file's blocks (native_decode.c's flexplan_quant_moe_silu):
        gate_up [E, 2I, row bytes] and down [E, H, row bytes] uint8 contiguous, of the kernels' type
        ids (quant.kernels.wtype); each selected expert's rows one quantised GEMM per projection."""
        tokens, k = top_k_index.shape
        hidden = down.shape[1]
        out = torch.empty(tokens, hidden, dtype=torch.float32)
        rc = self._quant_moe_silu(gate_up.data_ptr(), gate_up_type, gate_up.stride(0), down.data_ptr(), down_type,
                                  down.stride(0), _ptr(gate_up_bias), _ptr(down_bias), top_k_index.data_ptr(),
                                  top_k_weights.data_ptr(), tokens, k, gate_up.shape[0], x.data_ptr(), hidden,
                                  intermediate, out.data_ptr(), int(float_act))
        if rc:
            raise MemoryError(f"routed experts on blocks: out of memory for {tokens} x {k} routed rows")
        return out

    def decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float) -> torch.Tensor:
        """softmax(q k^T * scale) v for one query per sequence: q [b, hq, d] float32 contiguous; k, v
        [b, hk, T, d] views of one of :data:`ATTENTION_KV_DTYPES` with the same strides and the last
        dimension contiguous (bfloat16 is read as it is, widened exactly); mask [b, T] bool (True =
        attend, contiguous) or None. Returns [b, hq, d] float32."""
        b, hq, d = q.shape
        hk, t = k.shape[1], k.shape[2]
        out = torch.empty_like(q)
        rc = self._attention[k.dtype](q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                      None if mask is None else mask.data_ptr(), out.data_ptr(), b, hq, hk, t, d,
                                      k.stride(0), k.stride(1), k.stride(2), scale)
        if rc != 0:
            raise MemoryError(f"native decode attention could not allocate scores for {t} keys")
        return out

    def layer_pre_attention(self, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            xn: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """RMSNorm, q/k/v GEMVs and rotary embedding of x [batch, hidden] into q [batch, hq*d] and
        k, v [batch, hk*d] (xn: scratch [batch, hidden]); cos/sin [batch, d]."""
        if self._pre(ctypes.byref(lw), x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], xn.data_ptr(),
                     q.data_ptr(), k.data_ptr(), v.data_ptr()):
            raise MemoryError(f"native decoder layer: out of memory for {x.shape[0]} quantised activation rows")

    def layer_post_attention(self, lw: LayerWeights, x: torch.Tensor, y: torch.Tensor, q: torch.Tensor,
                             keys: torch.Tensor | None, values: torch.Tensor | None, mask: torch.Tensor | None,
                             scratch: dict[str, torch.Tensor]) -> None:
        """y [batch, hidden] = the layer's output for input x: attention of q over keys/values
        (as :meth:`decode_attention`; with keys None, ``scratch["attn"]`` already holds it), o GEMV +
        residual, RMSNorm, SiLU MLP (or routed experts) + residual."""
        t, strides = (0, (0, 0, 0)) if keys is None else (keys.shape[2], keys.stride()[:3])
        rc = self._post(ctypes.byref(lw), x.data_ptr(), y.data_ptr(), q.data_ptr(), _ptr(keys), _ptr(values),
                        _ptr(mask), t, *strides, x.shape[0], scratch["attn"].data_ptr(), scratch["tmp"].data_ptr(),
                        scratch["xn"].data_ptr(), scratch["g"].data_ptr(), scratch["u"].data_ptr())
        if rc != 0:
            raise MemoryError(f"native decoder layer: out of memory for attention's scores over {t} keys or "
                              "a quantised activation")

    def decode_stack(self, layers, n: int, k_caches, v_caches, pos: int, x: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, mask: torch.Tensor | None, scratch: dict[str, torch.Tensor],
                     embed: tuple[torch.Tensor, torch.Tensor] | None = None,
                     norm: tuple[torch.Tensor, float, torch.Tensor] | None = None) -> bool:
        """One decode step through ``n`` decoder layers: ``layers`` an array of pointers to their
        :class:`LayerWeights`, ``k_caches``/``v_caches`` arrays of pointers to each layer's
        [capacity, batch, hk, d] float32 cache, whose position ``pos`` receives this step's k and v;
        x [batch, hidden] holds the embeddings in (with ``embed`` = (weight [vocab, hidden], ids
        [batch] int64), their rows looked up there first) and the last layer's output out; mask
        [batch, pos + 1] bool or None; cos/sin [batch, d]; ``norm`` = (weight [hidden], eps, out
        [batch, hidden]): the final RMSNorm of the output into out. Scratch as
        :meth:`layer_post_attention`, plus ``y`` [batch, hidden]. All float32, contiguous. False
        (nothing computed) where an id is not a row of the embedding."""
        e, ids = embed if embed is not None else (None, None)
        w, eps, out = norm if norm is not None else (None, 0.0, None)
        rc = self._stack(layers, n, k_caches, v_caches, pos, x.shape[0], cos.data_ptr(), sin.data_ptr(), _ptr(mask),
                         x.data_ptr(), *(scratch[k].data_ptr() for k in ("y", "q", "attn", "tmp", "xn", "g", "u")),
                         _ptr(e), _ptr(ids), 0 if e is None else e.shape[0], _ptr(w), eps, _ptr(out))
        if rc == -2:
            return False
        if rc != 0:
            raise MemoryError(f"native decode attention could not allocate scores for {pos + 1} keys")
        return True


def _cache_root() -> Path:
    return cache_dir() / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    return None


def _compile(cc: str, target: Path, sources: tuple[Path, ...] = (SOURCE,)) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *CFLAGS, *map(str, sources), "-o", tmp], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(r.stderr or r.stdout).strip()[-400:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _self_check(native: NativeGemv) -> None:
    """Both kernels against F.linear in float64 on odd sizes, with and without bias and batch rows
    past one group, for each weight dtype (16-bit weights widened exactly); raises if one is off."""
    g = torch.Generator().manual_seed(0)

    def blocked(w, x, b):
        out, k = w.shape
        return native.gemv(w.view(out // native.block, native.block, k).transpose(1, 2).contiguous(), x, b)

    # (name, kernel, sizes (out, in, batch, bias)): the dense kernel's outs not a multiple of its 4 rows,
    # and above 32 batch rows its 64-row panels with rows left over; the blocked kernel's AVX2 panels
    # from 160 rows, with 1 and 5 rows left over; below them the row passes spreading the next chunk's fetch
    kernels = (("blocked", blocked, ((128, 37, 1, True), (64, 300, 6, False), (192, 64, 3, True),
                                     (64, 40, 161, True), (64, 33, 165, False), (128, 70, 9, True))),
               ("dense", native.dense_gemv, ((7, 64, 1, True), (130, 96, 6, False), (4, 32, 11, True),
                                              (130, 96, 40, True))))
    experts = torch.randn(3, 128, 48, generator=g)  # the grouped kernel: experts 2 and 0 of 3, 2 and 3 rows
    stack = experts.view(3, 2, native.block, 48).transpose(2, 3).contiguous()
    x, bias = torch.randn(5, 48, generator=g), torch.randn(3, 128, generator=g)
    y = native.grouped_gemv(stack, torch.tensor([2, 0]), torch.tensor([0, 2, 5]), x, bias)
    for j, (e, lo, hi) in enumerate(((2, 0, 2), (0, 2, 5))):
        if not torch.equal(y[lo:hi], native.gemv(stack[e], x[lo:hi].contiguous(), bias[e].contiguous())):
            raise RuntimeError(f"self-check failed (grouped kernel): expert {e} differs from the blocked kernel's")
    idx = torch.tensor([[2, 0], [2, -1], [0, 2]])  # the routing calls: pairs by expert, rows, weighted sum
    pairs, ids, starts, h = native.route_experts(idx, 3, x[:3].contiguous())
    weights = torch.rand(3, 2, generator=g)
    if pairs.tolist() != [2, 3, 0, 1, 5] or ids.tolist() != [0, 2] or starts.tolist() != [0, 2, 5] \
            or not torch.equal(h, x[:3][pairs % 3]) or not torch.equal(
                native.scatter_experts(h, weights, pairs, 3),
                torch.zeros(3, 48).index_add_(0, pairs % 3, h * weights.t().reshape(-1)[pairs, None])):
        raise RuntimeError("self-check failed (expert routing or weighted sum)")
    for name, kernel, sizes in kernels:
        for (out, k, batch, with_bias), dtype in ((size, d) for size in sizes for d in WEIGHT_TYPES):
            w = torch.randn(out, k, generator=g).to(dtype)
            x = torch.randn(batch, k, generator=g)
            b = torch.randn(out, generator=g) if with_bias else None
            y = kernel(w, x, b).double()
            ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
            err = float((y - ref).abs().max() / ref.abs().max())
            if not err < 1e-5:
                raise RuntimeError(f"self-check failed ({name} kernel): relative error {err:.2e} at out={out} "
                                   f"in={k} batch={batch} ({dtype})")


def _unavailable() -> str | None:
    """Why no native library can be built here at all, or None."""
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"disabled by {DISABLE_ENV}=0"
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"native kernels are built for Linux x86-64 only (this is {platform.system()} {platform.machine()})"
    return None


def _library(stem: str, sources: tuple[Path, ...], cc: str) -> Path:
    """The library compiled from ``sources``, from the cache (compiled now when it is not there)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + version.encode() + _cpu_flags().encode()
                         + " ".join(CFLAGS).encode()).hexdigest()[:16]
    target = _cache_root() / f"{stem}-{key}.so"
    if not target.exists():
        _compile(cc, target, sources)
    return target


def _decode_self_check(ops: NativeDecode) -> None:
    """Each fused op against its PyTorch formula (transformers' RMSNorm, rotate_half, SDPA with
    grouped heads and a padding mask) on a strided cache view; raises if one is off."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 40, generator=g), torch.randn(40, generator=g)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    errs = {"rmsnorm": (ops.rmsnorm(x, w, 1e-5) - ref).abs().max() / ref.abs().max()}
    q, cos, sin = torch.randn(2, 4, 8, generator=g), torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    rot = torch.cat((-q[..., 4:], q[..., :4]), -1)
    ref = q * cos[:, None] + rot * sin[:, None]
    ops.rope_(q, cos, sin)
    errs["rope"] = (q - ref).abs().max() / ref.abs().max()
    cache = torch.randn(2, 2, 2, 11, 8, generator=g)  # [k/v, b, hk, capacity, d]: keys are the first 9
    k, v = cache[0, :, :, :9], cache[1, :, :, :9]
    q = torch.randn(2, 4, 8, generator=g)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask[:, None, None], scale=0.3)
    errs["attention"] = (ops.decode_attention(q, k, v, mask, 0.3) - ref[:, :, 0]).abs().max() / ref.abs().max()
    kb, vb = (cache.to(torch.bfloat16)[n, :, :, :9] for n in (0, 1))  # a bf16 cache, read as bf16
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], kb.float().repeat_interleave(2, 1), vb.float().repeat_interleave(2, 1),
        attn_mask=mask[:, None, None], scale=0.3)
    errs["attention bf16 KV"] = (ops.decode_attention(q, kb, vb, mask, 0.3) - ref[:, :, 0]).abs().max() / ref.abs().max()
    errs["moe_silu"] = _moe_silu_error(ops, g)
    bad = {name: float(e) for name, e in errs.items() if not float(e) < 1e-5}
    if bad:
        raise RuntimeError(f"self-check failed: relative error {bad}")


def _moe_silu_error(ops: NativeDecode, g: torch.Generator) -> torch.Tensor:
    """Relative error of :meth:`NativeDecode.moe_silu` against the eager per-expert loop on 5
    experts (2 x 64 wide, hidden 64), 3 tokens picking 2 each, biases included."""
    e, hidden, inter, tokens, k, bl = 5, 64, 64, 3, 2, 64
    gu, dn = torch.randn(e, 2 * inter, hidden, generator=g), torch.randn(e, hidden, inter, generator=g)
    bgu, bdn = torch.randn(e, 2 * inter, generator=g), torch.randn(e, hidden, generator=g)
    x, w = torch.randn(tokens, hidden, generator=g), torch.rand(tokens, k, generator=g)
    idx = torch.tensor([[4, 0], [0, 2], [2, 4]])
    ref = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for c in range(k):
            gate, up = torch.nn.functional.linear(x[t], gu[idx[t, c]], bgu[idx[t, c]]).chunk(2)
            ref[t] += w[t, c] * torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, dn[idx[t, c]],
                                                           bdn[idx[t, c]])
    blocked = [m.reshape(e, m.shape[1] // bl, bl, m.shape[2]).transpose(2, 3).contiguous() for m in (gu, dn)]
    got = ops.moe_silu(blocked[0], blocked[1], bgu, bdn, idx, w, x)
    return (got - ref).abs().max() / ref.abs().max()


def _load(label: str, stem: str, sources: tuple[Path, ...], wrap, check):
    """(the checked library object or None, a one-line reason): built/cached, loaded, self-checked."""
    why = _unavailable()
    if why:
        return None, why
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc)"
    try:
        target = _library(stem, sources, cc)
        lib = wrap(ctypes.CDLL(str(target)), target)
        check(lib)
    except Exception as e:  # noqa: BLE001 - any failure means: no native library, with the reason
        return None, f"{label} unavailable: {type(e).__name__}: {e}"
    return lib, f"{label}{f' ({lib.isa})' if hasattr(lib, 'isa') else ''} from {target}"


@functools.lru_cache(maxsize=None)
def status() -> tuple[NativeGemv | None, str]:
    """(the checked native GEMV or None, a one-line reason)."""
    return _load("native GEMV", "gemv", (SOURCE,), NativeGemv, _self_check)


@functools.lru_cache(maxsize=None)
def decode_status() -> tuple[NativeDecode | None, str]:
    """(the checked fused decode ops or None, a one-line reason; without them the decoder layers
    keep transformers' own ops)."""
    return _load("native decode ops", "decode", DECODE_SOURCES, NativeDecode, _decode_self_check)


def available() -> bool:
    return status()[0] is not None
