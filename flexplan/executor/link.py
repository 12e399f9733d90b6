"""The host <-> accelerator link: memory, streams, events, copies, and a log of what crossed.

One small abstraction over "stream / event / pin" so that every executor path runs without a
GPU. On CUDA it is the real thing: a separate copy stream, ``torch.cuda.Event`` and page-locked
(pinned) host memory. With ``accelerator="cpu"`` (the stand-in) the "accelerator" is this CPU:
buffers are ordinary host tensors, copies are synchronous ``memcpy``s and events are no-ops,
but every buffer, copy and prefetch still goes through here, so tests can count the bytes
moved per direction and check the order of prefetches against computation.

Memory is allocated only through :meth:`Link.alloc`, which keeps a registry of live buffers
(``live_bytes``) and a count of every allocation ever made (``allocations``): "pin once" (Park
& Egger, sections 2.3 and 3.1) is then something a test can assert.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch

HOST = torch.device("cpu")

# Where a buffer lives (flexplan.placement's names): accelerator memory (the stand-in: host memory
# playing the part), page-locked host memory (the source/target of asynchronous copies), ordinary
# pageable host memory (stationary CPU-computed weights).
from flexplan.errors import InvalidInputError
from flexplan.placement import ACCELERATOR, PINNED  # noqa: E402
from flexplan.placement import HOST as HOST_MEMORY  # noqa: E402

WHERE = (ACCELERATOR, PINNED, HOST_MEMORY)

# Directions of a copy. Host-to-host conversions do not cross the link but are logged too.
H2D, D2H, H2H = "h2d", "d2h", "h2h"


@dataclass(frozen=True)
class Transfer:
    """One copy: which way, what (``weights``, ``kv``, ``kv-switch``, ``hidden``, ``aux``,
    ``logits``, ``load``), for which decoder layer, how many bytes, in which phase and step."""

    direction: str
    kind: str
    layer: int | None
    nbytes: int
    phase: str | None
    step: int


@dataclass
class Buffer:
    """A flat byte buffer handed out by :meth:`Link.alloc`; ``tensor`` is uint8."""

    tensor: torch.Tensor
    where: str
    tag: str
    nbytes: int = field(init=False)

    def __post_init__(self):
        self.nbytes = int(self.tensor.numel() * self.tensor.element_size())


class _NullEvent:
    """Stand-in for ``torch.cuda.Event``: everything is already synchronous."""

    def record(self, stream=None):  # noqa: D401 - mirrors torch.cuda.Event
        pass

    def synchronize(self):
        pass


class Link:
    """Allocations, streams and copies between host memory and one accelerator."""

    def __init__(self, accelerator: str | torch.device):
        self.device = torch.device(accelerator)
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cuda", "cpu"):
            raise InvalidInputError(f"accelerator {accelerator!r} is not supported; use 'cuda' or 'cpu' (the stand-in)")
        self.copy_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.transfers: list[Transfer] = []
        # host-side order: ("prefill"/"decode", step) at each step, then ("prefetch", i), ("compute", i), ("computed", i)
        self.order: list[tuple[str, int | None]] = []
        self.phase: str | None = None
        self.step = 0
        self.allocations: Counter[str] = Counter()  # allocations ever made, per `where`
        self._live: dict[int, Buffer] = {}

    @property
    def name(self) -> str:
        return str(self.device) if self.is_cuda else "cpu (stand-in accelerator)"

    # ---- memory -----------------------------------------------------------------------
    def alloc(self, nbytes: int, where: str, tag: str) -> Buffer:
        """A new uint8 buffer of ``nbytes`` in accelerator, pinned or pageable host memory."""
        nbytes = int(nbytes)
        if where == ACCELERATOR:
            t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        elif where == PINNED and self.is_cuda:
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        elif where in (PINNED, HOST_MEMORY):
            t = torch.empty(nbytes, dtype=torch.uint8)
        else:
            raise ValueError(f"unknown memory {where!r}")
        buf = Buffer(t, where, tag)
        self._live[id(buf)] = buf
        self.allocations[where] += 1
        return buf

    def adopt(self, tensor: torch.Tensor, where: str, tag: str) -> Buffer:
        """Register a tensor made elsewhere (a oneDNN-packed weight) as a live buffer of ``where``."""
        buf = Buffer(tensor, where, tag)
        self._live[id(buf)] = buf
        self.allocations[where] += 1
        return buf

    def free(self, buf: Buffer | None) -> None:
        if buf is not None:
            self._live.pop(id(buf), None)
            buf.tensor = torch.empty(0, dtype=torch.uint8)

    def live_bytes(self, where: str | None = None) -> int:
        return sum(b.nbytes for b in self._live.values() if where is None or b.where == where)

    def live_buffers(self, where: str | None = None) -> list[Buffer]:
        return [b for b in self._live.values() if where is None or b.where == where]

    # ---- streams and events -------------------------------------------------------------
    def event(self):
        return torch.cuda.Event() if self.is_cuda else _NullEvent()

    def record(self, event, on_copy_stream: bool = False) -> None:
        """Record ``event`` on the copy stream or on the current (compute) stream."""
        if self.is_cuda:
            event.record(self.copy_stream if on_copy_stream else torch.cuda.current_stream(self.device))

    def wait(self, event, on_copy_stream: bool = False) -> None:
        """Make the copy stream or the compute stream wait for ``event`` (no host block)."""
        if self.is_cuda and event is not None:
            (self.copy_stream if on_copy_stream else torch.cuda.current_stream(self.device)).wait_event(event)

    def copy_stream_waits_compute(self) -> None:
        """Order later copies after everything already issued on the compute stream."""
        if self.is_cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))

    @contextlib.contextmanager
    def on_copy_stream(self):
        if self.is_cuda:
            with torch.cuda.stream(self.copy_stream):
                yield
        else:
            yield

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    # ---- copies ---------------------------------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str, kind: str, layer: int | None = None) -> None:
        """``dst.copy_(src)`` asynchronously where the memory allows; logged. Call inside
        :meth:`on_copy_stream` to overlap with computation."""
        dst.copy_(src, non_blocking=self.is_cuda and direction != H2H)
        self.log(direction, kind, layer, src.numel() * src.element_size())

    def move(self, t: torch.Tensor, to_accelerator: bool, dtype: torch.dtype | None, kind: str,
             layer: int | None = None) -> torch.Tensor:
        """A copy of ``t`` on the accelerator (or back on the host), optionally cast; logged.
        The stand-in makes a real copy so that no host tensor is shared with the "accelerator"."""
        dev = self.device if to_accelerator else HOST
        nbytes = t.numel() * t.element_size()
        if self.is_cuda:
            out = t.to(dev, non_blocking=to_accelerator)
        else:
            out = t.clone()
        if dtype is not None and out.dtype != dtype:
            out = out.to(dtype)
        self.log(H2D if to_accelerator else D2H, kind, layer, nbytes)
        return out

    def log(self, direction: str, kind: str, layer: int | None, nbytes: int) -> None:
        self.transfers.append(Transfer(direction, kind, layer, int(nbytes), self.phase, self.step))

    def note(self, what: str, layer: int | None = None) -> None:
        """Record the host-side order of prefetches and computations (tests check it)."""
        self.order.append((what, layer))

    def reset_log(self) -> None:
        self.transfers.clear()
        self.order.clear()
        self.step = 0

    def bytes_moved(self, direction: str, phase: str | None = None, kind: str | None = None,
                    step: int | None = None) -> int:
        return sum(t.nbytes for t in self.transfers
                   if t.direction == direction and (phase is None or t.phase == phase)
                   and (kind is None or t.kind == kind) and (step is None or t.step == step))
