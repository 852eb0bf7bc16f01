"""The search phase of a run (:func:`search_supernet`): score archs with inherited weights by
evolution or at random (or the fixed arch once with ``search=none``), progress off a terminal
(:class:`Progress`), the per-algorithm sections of ``summary.json`` (:func:`merge_searches`) and
``search-<algorithm>.jsonl``. How each batch of archs is scored (through the engine, or on every
process at once) is :mod:`search.parallel`'s."""
from __future__ import annotations

import json
import logging
import math
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pipeline import Engine, EvalResult
from supernet import Arch, SearchSpace, SupernetGraph, derive_seed

from .checkpoint import atomic_write_text
from .config import RunConfig
from .evolution import BatchScorer, Candidate, SearchResult, SubnetCost, evolution_search, random_search
from .interrupt import Interrupted
from .parallel import EngineScoring, Scoring, open_scoring
from .training import RankLog, Stop, finite, show_bars

log = logging.getLogger("search.app")


def search_supernet(rc: RunConfig, engine: Engine, space: SearchSpace, data: Any, cost: SubnetCost,
            seed_archs: list[Arch], stop: Stop | None = None, checkpoint: Path | None = None, *,
            trained: Arch | None = None, rlog: logging.LoggerAdapter | None = None,
            graph: SupernetGraph | None = None,
            states: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
            ) -> tuple[SearchResult, dict[Arch, EvalResult]]:
    """Score subnets with inherited weights (BN recalibrated per subnet) by evolution or at
    random. Every rank runs this identically and gets the same scores. ``stop``: a signal ends
    the search after the arch being scored (with parallel scoring, after the batch), with
    :class:`Interrupted` (training is complete: ``checkpoint`` holds it). ``search=none`` scores
    only ``trained`` (the fixed sampler's arch), or nothing. ``graph`` and ``states`` (the trained
    op states, on the main rank): what parallel scoring (:mod:`search.parallel`) builds each
    rank's engine from; without ``graph`` the engine scores. Progress: a bar on the main rank's
    terminal, else log lines there (:class:`Progress`)."""
    s = rc.search
    total = s.budget if s.algorithm != "none" else int(trained is not None)
    evals: dict[Arch, EvalResult] = {}
    if total == 0:  # search=none and no fixed arch: nothing to score
        return SearchResult((), 0), evals
    rlog = rlog or RankLog(log, {"rank": engine.rank})
    val = data.val_batches(s.val_batch_size)
    calib = data.calib_batches(s.bn_calib_batches, s.calib_batch_size)

    def note(line: str) -> None:
        if engine.is_main:
            rlog.info("%s", line)

    scoring: Scoring = (open_scoring(rc, engine, graph, states, total, note) if graph is not None
                        else EngineScoring(engine))
    what = f"search ({s.algorithm})" if s.algorithm != "none" else "scoring the trained arch"
    bar = tqdm(total=total, desc=what, unit="arch", file=sys.stderr,
               disable=not show_bars(engine), dynamic_ncols=True, leave=False)
    progress = (Progress(what, total, rlog)
                if engine.is_main and bar.disable and s.algorithm != "none" else None)  # one arch: run() logs it

    def score(archs: Sequence[Arch]) -> list[float]:
        """A batch's scores, ``scoring.chunk`` archs at a time (a stop vote around each chunk)."""
        out = []
        for at in range(0, len(archs), scoring.chunk):
            chunk = archs[at:at + scoring.chunk]
            first = len(evals)
            before = (lambda: stop.before(first, "evaluate", len(chunk))) if stop is not None else None
            for arch, ev in zip(chunk, scoring(chunk, val, calib, before)):
                evals[arch] = ev
                # not finite (NaN logits still have an argmax): ranked last, never the best
                out.append(ev.accuracy if math.isfinite(ev.loss) else -math.inf)
                bar.update(1)
                if progress is not None:
                    progress.update(out[-1])
            if stop is not None and stop.after(len(evals) - 1, "evaluate"):
                raise Interrupted(f"{stop.interrupts.name}: stopped the search after {len(evals)} of {total} archs; "
                                  f"training is complete: checkpoint {checkpoint} (step {rc.train.steps})",
                                  stop.interrupts.signum or 0, checkpoint, rc.train.steps)
        return out

    # search.seed varies the search alone: the trained supernet (checkpoint) stays the same
    rng = random.Random(derive_seed(rc.seed if s.seed is None else s.seed, "search"))
    constraint = s.constraints.check(cost)
    common: dict[str, Callable | Any] = {"top_k": s.top_k, "constraint": constraint, "seed_archs": seed_archs}
    try:
        if s.algorithm == "evolution":
            result = evolution_search(space, BatchScorer(score), rng, population=s.population,
                                      generations=s.generations, mutate_prob=s.mutate_prob,
                                      crossover_prob=s.crossover_prob, parents=s.parents, **common)
        elif s.algorithm == "random":
            result = random_search(space, BatchScorer(score), rng, budget=s.budget, **common)
        else:  # none, with the fixed sampler's arch: scored exactly as a search scores a candidate
            result = SearchResult((Candidate(trained, score([trained])[0]),), 1)
    finally:
        bar.close()
        scoring.close()
    if progress is not None:
        progress.finish()
    return result, evals


