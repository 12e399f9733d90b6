"""The thread that runs a model's compute: flexplan's OpenMP rule, in one place.

Rule: one thread runs every OpenMP region of a process. libgomp keeps a pool of workers for each
thread that has run a parallel region; once the pools hold more threads than there are cores,
the workers sleep between regions instead of spinning, and every region of a decode step pays
their wake-up. The thread that loads a model runs regions (the load's own ops), so the model is
run on that thread: ``flexplan serve`` steps its engine on the main thread, the one that loaded it
(:func:`flexplan.serving.server.run`), and a model or engine run on another thread says so once
(:meth:`ComputeThread.check`).
"""

from __future__ import annotations

import threading
import warnings


class ComputeThread:
    """The thread an object was built on; :meth:`check` warns once when it is run on another."""

    def __init__(self):
        self.ident = threading.get_ident()
        self.name = threading.current_thread().name
        self.warned = False

    def check(self, what: str) -> None:
        """Warn (once) where the calling thread is not the one this object was built on."""
        if self.warned or threading.get_ident() == self.ident:
            return
        self.warned = True
        warnings.warn(f"{what} runs on thread {threading.current_thread().name!r}, not on {self.name!r}, which "
                      "loaded the model: each thread that computes keeps its own OpenMP worker pool, and with more "
                      "workers than cores they sleep between parallel regions, so a decode can run several times "
                      "slower. Run it on the thread that loaded the model, or load the model on this one.",
                      RuntimeWarning, stacklevel=3)
