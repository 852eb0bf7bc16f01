"""The training phase of a search run (:func:`train_supernet`): steps in segments, metrics, progress,
checkpoints, the stop vote, the reference subnets' scoring, and what ends a run early
(:class:`NonFiniteLoss`, a signal). Called by ``search.app.run`` on every rank alike."""
from __future__ import annotations

import inspect
import json
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from pipeline import Engine
from pipeline.engine import PLAN_AHEAD
from pipeline.failures import Fault, inject
from pipeline.stop import StopVote

from .checkpoint import CHECKPOINT_NAME, Checkpoint, save_checkpoint
from .config import RunConfig
from .interrupt import Interrupted, Interrupts
from .metrics import ACTIVATION_FIELDS, MEMORY_FIELDS, MetricsWriter, Monitor, reference_archs
from .samplers import Sampler

if TYPE_CHECKING:
    from .app import Prepared

log = logging.getLogger("search.app")  # the app's logger: one name in the run's log


class RankLog(logging.LoggerAdapter):
    """Log lines prefixed with the rank (``[rank 0] ...``)."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[rank {self.extra['rank']}] {msg}", kwargs


class NonFiniteLoss(RuntimeError):
    """Training diverged: a step's loss is not finite and ``train.nonfinite`` is ``stop``."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True)
class Stop:
    """Between units of work (a training step, an arch scored): the faults injected there, and
    whether a signal stops the run (voted, so every rank stops after the same unit)."""

    interrupts: Interrupts
    vote: StopVote
    faults: tuple[Fault, ...]
    rank: int

    def before(self, index: int, point: str, count: int = 1) -> None:
        """Before unit ``index`` (the step; in the search, the arch's place in scoring order).
        ``count`` > 1: units ``index`` .. ``index + count - 1`` run as one (a batch of archs scored
        on every process at once): the faults of each, on every rank, then one vote."""
        for i in range(index, index + count):
            inject(self.faults, self.rank, i, point)
        self.vote.post(self.interrupts.requested)

    def after(self, index: int, point: str) -> bool:
        """After that unit: whether to stop now."""
        return self.vote.result(self.interrupts.requested, index if point == "step" else -1, f"{point} {index}")


