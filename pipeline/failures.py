"""Failure reports of a pipeline rank: what failed where, its root cause, and injected faults.

Any exception inside a step becomes a :class:`StageFailure` naming the rank, the step and the
action, with the schedule grid and that action marked. The rank that failed first leaves a note
in the failure directory (when there is one), so the ranks that then lose their peer name the
root cause rather than only "connection closed". ``PIPENAS_FAULT`` injects failures and
interruptions, for the tests that prove no failure hangs a job and every one resumes: see
:func:`parse_fault`.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from .files import atomic_write_text
from .plan.schedule import Action, Schedule, format_grid
from .transport import PeerError

__all__ = ["StageFailure", "FailureReporter", "Fault", "parse_fault", "inject", "STOPPING"]

log = logging.getLogger(__name__)

HOW = ("raise", "kill", "interrupt", "terminate")

# Set when this process is asked to stop (SIGINT/SIGTERM: search.interrupt sets it).
STOPPING = threading.Event()


class Fault(NamedTuple):
    rank: int
    step: int
    action: str  # a schedule action (``1F0``), a phase (``plan``, ``migrate``, ...) or an app point
    how: str  # one of HOW
    attempt: int | None = None  # torchrun's TORCHELASTIC_RESTART_COUNT it fires in; None: every attempt


class StageFailure(RuntimeError):
    """A step failed on this rank; the message names rank, step and action."""

    def __init__(self, message: str, rank: int, step: int, action: str) -> None:
        super().__init__(message)
        self.rank, self.step, self.action = rank, step, action


class FailureReporter:
    def __init__(self, rank: int, schedule: Schedule, failure_dir: Path | None, faults: Sequence[Fault] = (),
                 where: str | None = None) -> None:
        self.rank = rank
        self.where = where if where is not None else f"stage {rank}"  # "replica k, stage s" on a mesh
        self.schedule = schedule
        self.failure_dir = failure_dir
        self.faults = tuple(faults)
        self.failed = False
        self._started = time.time()  # notes older than this belong to an earlier attempt

    @contextmanager
    def failing(self, step: int, action: Action | str, mark: Action | None = None) -> Iterator[None]:
        """Turn any exception in the block into a :class:`StageFailure` for (step, action).
        ``mark``: the action as the schedule lists it, when ``action`` is shown otherwise (a
        cross-subnet schedule's ``1F0@5`` is step ``step``'s ``1F0``)."""
        try:
            inject(self.faults, self.rank, step, str(action))
            yield
        except StageFailure:
            raise
        except Exception as e:
            raise self._failure(step, action, e, mark) from e

    def _failure(self, step: int, action: Action | str, e: Exception, mark: Action | None = None) -> StageFailure:
        self.failed = True
        where = f"rank {self.rank} ({self.where}) failed at step {step} during {action}"
        cause = f"{type(e).__name__}: {e}"
        if isinstance(e, PeerError):
            root = self._root_cause()
            if root:
                cause += f"\n  root cause: {root}"
        elif self.failure_dir is not None:
            atomic_write_text(self.failure_dir / f"rank{self.rank}.json",
                              json.dumps({"rank": self.rank, "step": step, "action": str(action), "error": cause}))
        mark = mark if mark is not None else action
        grid = format_grid(self.schedule, mark=mark, around=12) if isinstance(mark, Action) else ""
        msg = f"{where}: {cause}" + (f"\nschedule ({self.schedule.name}), failing action marked:\n{grid}" if grid else "")
        log.error("%s: %s", where, cause)
        return StageFailure(msg, self.rank, step, str(action))

    def _root_cause(self, wait_s: float = 2.0) -> str | None:
        """The first note another rank of this attempt left, waiting briefly for it to land (not
        once the process is asked to stop: torchrun signals the survivors of a rank it saw die,
        which may have been killed and will leave no note)."""
        if self.failure_dir is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            notes = sorted(self.failure_dir.glob("rank*.json")) if self.failure_dir.exists() else []
            for note in notes:
                try:
                    if note.stat().st_mtime < self._started - 1.0:
                        continue
                    d = json.loads(note.read_text())
                except (OSError, ValueError):
                    continue
                if d.get("rank") != self.rank:
                    return f"rank {d['rank']} failed at step {d['step']} during {d['action']}: {d['error']}"
            if time.monotonic() > deadline or STOPPING.is_set():
                return None
            time.sleep(0.1)


def inject(faults: Sequence[Fault], rank: int, step: int, action: str) -> None:
    """Fire the faults meant for (rank, step, action) in this attempt: raise, SIGKILL this process,
    or do what Ctrl-C (``interrupt``) or ``kill`` (``terminate``) does to the job: SIGINT/SIGTERM to
    torchrun's agent, which passes it on to every rank, or to this process outside torchrun."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for f in faults:
        if (f.rank, f.step, f.action) != (rank, step, action) or f.attempt not in (None, attempt):
            continue
        if f.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if f.how in ("interrupt", "terminate"):
            target = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
            os.kill(target, signal.SIGINT if f.how == "interrupt" else signal.SIGTERM)
            continue
        raise RuntimeError(f"injected fault (PIPENAS_FAULT) at rank {rank}, step {step}, action {action}")


def parse_fault(text: str | None) -> tuple[Fault, ...]:
    """``PIPENAS_FAULT=<fault>[,<fault>...]``, each ``<rank>:<step>:<action>:<how>[:<attempt>]``
    with ``how`` one of raise, kill, interrupt, terminate (for tests)."""
    if not text:
        return ()
    faults = []
    for part in text.split(","):
        try:
            rank, step, action, how, *attempt = part.split(":")
            if how not in HOW or len(attempt) > 1:
                raise ValueError
            faults.append(Fault(int(rank), int(step), action, how, int(attempt[0]) if attempt else None))
        except ValueError:
            raise ValueError(f"PIPENAS_FAULT: expected <rank>:<step>:<action>:<{'|'.join(HOW)}>[:<attempt>], "
                             f"found {part!r}") from None
    return tuple(faults)