PROGRESS_EVERY_S = 5.0  # off a terminal: at most one search progress line per this many seconds, then the last


class Progress:
    """Search progress as log lines, where no bar can show (the main rank off a terminal: a log
    file, a pipe): archs scored of the total, the best accuracy so far and the rate, at most one
    line per :data:`PROGRESS_EVERY_S` seconds of ``clock``, and one after the last arch."""

    def __init__(self, what: str, total: int, rlog: logging.LoggerAdapter,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total, self.rlog, self.clock = what, total, rlog, clock
        self.start = self.last = clock()
        self.done = self.logged = 0
        self.best = -math.inf

    def update(self, score: float) -> None:
        """One arch scored (``score``: its accuracy, ``-inf`` when not finite)."""
        self.done += 1
        self.best = max(self.best, score)
        if self.clock() - self.last >= PROGRESS_EVERY_S:  # read at each call: tests may change it
            self._line()

    def finish(self) -> None:
        """The last line, unless the last arch's line was just written."""
        if self.done != self.logged:
            self._line()

    def _line(self) -> None:
        now = self.clock()
        elapsed = now - self.start
        rate = f"{self.done / elapsed:.1f} archs/s" if elapsed > 0 else "- archs/s"
        best = f"{self.best:.4f}" if math.isfinite(self.best) else "none finite"
        self.rlog.info("%s: %d/%d archs scored, best val accuracy %s, %s", self.what, self.done, self.total, best,
                       rate)
        self.last, self.logged = now, self.done


NO_SEARCH = {  # summary.json's search.note with search=none, by whether the sampler is fixed
    True: "search=none: no search ran; best and top_k are the fixed sampler's arch (trained_arch), scored once",
    False: "search=none: no search ran and no arch was scored (best is null); every step's arch is in metrics.jsonl",
}
SEARCHING = ("evolution", "random")  # those that search (search.config.ALGORITHMS less none)


def merge_searches(path: Path | None, digest: str | None, algorithm: str, section: dict[str, Any] | None,
              rlog: logging.LoggerAdapter) -> dict[str, Any]:
    """summary.json's ``searches``: algorithm -> {best, top_k, evaluated, best_per_generation,
    search_time_s}. This run's ``section`` (``None``: it did not search) joins those of the summary
    already at ``path`` (``None``: not the main rank) when that one is of the same weights (equal
    ``params_digest``: a rerun that only searched), so evolution and its random baseline run in one
    directory both stay; a summary of other weights (``resume=false``) keeps nothing."""
    kept: dict[str, Any] = {}
    old = None
    if path is not None and path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            rlog.warning("%s: cannot read the summary there (%s); the searches it held are not kept", path, e)
    if isinstance(old, dict) and digest is not None:
        previous = old.get("searches")
        if not isinstance(previous, dict):  # written before summaries kept every search: its one search
            ran = old.get("search") or {}
            previous = {ran.get("algorithm"): {
                "best": old.get("best"), "top_k": old.get("top_k"), "evaluated": ran.get("evaluated"),
                "best_per_generation": ran.get("best_per_generation"), "search_time_s": old.get("search_time_s"),
            }}
        previous = {k: v for k, v in previous.items() if k in SEARCHING and k != algorithm}
        if old.get("params_digest") == digest:
            kept.update(previous)
        elif previous:
            rlog.info("%s: the searches there (%s) scored other weights; replaced", path, ", ".join(sorted(previous)))
    if section is not None:
        kept[algorithm] = section
    return dict(sorted(kept.items()))


def write_search_log(path: Path, rc: RunConfig, evals: dict[Arch, EvalResult], cost: SubnetCost) -> None:
    """Every scored arch in scoring order: its generation (for random search, the same-sized
    batches evolution would have had), accuracy, loss and parameters."""
    lines = []
    for i, (arch, ev) in enumerate(evals.items()):  # dicts keep insertion (= scoring) order
        lines.append(json.dumps({
            "index": i, "generation": i // rc.search.population, "arch": dict(arch), "val_accuracy": ev.accuracy,
            "val_loss": finite(ev.loss), "nonfinite": not math.isfinite(ev.loss), "params": cost.params(arch),
        }) + "\n")
    atomic_write_text(path, "".join(lines))


def entry(arch: Arch, ev: EvalResult, cost: SubnetCost) -> dict[str, Any]:
    try:
        flops: int | None = cost.flops(arch)
    except Exception as e:  # FLOPs are informational here; a space may have ops torch cannot count
        log.warning("cannot count the FLOPs of %s: %s", arch, e)
        flops = None
    return {"arch": dict(arch), "val_accuracy": ev.accuracy, "val_loss": finite(ev.loss),
            "nonfinite": not math.isfinite(ev.loss), "params": cost.params(arch), "flops": flops}
