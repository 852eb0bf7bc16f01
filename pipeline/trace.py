"""Timeline spans of traced training steps, and their Chrome trace-event file.

A :class:`Tracer` lives on every rank. For the steps it was asked to trace
(``pipeline.trace_steps``) the engine wraps each piece of work in ``tracer.span(step, name,
cat)``; for every other step ``span`` returns one shared no-op context manager (no
allocation, no clock read), so tracing costs nothing when off. Spans measured elsewhere (a
background thread's migration) go in with :meth:`Tracer.add`.

Categories the engines use: ``forward``, ``backward``, ``recv-wait``, ``send``, ``migrate``,
``migrate-ahead``, ``plan``, ``optimizer``, ``swap``.

:func:`chrome_trace` turns the spans of every rank into the Chrome trace-event format (complete
events ``"ph": "X"`` in microseconds, one process per rank named ``rank r``, all ranks on one
time axis starting at the earliest span), which Perfetto (ui.perfetto.dev) and
``chrome://tracing`` open; :func:`write_trace` writes it atomically. :func:`check_trace`
checks the invariant a timeline must hold: within one track, two spans nest or are
disjoint, never partially overlap. Clocks: ``time.perf_counter`` per process; ranks on one
machine share it (CLOCK_MONOTONIC), ranks on several machines are aligned only roughly.
"""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from .files import atomic_write_text

__all__ = ["CATEGORIES", "Span", "Tracer", "TraceError", "chrome_trace", "write_trace", "check_trace", "tracks",
           "busy_and_bubble", "spans_from_chrome"]

CATEGORIES = ("forward", "backward", "recv-wait", "send", "migrate", "migrate-ahead", "plan", "optimizer", "swap")
# Work a stage does itself, as opposed to waiting on others (the report's busy time).
COMPUTE = frozenset({"forward", "backward", "optimizer", "compute"})
# Nested spans may end this much after their parent (perf_counter reads in a different order).
_SLACK_S = 1e-6


class TraceError(ValueError):
    """Spans that do not make a timeline: partial overlaps within a track, negative durations."""


@dataclass(frozen=True)
class Span:
    """One piece of work on one rank: ``start_s`` is ``time.perf_counter()`` at its start."""

    rank: int
    step: int
    name: str
    cat: str
    start_s: float
    dur_s: float
    args: tuple = ()  # sorted (key, value) pairs: hashable, and the same however they were passed

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


class _Off(AbstractContextManager):
    """The context manager of an untraced step: does nothing."""

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()


class Tracer:
    """Records spans of the steps in ``steps`` on rank ``rank``."""

    def __init__(self, rank: int, steps: Iterable[int] = ()) -> None:
        self.rank = rank
        self.steps = frozenset(steps)
        self._spans: list[Span] = []

    def on(self, step: int) -> bool:
        return step in self.steps

    def span(self, step: int, name: str, cat: str = "compute", **args: Any) -> AbstractContextManager:
        """Time the ``with`` block as a span when ``step`` is traced; otherwise a shared no-op."""
        if step not in self.steps:
            return _OFF
        return self._timed(step, name, cat, args)

    @contextmanager
    def _timed(self, step: int, name: str, cat: str, args: dict[str, Any]) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._spans.append(Span(self.rank, step, name, cat, t0, time.perf_counter() - t0,
                                    tuple(sorted(args.items()))))

    def add(self, step: int, name: str, cat: str, start_s: float, dur_s: float, **args: Any) -> None:
        """A span measured elsewhere (``start_s`` on this process's ``perf_counter``)."""
        if step in self.steps:
            self._spans.append(Span(self.rank, step, name, cat, start_s, dur_s, tuple(sorted(args.items()))))

    @property
    def spans(self) -> list[Span]:
        return list(self._spans)

    def clear(self) -> None:
        self._spans.clear()


# -- checking and summarising ------------------------------------------------------------

def tracks(spans: Iterable[Span]) -> dict[int, list[Span]]:
    """Spans per rank, by start (longer first at equal starts: parents before children)."""
    out: dict[int, list[Span]] = defaultdict(list)
    for s in spans:
        out[s.rank].append(s)
    return {r: sorted(v, key=lambda s: (s.start_s, -s.dur_s)) for r, v in sorted(out.items())}


