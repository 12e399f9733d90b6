"""Measured host memory bandwidth, STREAM style (McCalpin, https://www.cs.virginia.edu/stream/).

Two kernels on float32 arrays of ``n_bytes`` each, run with torch's intra-op threads:

- triad ``a = b + s * c`` (``torch.add(b, c, alpha=s, out=a)``): counted as 3 arrays moved
  per iteration (read b, read c, write a), i.e. ``3 * n_bytes``;
- copy ``a = b`` (``a.copy_(b)``): counted as 2 arrays moved (read b, write a).

As in STREAM, write-allocate traffic (the cache line of ``a`` read before being written)
is not counted, so these are the figures STREAM itself would print. Each kernel runs once
untimed (page faults, thread start-up), then ``repeats`` times; the best time is kept.
The arrays must be much larger than the last-level cache (the default, 3 x 256 MB, is).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

DEFAULT_ARRAY_BYTES = 256 * 2**20
DEFAULT_REPEATS = 5


@contextmanager
def torch_threads(threads: int | None):
    """torch's intra-op thread count set to ``threads`` (None: unchanged) for the block."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _best_rate_bytes_per_s(kernel: Callable[[], None], bytes_moved: float, repeats: int) -> float:
    kernel()  # untimed warm-up
    best_s = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        kernel()
        best_s = min(best_s, time.perf_counter() - t0)
    return bytes_moved / best_s


def _arrays(n_bytes: int, count: int):
    import torch

    n = max(1, int(n_bytes) // 4)
    # Filled (not torch.empty) so every page is touched before timing starts.
    return [torch.full((n,), float(i + 1), dtype=torch.float32) for i in range(count)], 4 * n


def stream_triad_bytes_per_s(n_bytes: int = DEFAULT_ARRAY_BYTES, threads: int | None = None,
                             repeats: int = DEFAULT_REPEATS) -> float:
    """STREAM triad ``a = b + 3 * c`` on three float32 arrays of ``n_bytes`` each; bytes/s,
    counting ``3 * n_bytes`` per iteration. ``threads``: torch intra-op threads (None: as set)."""
    import torch

    with torch_threads(threads):
        (a, b, c), size = _arrays(n_bytes, 3)
        return _best_rate_bytes_per_s(lambda: torch.add(b, c, alpha=3.0, out=a), 3 * size, repeats)


def copy_bytes_per_s(n_bytes: int = DEFAULT_ARRAY_BYTES, threads: int | None = None,
                     repeats: int = DEFAULT_REPEATS) -> float:
    """STREAM copy ``a = b`` on two float32 arrays of ``n_bytes`` each; bytes/s, counting
    ``2 * n_bytes`` per iteration."""
    with torch_threads(threads):
        (a, b), size = _arrays(n_bytes, 2)
        return _best_rate_bytes_per_s(lambda: a.copy_(b), 2 * size, repeats)


if __name__ == "__main__":
    print(f"triad: {stream_triad_bytes_per_s() / 1e9:.1f} GB/s")
    print(f"copy:  {copy_bytes_per_s() / 1e9:.1f} GB/s")