def train_supernet(rc: RunConfig, engine: Engine, sampler: Sampler, data: Any, out: Path, start: int,
           losses: list[float], p: Prepared, rlog: logging.LoggerAdapter, keep_previous: bool,
           stop: Stop) -> Any:
    """Train from step ``start``; checkpoints on the way and at the end. Returns the final op
    states (main rank; ``None`` elsewhere). ``keep_previous=False``: the latest checkpoint is
    unreadable, so the first save replaces it instead of keeping it as the previous one.
    ``stop``: a signal ends training after the step with a checkpoint and :class:`Interrupted`.
    Every ``train.monitor_every`` steps (at the end of the segment that reaches them, with
    cross-subnet windows) every rank scores the reference subnets (:class:`search.metrics.Monitor`);
    the main rank adds their accuracy to that step's metrics and logs a line."""
    t = rc.train
    schedule = t.schedule()
    last_saved = start
    monitor = Monitor(reference_archs(p.graph.space(), p.cost, t.monitor_archs), t.monitor_every,
                      data.val_batches(rc.search.val_batch_size),
                      data.calib_batches(rc.search.bn_calib_batches, rc.search.calib_batch_size), t.monitor_samples)

    def checkpoint(step: int) -> Any:
        nonlocal keep_previous, last_saved
        states = engine.op_states()  # collective: every rank takes part, the main rank gets them
        if engine.is_main:
            ckpt = Checkpoint(step, states, sampler.state_dict(), p.train_digest, p.config_digest, p.train_config)
            save_checkpoint(out / CHECKPOINT_NAME, ckpt, keep_previous=keep_previous,
                            on_durable=lambda: inject(stop.faults, engine.rank, step, "checkpoint"))
        keep_previous, last_saved = True, step
        return states

    skipped = 0
    # subnets back to back in one schedule: a cross-subnet window, or one flushed step at a time (a
    # crash, a signal or a non-finite loss then stops at the step, and its metrics line is written)
    ps = getattr(engine, "settings", rc.pipeline)  # the engine's: pipeline.window=auto resolved (pipeline/layout.py)
    segment = max(32, 4 * (ps.window if isinstance(ps.window, int) else 1)) if ps.cross else 1

    def _record(step: int, arch: Any, res: Any, hold: bool = False) -> None:
        """One step's metrics record (``hold``: kept back for the monitor's columns), progress,
        log line and non-finite handling."""
        nonlocal skipped
        # Every rank that has the micro-batch losses decides alike (the main rank always has them).
        bad = next((m for m, v in enumerate(res.microbatch_losses) if not math.isfinite(v)), None)
        if engine.is_main:
            losses.append(res.loss)
            metrics.step({
                "step": step, "arch": dict(arch), "loss": finite(res.loss), "lr": schedule(step),
                "samples_per_s": t.batch_size / res.seconds if res.seconds > 0 else None,
                "seconds": res.seconds, "migrated_ops": res.migrated_ops, "migrated_bytes": res.migrated_bytes,
                "migration_s": res.migration_s, **memory_fields(res.memory),
                **{k: getattr(res, k) for k in ACTIVATION_FIELDS},
                **({"nonfinite": t.nonfinite} if bad is not None else {}),
            }, hold=hold)
            bar.update(1)
            bar.set_postfix(loss=f"{res.loss:.3f}", refresh=False)
        if bad is not None:
            where = (f"step {step}: the loss is {res.microbatch_losses[bad]} at micro-batch {bad} of arch "
                     f"{json.dumps(dict(arch), sort_keys=True)}")
            if t.nonfinite == "stop":
                saved = (f"the last good checkpoint is {out / CHECKPOINT_NAME} (step {last_saved})"
                         if last_saved > 0 else "no checkpoint was written")
                raise NonFiniteLoss(
                    f"{where}; stopped (train.nonfinite=stop); {saved}. Hint: lower train.optimizer.lr or "
                    "add train.warmup_steps, or train.nonfinite=skip to skip such steps", step)
            skipped += 1
            rlog.warning("%s; skipped: no update (train.nonfinite=skip, %d so far)", where, skipped)
        elif engine.is_main and (step + 1) % t.log_every == 0:
            recent = [v for v in losses[-t.log_every:] if math.isfinite(v)]
            if recent:
                rlog.info("step %d/%d: loss %.4f (mean of last %d), lr %.4g", step + 1, t.steps,
                          sum(recent) / len(recent), len(recent), schedule(step))

    def _monitor(trained: int) -> None:
        scores = monitor.evaluate(engine)  # collective: every rank, after the same step
        if engine.is_main:
            metrics.monitored(scores)
            named = {k.removeprefix("monitor/"): v for k, v in scores.items() if k.startswith("monitor/")}
            rlog.info("step %d/%d: val accuracy of the reference subnets: %s (%.2f s)", trained, t.steps,
                      ", ".join(f"{n} {v:.4f}" if v is not None else f"{n} not finite" for n, v in named.items()),
                      scores["monitor_s"])

    read_batch = batch_reader(data, t.batch_size, engine.input_rows(t.batch_size))
    bar = tqdm(total=t.steps, initial=start, desc="train", unit="step", file=sys.stderr,
               disable=not show_bars(engine), dynamic_ncols=True, leave=False)
    metrics = MetricsWriter(out, start, monitor.columns, t.tensorboard) if engine.is_main else None
    if metrics is not None:
        losses.extend(metrics.losses)
    try:
        step = start
        while step < t.steps:
            # a segment: subnets the engine may keep in flight together (one step without
            # cross-subnet schedules); it ends at a checkpoint boundary, where nothing is in flight
            end = min(t.steps, step + segment)
            if t.checkpoint_every:
                end = min(end, (step // t.checkpoint_every + 1) * t.checkpoint_every)
            stop.before(step, "step")
            items = []
            for k in range(step, end):
                x, y = read_batch(k)
                items.append((k, sampler.next(), x, y))
            upcoming = sampler.peek(min(max(PLAN_AHEAD, segment), t.steps - end))  # planned while these run
            due = monitor.due(step, end)  # the last step's record waits for the reference subnets' scores
            for (k, arch, _, _), res in zip(items, engine.train_steps(items, upcoming)):
                _record(k, arch, res, hold=due and k == end - 1)
            step = end
            if due:
                _monitor(step)
            if t.checkpoint_every and step % t.checkpoint_every == 0 and step < t.steps:
                checkpoint(step)
            if stop.after(step - 1, "step"):  # a signal: after the step (segment) in flight, with a checkpoint
                if last_saved != step:
                    checkpoint(step)
                path = out / CHECKPOINT_NAME
                raise Interrupted(f"{stop.interrupts.name}: stopped after step {step} of {t.steps}; checkpoint "
                                  f"{path} (step {step})", stop.interrupts.signum or 0, path, step)
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
    if start < t.steps:
        return checkpoint(t.steps)
    return engine.op_states()  # nothing trained: the checkpoint already holds these states


def batch_reader(data: Any, batch_size: int, rows: range | None) -> Callable[[int], tuple[Any, Any]]:
    """Step -> its training batch: only ``rows`` of it (a replica's share) where the data can read
    part of a batch (its ``train_batch`` takes ``rows``), else the whole batch (the engine takes
    its share)."""
    try:
        partial = rows is not None and "rows" in inspect.signature(data.train_batch).parameters
    except (TypeError, ValueError):
        partial = False
    if partial:
        return lambda step: data.train_batch(step, batch_size, rows=rows)
    return lambda step: data.train_batch(step, batch_size)


def show_bars(engine: Engine) -> bool:
    """Progress bars on the main rank's terminal only: in a log file or a pipe a bar is only
    fragments of carriage-return redraws."""
    return engine.is_main and sys.stderr.isatty()


def memory_fields(m: Any) -> dict[str, Any]:
    """A step's tensor-manager figures for metrics.jsonl (null when the engine reports none)."""
    return {k: None if m is None else getattr(m, k) for k in MEMORY_FIELDS}


def finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no NaN
