"""The bridge between the HTTP front (asyncio) and the engine (blocking ``step()``): one thread
owns the engine and runs ``step()`` while work exists; each request's outputs reach its handler
through its own asyncio queue, fed with ``loop.call_soon_threadsafe``. That thread is the loop's own
(:meth:`EngineLoop.start`, from the app's lifespan), or the caller's (:meth:`EngineLoop.run_here`:
``flexplan serve`` steps the engine on the main thread that loaded the model, the HTTP server on
another; see :func:`flexplan.serving.server.run` for why).

Rules:
- only the stepping thread calls the engine (``add_request``, ``abort``, ``step``, ``stats``): a
  handler puts its add or abort in an inbox applied between iterations, so the event loop never
  waits on the engine's lock for a forward pass;
- the waiting queue is bounded (``max_waiting``: requests accepted but not yet running): past it
  ``submit`` raises :class:`QueueFullError` (HTTP 429) at once rather than queueing without end;
- a handler whose client left calls ``abort``: the engine frees the request's KV blocks;
- ``begin_drain(grace_s)``: no new request; those in flight finish, or are aborted once
  ``grace_s`` has passed, and their handlers get :class:`ServerShuttingDown`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from flexplan.errors import FlexplanError
from flexplan.serving.types import (
    EngineStats,
    RequestOutput,
    SamplingParams,
)

log = logging.getLogger("flexplan.serve")

IDLE_WAIT_S = 0.5  # the thread's sleep with no work; an add or abort wakes it at once


class QueueFullError(FlexplanError):
    """The waiting queue holds ``max_waiting`` requests: retry later (HTTP 429)."""


class ServerShuttingDown(FlexplanError):
    """The server is draining: no new request, and one in flight past the grace period is aborted."""


class EngineFailure(FlexplanError):
    """``engine.step()`` raised: the requests it held were aborted (HTTP 500, logged with its trace)."""


@dataclass
class _Tracked:
    """A request in flight, as the loop follows it (times on ``time.perf_counter``)."""

    queue: asyncio.Queue
    arrival_s: float
    first_token_s: float | None = None
    tokens: int = 0
    ended_by: list = field(default_factory=list)  # an exception to hand the handler instead of "abort"


class EngineLoop:
    """Runs ``engine`` on its own thread; ``metrics`` (optional) gets ``observe_step(stats)``,
    ``observe_first_token(seconds)`` and ``observe_finished(output, ttft_s, e2e_s)``."""

    def __init__(self, engine, *, max_waiting: int = 256, metrics=None):
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise FlexplanError(f"max_waiting must be a non-negative integer, got {max_waiting!r}")
        self.engine, self.max_waiting, self.metrics = engine, max_waiting, metrics
        self._lock = threading.Lock()  # guards the inbox, the tracked requests and the counts below
        self._wake = threading.Event()
        self._inbox: list[tuple] = []  # ("add", id, prompt, params) / ("abort", id)
        self._tracked: dict[str, _Tracked] = {}
        self._pending_adds = 0  # adds not yet counted in the engine's waiting (the stats below)
        self._stats = EngineStats()
        self._draining_until: float | None = None  # time.monotonic() past which in-flight requests are aborted
        self._stop = False
        self._thread: threading.Thread | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._attached = threading.Event()  # the event loop is known (run_here waits for it)
        self.hosted = False  # True: run_here() steps the engine on its caller's thread, start() only attaches

    # ---- lifecycle ----
    def start(self) -> None:
        """Start the stepping thread (hosted: let :meth:`run_here` begin); call from the event loop
        that will read the queues."""
        self._aio = asyncio.get_running_loop()
        self._attached.set()
        if not self.hosted:
            self._thread = threading.Thread(target=self._run, name="flexplan-engine-loop", daemon=True)
            self._thread.start()

    def run_here(self, alive) -> bool:
        """Step the engine on this thread (``hosted`` must be set before the app starts) until
        :meth:`stop`, or until ``alive()`` (the HTTP server's thread) turns false. True: stopped
        as asked; False: the server went away first (e.g. it could not bind its port)."""
        while not self._attached.wait(IDLE_WAIT_S):
            if self._stop:
                return True
            if not alive():
                return False
        while True:
            try:
                if self._once():
                    return True
            except Exception as e:  # a bug in the engine: fail its requests, keep serving the next ones
                self._failed(e)
            if not alive():  # no server left to answer: what is in flight is aborted, then this returns
                if self._draining_until is None or self._draining_until > time.monotonic():
                    self._draining_until = time.monotonic()
                if not self.engine.has_unfinished():
                    return self._stop

    def begin_drain(self, grace_s: float) -> None:
        """Refuse new requests; abort those still in flight after ``grace_s`` seconds. Takes no lock:
        a signal handler calls it on the main thread, which may hold the lock in submit()."""
        if self._draining_until is None:
            self._draining_until = time.monotonic() + grace_s
        self._wake.set()

    @property
    def draining(self) -> bool:
        return self._draining_until is not None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort whatever is left and join the thread (after the HTTP server has stopped)."""
        self._draining_until = time.monotonic()
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._tracked)

    def stats(self) -> EngineStats:
        """The engine's counters after its last iteration (a snapshot: never waits on a step)."""
        return self._stats

    # ---- requests (event-loop side) ----
    def submit(self, request_id: str, prompt, params: SamplingParams) -> asyncio.Queue:
        """Queue the request; its queue yields :class:`RequestOutput` items up to a finished one,
        or an exception (the engine refused it, the server shut down, the engine failed)."""
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._draining_until is not None:
                raise ServerShuttingDown("the server is shutting down and takes no new requests")
            waiting = self._pending_adds + self._stats.waiting
            if waiting >= self.max_waiting:
                raise QueueFullError(f"the server's queue is full ({waiting} requests waiting, at most "
                                     f"{self.max_waiting}): retry later")
            self._tracked[request_id] = _Tracked(q, time.perf_counter())
            self._inbox.append(("add", request_id, prompt, params))
            self._pending_adds += 1
        self._wake.set()
        return q

    def abort(self, request_id: str) -> None:
        """The client left: free the request's blocks (no-op once finished)."""
        with self._lock:
            if request_id not in self._tracked:
                return
            self._inbox.append(("abort", request_id))
        self._wake.set()

    # ---- the stepping thread ----
    def _deliver(self, request_id: str, item) -> None:
        """Hand ``item`` to the request's handler; a final item ends its tracking."""
        final = isinstance(item, BaseException) or item.finished
        with self._lock:
            t = self._tracked.pop(request_id, None) if final else self._tracked.get(request_id)
        if t is None:
            return
        if isinstance(item, RequestOutput):
            now = time.perf_counter()
            if item.new_token_ids and t.first_token_s is None:
                t.first_token_s = now
                if self.metrics is not None:
                    self.metrics.observe_first_token(now - t.arrival_s)
            if item.finished and t.ended_by:
                item = t.ended_by[0]
            elif item.finished and self.metrics is not None:
                self.metrics.observe_finished(item, (t.first_token_s or now) - t.arrival_s, now - t.arrival_s)
        try:
            self._aio.call_soon_threadsafe(t.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed (the server exited at once): no handler is left to tell
            pass

    def _apply_inbox(self) -> None:
        with self._lock:
            ops, self._inbox = self._inbox, []
        adds = 0
        for op in ops:
            if op[0] == "add":
                _, rid, prompt, params = op
                adds += 1
                with self._lock:
                    gone = rid not in self._tracked  # aborted before it reached the engine
                if gone:
                    continue
                try:
                    self.engine.add_request(rid, prompt, params)
                except FlexplanError as e:  # the engine's refusal, in its own words: the client's 400
                    self._deliver(rid, e)
            else:
                self.engine.abort(op[1])
        if ops:
            self._refresh_stats(adds)

    def _refresh_stats(self, adds_applied: int = 0) -> None:
        stats = self.engine.stats()
        with self._lock:
            self._stats = stats
            self._pending_adds -= adds_applied
        if self.metrics is not None:
            self.metrics.observe_step(stats)

    def _abort_all(self, reason: BaseException) -> None:
        with self._lock:
            tracked = list(self._tracked.items())
        for rid, t in tracked:
            t.ended_by.append(reason)
            if not self.engine.abort(rid):  # not in the engine (refused, or never added): end it here
                self._deliver(rid, reason)

    def _fail_all(self, reason: BaseException) -> None:
        """The engine raised: every request in flight gets ``reason`` now, and the engine is asked to
        free their blocks (a broken engine may refuse: its clients are answered all the same)."""
        with self._lock:
            ids = list(self._tracked)
        for rid in ids:
            self._deliver(rid, reason)
        try:
            for rid in ids:
                self.engine.abort(rid)
            self.engine.step()  # collects the aborts' outputs (dropped: their clients have their answer)
        except Exception:
            log.debug("the engine failed again while freeing the failed requests", exc_info=True)

    def _run(self) -> None:
        while True:
            try:
                if self._once():
                    return
            except Exception as e:  # a bug in the engine: fail its requests, keep serving the next ones
                self._failed(e)

    def _failed(self, e: Exception) -> None:
        log.exception("the engine failed; answering the requests in flight with an error")
        self._fail_all(EngineFailure(f"the engine failed ({type(e).__name__}: {e}); the request was aborted"))
        self._wake.wait(IDLE_WAIT_S)  # an engine that fails at once again does not spin the CPU
        self._wake.clear()

    def _once(self) -> bool:
        """One pass: the inbox applied, one iteration run (or a wait for work); True: stop now."""
        self._apply_inbox()
        if self._draining_until is not None and time.monotonic() >= self._draining_until and self._tracked:
            self._abort_all(ServerShuttingDown("the server shut down before this request finished"))
        if self.engine.has_unfinished():
            for out in self.engine.step():
                self._deliver(out.request_id, out)
            self._refresh_stats()
            return False
        if self._stop and not self._inbox:
            return True
        if not self._wake.wait(IDLE_WAIT_S) and self.metrics is not None:
            self.metrics.observe_step(self._stats)  # idle: the tokens/s gauge decays to 0 rather than stay stale
        self._wake.clear()
        return False
