"""Ctrl-C and SIGTERM: the first stops the run cleanly, the second exits at once.

:class:`Interrupts` handles SIGINT and SIGTERM while installed (main thread only). The first
signal is only recorded; the run notices it between steps (all ranks alike, through
:class:`pipeline.stop.StopVote`), writes a checkpoint and raises :class:`Interrupted`, which the
CLI reports with where and how to resume, exiting 128 + the signal number (130 for SIGINT, 143
for SIGTERM). A second signal exits at once with that status: writes in flight are settled first
(:func:`pipeline.files.settle_writes`), so every checkpoint on disk stays whole. A SIGTERM within
a second of the first signal is taken for a copy of it: a scheduler (Slurm) signals every process
of a job, and torchrun's agent passes on the signal it got as well.

Under torchrun a Ctrl-C reaches the agent (the ranks run in sessions of their own); the agent
passes it on to every rank and kills what is left after 30 s. The ranks agree on the step to stop
after within a fraction of a second (:class:`pipeline.stop.StopVote`).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from pipeline.failures import STOPPING
from pipeline.files import settle_writes

__all__ = ["Interrupts", "Interrupted", "exit_status"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
COPY_WINDOW_S = 1.0  # a SIGTERM this soon after the first signal is a copy of it, not a second request


def exit_status(signum: int) -> int:
    """The shell's status for a process ended by ``signum`` (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


class Interrupted(Exception):
    """The run stopped on a signal after writing its checkpoint (or with nothing to save)."""

    def __init__(self, message: str, signum: int, checkpoint: Path | None, step: int | None) -> None:
        super().__init__(message)
        self.signum, self.checkpoint, self.step = signum, checkpoint, step

    @property
    def status(self) -> int:
        return exit_status(self.signum)


class Interrupts:
    """Records the first SIGINT/SIGTERM while installed; exits at once on the second.

    ``on_second`` is called with the signal number and the files :func:`settle_writes` completed,
    before that exit (the CLI prints a line). ``announce``: say on stderr that the first signal was
    heard (rank 0 only under torchrun). Not installed (or off the main thread), :attr:`signum`
    stays ``None``.
    """

    def __init__(self, on_second: Callable[[int, list[Path]], None] | None = None, announce: bool = True) -> None:
        self.signum: int | None = None
        self._first_at = 0.0
        self.on_second, self.announce = on_second, announce
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def install(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        STOPPING.clear()

    def __enter__(self) -> Interrupts:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self._first_at = signum, time.monotonic()
            STOPPING.set()  # a rank failing now does not wait for a peer's note
            if self.announce:
                    print(f"{signal.Signals(signum).name}: stopping after this step and saving a checkpoint "
                      "(send it again to exit at once)", file=sys.stderr, flush=True)
            return
        if signum == signal.SIGTERM and time.monotonic() - self._first_at < COPY_WINDOW_S:
            return  # a copy of the first: a scheduler signals every process of the job, torchrun passes its own on
        written = settle_writes()  # a write cut short could leave a temporary file; a durable one completes
        if self.on_second is not None:
            try:
                self.on_second(signum, written)
            except Exception:  # noqa: BLE001 - exiting regardless
                pass
        sys.stderr.flush()
        os._exit(exit_status(signum))