def check_trace(spans: Iterable[Span]) -> None:
    """Raise :class:`TraceError` unless, within every rank's track, any two spans are nested or
    disjoint, and no duration is negative."""
    for rank, track in tracks(spans).items():
        open_: list[Span] = []  # the chain of spans enclosing the current one
        for s in track:
            if s.dur_s < 0:
                raise TraceError(f"rank {rank}: span {s.name!r} (step {s.step}) has a negative duration {s.dur_s}")
            while open_ and open_[-1].end_s <= s.start_s + _SLACK_S:
                open_.pop()
            if open_ and s.end_s > open_[-1].end_s + _SLACK_S:
                p = open_[-1]
                raise TraceError(
                    f"rank {rank}: span {s.name!r} (step {s.step}, {s.start_s:.6f}+{s.dur_s:.6f} s) partially "
                    f"overlaps {p.name!r} (step {p.step}, {p.start_s:.6f}+{p.dur_s:.6f} s); spans of one track "
                    "must nest or be disjoint"
                )
            open_.append(s)


def busy_and_bubble(spans: Iterable[Span]) -> dict[int, dict[int, tuple[float, float, float]]]:
    """Per traced step and rank: ``(busy_s, bubble_s, step_s)``. A step lasts from its earliest
    span's start to its latest span's end over all ranks; a rank is busy where some compute span
    (:data:`COMPUTE`) covers it and no other span (a wait, a send, a migration) inside it does;
    the bubble is the rest of the step."""
    by_step: dict[int, list[Span]] = defaultdict(list)
    for s in spans:
        by_step[s.step].append(s)
    out: dict[int, dict[int, tuple[float, float, float]]] = {}
    for step, ss in sorted(by_step.items()):
        t0, t1 = min(s.start_s for s in ss), max(s.end_s for s in ss)
        per_rank = {}
        for rank, track in tracks(ss).items():
            cuts = sorted({t for s in track for t in (s.start_s, s.end_s)})
            busy = 0.0
            for a, b in zip(cuts, cuts[1:]):
                mid = (a + b) / 2
                over = [s for s in track if s.start_s <= mid < s.end_s]
                if any(s.cat in COMPUTE for s in over) and all(s.cat in COMPUTE for s in over):
                    busy += b - a
            per_rank[rank] = (busy, (t1 - t0) - busy, t1 - t0)
        out[step] = per_rank
    return out


# -- the file ----------------------------------------------------------------------------

def chrome_trace(spans: Sequence[Span]) -> dict[str, Any]:
    """The Chrome trace-event document: one process (track) per rank, times in microseconds
    from the earliest span."""
    t0 = min((s.start_s for s in spans), default=0.0)
    events: list[dict[str, Any]] = []
    for rank in sorted({s.rank for s in spans}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
    for s in sorted(spans, key=lambda s: (s.rank, s.start_s, -s.dur_s)):
        events.append({"ph": "X", "name": s.name, "cat": s.cat, "pid": s.rank, "tid": 0,
                       "ts": round((s.start_s - t0) * 1e6, 3), "dur": round(s.dur_s * 1e6, 3),
                       "args": {"step": s.step, **{str(k): _jsonable(v) for k, v in s.args}}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def spans_from_chrome(doc: dict[str, Any]) -> list[Span]:
    """The spans back from a :func:`chrome_trace` document (times from its origin), for the report."""
    out = []
    for e in doc.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        args = dict(e.get("args", {}))
        step = int(args.pop("step", -1))
        out.append(Span(int(e["pid"]), step, e["name"], e.get("cat", ""), e["ts"] / 1e6, e["dur"] / 1e6,
                        tuple(sorted(args.items()))))
    return out


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


def write_trace(path: str | os.PathLike, spans: Sequence[Span]) -> None:
    """Write :func:`chrome_trace` of ``spans`` to ``path`` atomically (:mod:`pipeline.files`)."""
    atomic_write_text(path, json.dumps(chrome_trace(spans), separators=(",", ":")))
