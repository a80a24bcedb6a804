"""Stopping on SIGTERM at a step boundary, with a checkpoint (a scheduler's preemption, ``kill``, Ctrl-C's
polite cousin).

Inside :class:`GracefulStop` the first SIGTERM only sets a flag; the training loops ask :meth:`requested`
after each step (every rank at the same point: under ``torchrun`` the ranks agree, so they stop at the same
step even when only some were signalled), save a checkpoint, and return. At most the step in flight when the
signal came is redone after ``--resume``. A second SIGTERM ends the process at once, as without the guard.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings

from paravt_train.infra.distributed import all_reduce_max

__all__ = ["EXIT_CODE", "GracefulStop"]

EXIT_CODE = 128 + signal.SIGTERM  # what the CLI exits with after a stop: "terminated", as a shell reports it


class GracefulStop:
    """A context manager that turns SIGTERM into a request to stop at the next step boundary."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signals = signals
        self.event = threading.Event()
        self.signal_name: str | None = None
        self._old: dict = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._old = {s: signal.signal(s, self._handle) for s in self.signals}
        else:  # a loop run from a thread: SIGTERM keeps its default (the process ends; resume from the last save)
            warnings.warn("training outside the main thread: SIGTERM cannot stop it at a step boundary", stacklevel=2)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def _handle(self, signum, frame) -> None:
        if self.event.is_set():  # the second one: stop now, as without the guard
            old = self._old.get(signum)
            signal.signal(signum, old if old is not None else signal.SIG_DFL)  # None: a handler set outside Python
            os.kill(os.getpid(), signum)
            return
        self.signal_name = signal.Signals(signum).name
        self.event.set()

    def requested(self) -> bool:
        """Whether a stop was asked for here or, under ``torchrun``, on any rank (a collective: every rank calls
        it at the same point of the loop)."""
        asked = all_reduce_max(int(self.event.is_set())) > 0
        if asked and self.signal_name is None:
            self.signal_name = "SIGTERM (another rank)"
        return asked

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` that a stop request ends early."""
        self.event.wait(seconds)
