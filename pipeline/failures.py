"""Failure reports of a pipeline rank: what failed where, its root cause, and injected faults.

Any exception inside a step becomes a :class:`StageFailure` naming the rank, the step and the
action, with the schedule grid and that action marked. The rank that failed first leaves a note
in the failure directory (when there is one), so the ranks that then lose their peer name the
root cause rather than only "connection closed". ``PIPENAS_FAULT=<rank>:<step>:<action>:<raise|kill>``
injects a failure, for the tests that prove no failure hangs a job.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .files import atomic_write_text
from .plan.schedule import Action, Schedule, format_grid
from .transport import PeerError

__all__ = ["StageFailure", "FailureReporter", "parse_fault"]

log = logging.getLogger(__name__)

Fault = tuple[int, int, str, str]  # rank, step, action, "raise" | "kill"


class StageFailure(RuntimeError):
    """A step failed on this rank; the message names rank, step and action."""

    def __init__(self, message: str, rank: int, step: int, action: str) -> None:
        super().__init__(message)
        self.rank, self.step, self.action = rank, step, action


class FailureReporter:
    def __init__(self, rank: int, schedule: Schedule, failure_dir: Path | None, fault: Fault | None = None,
                 where: str | None = None) -> None:
        self.rank = rank
        self.where = where if where is not None else f"stage {rank}"  # "replica k, stage s" on a mesh
        self.schedule = schedule
        self.failure_dir = failure_dir
        self.fault = fault
        self.failed = False
        self._started = time.time()  # notes older than this belong to an earlier attempt

    @contextmanager
    def failing(self, step: int, action: Action | str, mark: Action | None = None) -> Iterator[None]:
        """Turn any exception in the block into a :class:`StageFailure` for (step, action).
        ``mark``: the action as the schedule lists it, when ``action`` is shown otherwise (a
        cross-subnet schedule's ``1F0@5`` is step ``step``'s ``1F0``)."""
        try:
            self._maybe_fault(step, action)
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
        """The first note another rank of this attempt left, waiting briefly for it to land."""
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
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def _maybe_fault(self, step: int, action: Action | str) -> None:
        f = self.fault
        if f and f[0] == self.rank and f[1] == step and f[2] == str(action):
            if f[3] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected fault (PIPENAS_FAULT) at rank {self.rank}, step {step}, action {action}")


def parse_fault(text: str | None) -> Fault | None:
    """``PIPENAS_FAULT=<rank>:<step>:<action>:<raise|kill>`` injects a failure (for tests)."""
    if not text:
        return None
    try:
        rank, step, action, how = text.split(":")
        if how not in ("raise", "kill"):
            raise ValueError
        return int(rank), int(step), action, how
    except ValueError:
        raise ValueError(f"PIPENAS_FAULT: expected <rank>:<step>:<action>:<raise|kill>, found {text!r}") from None
