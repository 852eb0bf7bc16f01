"""The search run: train the supernet with sampled archs, then search it with inherited weights.

:func:`run` takes the composed config and returns the summary. It is one code path for one
process and for many: every rank calls every engine method with the same arguments in the
same order (training, gathering op states, evaluating candidates), and only the main rank
writes. Everything that can be wrong with the input is checked by :func:`prepare` before
anything is written (the CLI calls it before Hydra creates the run directory).

Outputs, in the run directory: ``metrics.jsonl`` (one JSON line per training step; ``metrics.csv``
the same rows, ``tb/`` TensorBoard scalars: :mod:`search.metrics`),
``checkpoint.pt`` (see :mod:`search.checkpoint`; a run that finds one there resumes from it),
``search-<algorithm>.jsonl`` (every arch scored) and ``summary.json``. The summary's top-level
keys (``best``, ``top_k``, ``search``, ``params_digest``, ...) are the run just made; its
``searches`` maps each algorithm that searched these weights in this directory to its ``best``,
``top_k``, ``evaluated``, ``best_per_generation`` and ``search_time_s``: a finished run run again
with ``search=random`` (it resumes and only searches) adds the baseline beside evolution's result.

``search=none`` trains and checkpoints only. With the fixed sampler (``sampler=fixed
sampler.arch={...}``) that arch is scored once, as the search scores a candidate (inherited
weights, batch norm recalibrated): it is ``best``, ``top_k`` and ``trained_arch``; with another
sampler nothing is scored, ``best`` is null and ``search.note`` says no search ran.

Progress: on the main rank's terminal, tqdm bars; off a terminal (a log file, a pipe) training
logs every ``train.log_every`` steps and the search logs archs scored of the total, the best
accuracy so far and archs/s at most every :data:`PROGRESS_EVERY_S` seconds, and after the last.

With ``interrupts`` (:class:`search.interrupt.Interrupts`), a SIGINT/SIGTERM stops training after
the step (all ranks after the same one), writes a checkpoint and raises
:class:`search.interrupt.Interrupted`; during the search it stops after the arch being scored.
"""
from __future__ import annotations

import inspect
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import supernet.spaces  # noqa: F401 - registers the built-in spaces and their ops
from pipeline import Engine, EvalResult, create_engine, dist_env, params_digest
from pipeline.engine import PLAN_AHEAD
from pipeline.failures import Fault, inject, parse_fault
from pipeline.layout import Layout, LayoutError, resolve_layout
from pipeline.memory.state import weight_shapes, weights_only
from pipeline.stop import StopVote
from pipeline.trace import write_trace
from supernet import Arch, OpSpec, SearchSpace, SupernetGraph, build_op, derive_seed

from .checkpoint import (CHECKPOINT_NAME, Checkpoint, CheckpointError, atomic_write_text, load_checkpoint,
                         remove_temporaries, resume_checkpoint, save_checkpoint)
from .config import (ConfigError, RunConfig, build_data, build_space, config_digest, field_differences, load_config,
                     train_fields, train_digest)
from .evolution import Candidate, SearchResult, SubnetCost, evolution_search, random_search
from .interrupt import Interrupted, Interrupts
from .metrics import MEMORY_FIELDS, METRICS_NAME, MetricsWriter, Monitor, reference_archs
from .samplers import FixedSampler, Sampler, make_sampler

__all__ = ["run", "prepare", "Prepared", "InitFrom", "NonFiniteLoss", "METRICS_NAME", "SUMMARY_NAME", "TRACE_NAME"]

SUMMARY_NAME = "summary.json"
TRACE_NAME = "trace.json"


class NonFiniteLoss(RuntimeError):
    """Training diverged: a step's loss is not finite and ``train.nonfinite`` is ``stop``."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step

log = logging.getLogger(__name__)


class _RankLog(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[rank {self.extra['rank']}] {msg}", kwargs




@dataclass(frozen=True)
class InitFrom:
    """``train.init_from`` as :func:`prepare` read it: the checkpoint file, the source run's
    ``params_digest`` (its ``summary.json``'s, when that sits beside its ``checkpoint.pt``), and
    the weights and buffers (no optimizer state) of the ops of this space it holds: ``states`` is
    ``None`` when the run resumes its own checkpoint, which holds the weights (the source is not read)."""

    path: Path
    source_digest: str | None
    states: Mapping[str, Mapping[str, torch.Tensor]] | None
    missing: tuple[str, ...] = ()  # ops of this space the source lacks: they keep their seeded init

    def record(self) -> dict[str, Any]:
        """summary.json's ``init_from``."""
        return {"path": str(self.path), "params_digest": self.source_digest}


@dataclass(frozen=True)
class Prepared:
    """A run's input, read and checked by :func:`prepare`; nothing written yet."""

    rc: RunConfig
    out: Path
    config_digest: str
    train_config: dict[str, Any]  # train_fields(cfg): what a checkpoint must match to resume
    train_digest: str
    data: Any
    graph: SupernetGraph
    seed_archs: list[Arch]
    cost: SubnetCost
    ckpt: Checkpoint | None
    ckpt_file: Path | None
    layout: Layout = Layout(1, 1)  # pipeline stages x replicas (pipeline/layout.py)
    notes: tuple[str, ...] = ()  # warnings to log once the run's logging is set up
    init: InitFrom | None = None  # train.init_from, read and checked against the space


def prepare(cfg: DictConfig | Mapping[str, Any], output_dir: str | Path | None = None,
            output_field: str = "output_dir") -> Prepared:
    """Everything that can be wrong with the input fails here, before anything is written: the
    config, the data and the space it names, the run directory (``output_dir``, else the config's
    ``output_dir``, else Hydra's; ``output_field`` names it in errors) and the checkpoint there."""
    rc = load_config(cfg)
    if output_dir is None and rc.output_dir is not None:
        output_dir = rc.output_dir
    out = _output_dir(output_dir)
    check_writable(out, output_field if output_dir is not None else "hydra.run.dir")
    data = build_data(rc.data)
    data.train_batch(0, rc.train.batch_size)  # checks the batch size against the data
    graph = build_space(rc.space, data.input_shape, data.num_classes)
    space = graph.space()
    seed_archs = [space.validate(a, f"search.seed_archs[{i}]") for i, a in enumerate(rc.search.seed_archs)]
    _sampler(rc, space)  # checks sampler.arch
    env = dist_env()
    try:  # the (stages, replicas) layout the engine will take, and what combines with replicas
        layout = resolve_layout(rc.pipeline, rc.memory, env.world_size if env is not None else 1,
                                rc.train.microbatches, graph, rc.train.optimizer.name, data.input_shape,
                                rc.train.batch_size)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    cost = SubnetCost(graph, data.input_shape, rc.seed)
    rc.search.constraints.check_feasible(space, cost)  # bounds no arch meets fail before training
    reference_archs(space, cost, rc.train.monitor_archs)  # checks train.monitor_archs
    fields = train_fields(cfg)
    tdigest = train_digest(cfg)
    notes: list[str] = []
    ckpt, ckpt_file = resume_checkpoint(out / CHECKPOINT_NAME, notes.append) if rc.resume else (None, None)
    if ckpt is not None:
        _check_resumable(ckpt, ckpt_file, tdigest, fields, rc)
    # a run that resumes its own checkpoint ignores train.init_from: the checkpoint holds the weights
    init = _init_from(rc.train.init_from, graph, read=ckpt is None) if rc.train.init_from is not None else None
    from pipeline.feasibility import check_memory, engine_device

    try:  # budgets the engine would stop on, from the subnets this run trains (steps from the checkpoint on)
        check_memory(graph, rc.seed, rc.train.optimizer, rc.memory, engine_device(rc.device), data.input_shape,
                     rc.train.batch_size, rc.train.microbatches, _sampler(rc, space).next, rc.train.steps,
                     ckpt.step if ckpt is not None else 0, rc.pipeline if env is not None else None, layout.stages,
                     layout.replicas)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return Prepared(rc, out, config_digest(cfg), fields, tdigest, data, graph, seed_archs, cost, ckpt, ckpt_file,
                    layout, tuple(notes), init)


def run(cfg: DictConfig | Mapping[str, Any], output_dir: str | Path | None = None, *,
        prepared: Prepared | None = None, interrupts: Interrupts | None = None) -> dict[str, Any]:
    """Train, checkpoint and search as ``cfg`` says; returns the summary (on every rank; only
    the main rank has ``params_digest`` and the losses). ``output_dir`` overrides the config's
    ``output_dir`` and Hydra's run directory. ``prepared``: what :func:`prepare` made of this
    ``cfg`` already. ``interrupts``: the signals to stop on (none when not given)."""
    t_start = time.perf_counter()
    p = prepared if prepared is not None else prepare(cfg, output_dir)
    rc, out, ckpt, ckpt_file = p.rc, p.out, p.ckpt, p.ckpt_file
    if rc.threads is not None:
        torch.set_num_threads(rc.threads)
    data, graph, cost = p.data, p.graph, p.cost
    space = graph.space()
    sampler = _sampler(rc, space)
    trained = sampler.arch if isinstance(sampler, FixedSampler) else None  # the one arch trained, if one
    ckpt_path = out / CHECKPOINT_NAME
    interrupts = interrupts if interrupts is not None else Interrupts()  # not installed: never set
    faults = parse_fault(os.environ.get("PIPENAS_FAULT"))

    # A failing pipeline rank leaves a note in failures/ that its peers quote in their reports.
    engine = create_engine(graph, rc.seed, rc.train.optimizer, rc.train.microbatches, rc.train.schedule(),
                           rc.pipeline, rc.device, failure_dir=str(out / "failures"), memory=rc.memory,
                           trace_steps=tuple(rc.pipeline.trace_steps), checkpoint_every=rc.train.checkpoint_every,
                           sample_shape=tuple(data.input_shape), batch_size=rc.train.batch_size,
                           clip_grad_norm=rc.train.clip_grad_norm)
    rlog = _RankLog(log, {"rank": engine.rank})
    # On a terminal log lines go through the progress bar instead of tearing it
    with logging_redirect_tqdm() if _show_bars(engine) else nullcontext():
        try:
            vote = StopVote(engine.rank, engine.world_size, rc.pipeline.timeout_s)
            if engine.is_main:
                for note in p.notes:
                    rlog.warning("%s", note)
                for tmp in remove_temporaries(ckpt_path):  # of a process killed while writing one
                    rlog.info("removed %s, a checkpoint write cut short", tmp.name)
            start = 0
            if ckpt is not None:
                engine.load_op_states(ckpt.op_states)
                sampler.load_state_dict(ckpt.sampler)
                start = ckpt.step
                rlog.info("resuming from %s at step %d", ckpt_file, start)
            elif p.init is not None and p.init.states is not None:  # every rank: each adopts the ops it owns
                engine.load_op_states(p.init.states)  # weights and buffers only: the optimizer starts fresh
                if engine.is_main:
                    rlog.info("train.init_from: %d ops start from %s (weights and buffers; a fresh optimizer)",
                              len(p.init.states), p.init.path)
                    if p.init.missing:
                        rlog.info("train.init_from: %d ops not in it keep their seeded init: %s%s", len(p.init.missing),
                                  ", ".join(p.init.missing[:8]), ", ..." if len(p.init.missing) > 8 else "")
            losses: list[float] = []  # the main rank's: metrics.jsonl's kept on a resume, then this run's
            t0 = time.perf_counter()
            # after a fall-back to the previous checkpoint the unreadable latest is replaced, not kept
            states = _train(rc, engine, sampler, data, out, start, losses, p, rlog,
                            keep_previous=ckpt_file is None or ckpt_file == ckpt_path,
                            stop=_Stop(interrupts, vote, faults, engine.rank))
            train_s = time.perf_counter() - t0
            if rc.pipeline.trace_steps:
                _write_trace(out / TRACE_NAME, engine, rc.pipeline.trace_steps, rlog)

            t0 = time.perf_counter()
            result, evals = _search(rc, engine, space, data, cost, p.seed_archs,
                                    _Stop(interrupts, vote, faults, engine.rank), ckpt_path, trained=trained,
                                    rlog=rlog)
            search_s = time.perf_counter() - t0
            if engine.is_main and rc.search.algorithm != "none":
                _write_search_log(out / f"search-{rc.search.algorithm}.jsonl", rc, evals, cost)
        except BaseException:
            try:
                engine.close()
            except Exception as e:  # the failure that got us here is the one to report
                rlog.warning("closing the engine after a failure failed too: %s", e)
            raise
        engine.close()

    top = [_entry(c.arch, evals[c.arch], cost) for c in result.top]
    # An arch whose evaluation is not finite scored -inf (ranked last); it is never the best.
    best = next((t for t in top if not t["nonfinite"]), None)
    digest = params_digest(states) if states is not None else None
    searched = rc.search.algorithm != "none"
    section = {"best": best, "top_k": top, "evaluated": result.evaluated, "best_per_generation": list(result.history),
               "search_time_s": round(search_s, 3)} if searched else None
    summary: dict[str, Any] = {
        "config_digest": p.config_digest,
        "steps": rc.train.steps,
        "resumed_from_step": start,
        "init_from": p.init.record() if p.init is not None else None,  # train.init_from: the source's path, digest
        "final_loss": _finite(losses[-1]) if losses else None,  # null: not the main rank, or diverged
        "mean_loss_last10": _finite(sum(losses[-10:]) / len(losses[-10:])) if losses else None,
        # train.nonfinite=skip: steps that updated nothing (null: not the main rank)
        "nonfinite_steps_skipped": sum(not math.isfinite(v) for v in losses) if engine.is_main else None,
        "best": best,
        "top_k": top,
        "search": {"algorithm": rc.search.algorithm, "evaluated": result.evaluated,
                   "best_per_generation": list(result.history),
                   **({} if searched else {"note": _NO_SEARCH[trained is not None]})},
        # every search of these weights run in this directory, by algorithm (this run's and those before)
        "searches": _searches(out / SUMMARY_NAME if engine.is_main else None, digest, rc.search.algorithm, section,
                              rlog),
        "trained_arch": dict(trained) if trained is not None else None,  # the fixed sampler's; else null
        "params_digest": digest,
        "world_size": engine.world_size,
        # the order subnets were trained in (the same subnets per fair round or block with locality)
        "sampler": {"name": rc.sampler.name, "order": sampler.order, "block": sampler.block},
        # how subnets were trained together: in flight at once, and how ops in every subnet were read
        "pipeline": {"window": rc.pipeline.window, "shared_ops": rc.pipeline.shared_ops,
                     "shared_delay": rc.pipeline.shared_delay if rc.pipeline.shared_ops == "delayed" else None},
        "memory": _memory_totals(engine),  # the tensor manager over the whole run (training and search)
        "space_size": space.size(),
        "space": {"target": rc.space.target, "options": rc.space.options},  # what search.report rebuilds
        "data": {"input_shape": list(data.input_shape), "num_classes": data.num_classes},
        "train_time_s": round(train_s, 3),
        "search_time_s": round(search_s, 3),
        "wall_time_s": round(time.perf_counter() - t_start, 3),
        "output_dir": str(out),
    }
    if engine.is_main:
        atomic_write_text(out / SUMMARY_NAME, json.dumps(summary, indent=2) + "\n")
        if not searched and trained is None:
            rlog.info("trained %d steps; no search ran (search=none)", rc.train.steps)
        elif best is None:
            rlog.error("no architecture evaluated to a finite validation loss; the supernet's weights are "
                       "not finite (see nonfinite_steps_skipped in %s)", out / SUMMARY_NAME)
        else:
            rlog.info("%s %s: val accuracy %.4f", "best arch" if searched else "trained arch", best["arch"],
                      best["val_accuracy"])
    return summary


# -- pieces ------------------------------------------------------------------------------------

def _sampler(rc: RunConfig, space: SearchSpace) -> Sampler:
    s = rc.sampler
    return make_sampler(s.name, space, derive_seed(rc.seed, "sampler"), s.arch, s.order, s.block)


def _output_dir(explicit: str | Path | None) -> Path:
    if explicit is not None:
        return Path(explicit)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        raise ConfigError(
            "output_dir: expected a directory; not running under @hydra.main, so set output_dir "
            "in the config or pass run(cfg, output_dir=...)"
        ) from None


def check_writable(out: Path, field: str) -> None:
    """The run directory can be made and written (nothing is created here)."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == out and not out.is_dir():
        raise ConfigError(f"{field}: expected a directory, found a file: {out}")
    if not existing.is_dir():
        raise ConfigError(f"{field}: expected a directory you can create, found a file in its way: {existing} "
                          f"(for {out})")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{field}: expected a directory you can write, found {existing} read-only (for {out})")


def _check_resumable(ckpt: Checkpoint, path: Path, tdigest: str, fields: Mapping[str, Any], rc: RunConfig) -> None:
    if ckpt.train_digest != tdigest:
        if ckpt.train_config is not None:
            diff = field_differences(ckpt.train_config, fields)
            what = "; ".join(diff[:8]) + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "")
        else:  # a checkpoint of an older version keeps only the digest
            what = f"train digest {ckpt.train_digest[:12]} -> {tdigest[:12]}"
        raise CheckpointError(
            f"checkpoint {path}: written by a run with other training settings: {what}; set them back to resume, "
            "or use another run directory (hydra.run.dir=...), or resume=false to start afresh over it"
        )
    if not 0 <= ckpt.step <= rc.train.steps:
        raise CheckpointError(f"checkpoint {path}: expected a step in [0, {rc.train.steps}], found {ckpt.step}")


_INIT_EXPECTED = "train.init_from: expected a run directory with checkpoint.pt (or a checkpoint file), found"


def _init_from(given: str, graph: SupernetGraph, read: bool) -> InitFrom:
    """``train.init_from``: the checkpoint of a run directory (its ``checkpoint.pt``) or a checkpoint
    file, its op states checked against ``graph`` (the shapes of every parameter and buffer of each
    op both have, from a meta build) and kept without their optimizer state. With ``read`` false
    (the run resumes) only where it is and the source's digest. Raises :class:`ConfigError`."""
    where = Path(given).expanduser().absolute()
    path = where if where.is_file() else where / CHECKPOINT_NAME
    digest = _summary_digest(path)
    if not read:
        return InitFrom(path, digest, None)
    if not where.exists():
        raise ConfigError(f"{_INIT_EXPECTED} no such path: {where}")
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as e:
        raise ConfigError(f"{_INIT_EXPECTED} one that cannot be read: {e}") from None
    if ckpt is None:
        raise ConfigError(f"{_INIT_EXPECTED} a directory without one: {where}")
    shapes: dict[OpSpec, dict[str, tuple[int, ...]]] = {}  # per op spec (one meta build each)
    states, missing = {}, []
    for slot in graph.slots():
        source = ckpt.op_states.get(slot.op_id)
        if source is None:
            missing.append(slot.op_id)
            continue
        if slot.spec not in shapes:
            with torch.device("meta"):
                shapes[slot.spec] = weight_shapes(build_op(slot.spec, slot.op_id, 0, seeded=False))
        want, weights = shapes[slot.spec], weights_only(source)
        got = {key: tuple(t.shape) for key, t in weights.items()}
        if got != want:
            key = next(k for k in [*want, *got] if want.get(k) != got.get(k))  # the first in the op's order
            found = f"shape {got[key]}" if key in got else "none"
            expected = f"{key} of shape {want[key]}" if key in want else f"no {key}"
            raise ConfigError(f"train.init_from: op {slot.op_id!r} of {path}: expected {expected} (the space trained "
                              f"here), found {found}; init_from takes a run of the same space (space.* settings)")
        states[slot.op_id] = weights
    if not states:
        raise ConfigError(f"train.init_from: expected a run of this space, found a checkpoint with none of its "
                          f"{len(missing)} ops: {path} (op ids there: {', '.join(sorted(ckpt.op_states)[:4])}, ...)")
    return InitFrom(path, digest, states, tuple(missing))


def _summary_digest(checkpoint: Path) -> str | None:
    """The ``params_digest`` of the run whose ``checkpoint.pt`` this is, from its summary.json
    (``None``: another file, no summary, or none there)."""
    summary = checkpoint.with_name(SUMMARY_NAME)
    if checkpoint.name != CHECKPOINT_NAME or not summary.is_file():
        return None
    try:
        digest = json.loads(summary.read_text()).get("params_digest")
    except (OSError, ValueError, AttributeError):
        return None
    return digest if isinstance(digest, str) else None


@dataclass(frozen=True)
class _Stop:
    """Between units of work (a training step, an arch scored): the faults injected there, and
    whether a signal stops the run (voted, so every rank stops after the same unit)."""

    interrupts: Interrupts
    vote: StopVote
    faults: tuple[Fault, ...]
    rank: int

    def before(self, index: int, point: str) -> None:
        """Before unit ``index`` (the step; in the search, the arch's place in scoring order)."""
        inject(self.faults, self.rank, index, point)
        self.vote.post(self.interrupts.requested)

    def after(self, index: int, point: str) -> bool:
        """After that unit: whether to stop now."""
        return self.vote.result(self.interrupts.requested, index if point == "step" else -1, f"{point} {index}")


def _train(rc: RunConfig, engine: Engine, sampler: Sampler, data: Any, out: Path, start: int,
           losses: list[float], p: Prepared, rlog: logging.LoggerAdapter, keep_previous: bool,
           stop: _Stop) -> Any:
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
    segment = max(32, 4 * rc.pipeline.window) if rc.pipeline.cross else 1

    def _record(step: int, arch: Any, res: Any, hold: bool = False) -> None:
        """One step's metrics record (``hold``: kept back for the monitor's columns), progress,
        log line and non-finite handling."""
        nonlocal skipped
        # Every rank that has the micro-batch losses decides alike (the main rank always has them).
        bad = next((m for m, v in enumerate(res.microbatch_losses) if not math.isfinite(v)), None)
        if engine.is_main:
            losses.append(res.loss)
            metrics.step({
                "step": step, "arch": dict(arch), "loss": _finite(res.loss), "lr": schedule(step),
                "samples_per_s": t.batch_size / res.seconds if res.seconds > 0 else None,
                "seconds": res.seconds, "migrated_ops": res.migrated_ops, "migrated_bytes": res.migrated_bytes,
                "migration_s": res.migration_s, **_memory_fields(res.memory),
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

    read_batch = _batch_reader(data, t.batch_size, engine.input_rows(t.batch_size))
    bar = tqdm(total=t.steps, initial=start, desc="train", unit="step", file=sys.stderr,
               disable=not _show_bars(engine), dynamic_ncols=True, leave=False)
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


def _batch_reader(data: Any, batch_size: int, rows: range | None) -> Callable[[int], tuple[Any, Any]]:
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


def _search(rc: RunConfig, engine: Engine, space: SearchSpace, data: Any, cost: SubnetCost,
            seed_archs: list[Arch], stop: _Stop | None = None, checkpoint: Path | None = None, *,
            trained: Arch | None = None,
            rlog: logging.LoggerAdapter | None = None) -> tuple[SearchResult, dict[Arch, EvalResult]]:
    """Score subnets with inherited weights (BN recalibrated per subnet) by evolution or at
    random. Every rank runs this identically: the engine returns the same scores everywhere.
    ``stop``: a signal ends the search after the arch being scored, with :class:`Interrupted`
    (training is complete: ``checkpoint`` holds it). ``search=none`` scores only ``trained`` (the
    fixed sampler's arch), or nothing. Progress: a bar on the main rank's terminal, else log lines
    there (:class:`_Progress`)."""
    s = rc.search
    total = s.budget if s.algorithm != "none" else int(trained is not None)
    evals: dict[Arch, EvalResult] = {}
    if total == 0:  # search=none and no fixed arch: nothing to score
        return SearchResult((), 0), evals
    val = data.val_batches(s.val_batch_size)
    calib = data.calib_batches(s.bn_calib_batches, s.calib_batch_size)
    what = f"search ({s.algorithm})" if s.algorithm != "none" else "scoring the trained arch"
    bar = tqdm(total=total, desc=what, unit="arch", file=sys.stderr,
               disable=not _show_bars(engine), dynamic_ncols=True, leave=False)
    progress = (_Progress(what, total, rlog or _RankLog(log, {"rank": engine.rank}))
                if engine.is_main and bar.disable and s.algorithm != "none" else None)  # one arch: run() logs it

    def scorer(arch: Arch) -> float:
        if stop is not None:
            stop.before(len(evals), "evaluate")
        evals[arch] = ev = engine.evaluate(arch, val, calib)
        # not finite (NaN logits still have an argmax): ranked last, never the best
        score = ev.accuracy if math.isfinite(ev.loss) else -math.inf
        bar.update(1)
        if progress is not None:
            progress.update(score)
        if stop is not None and stop.after(len(evals) - 1, "evaluate"):
            raise Interrupted(f"{stop.interrupts.name}: stopped the search after {len(evals)} of {total} archs; "
                              f"training is complete: checkpoint {checkpoint} (step {rc.train.steps})",
                              stop.interrupts.signum or 0, checkpoint, rc.train.steps)
        return score

    # search.seed varies the search alone: the trained supernet (checkpoint) stays the same
    rng = random.Random(derive_seed(rc.seed if s.seed is None else s.seed, "search"))
    constraint = s.constraints.check(cost)
    common: dict[str, Callable | Any] = {"top_k": s.top_k, "constraint": constraint, "seed_archs": seed_archs}
    try:
        if s.algorithm == "evolution":
            result = evolution_search(space, scorer, rng, population=s.population, generations=s.generations,
                                      mutate_prob=s.mutate_prob, crossover_prob=s.crossover_prob,
                                      parents=s.parents, **common)
        elif s.algorithm == "random":
            result = random_search(space, scorer, rng, budget=s.budget, **common)
        else:  # none, with the fixed sampler's arch: scored exactly as a search scores a candidate
            result = SearchResult((Candidate(trained, scorer(trained)),), 1)
    finally:
        bar.close()
    if progress is not None:
        progress.finish()
    return result, evals


PROGRESS_EVERY_S = 5.0  # off a terminal: at most one search progress line per this many seconds, then the last


class _Progress:
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


_NO_SEARCH = {  # summary.json's search.note with search=none, by whether the sampler is fixed
    True: "search=none: no search ran; best and top_k are the fixed sampler's arch (trained_arch), scored once",
    False: "search=none: no search ran and no arch was scored (best is null); every step's arch is in metrics.jsonl",
}
_ALGORITHMS = ("evolution", "random")  # those that search (search.config.ALGORITHMS less none)


def _searches(path: Path | None, digest: str | None, algorithm: str, section: dict[str, Any] | None,
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
        previous = {k: v for k, v in previous.items() if k in _ALGORITHMS and k != algorithm}
        if old.get("params_digest") == digest:
            kept.update(previous)
        elif previous:
            rlog.info("%s: the searches there (%s) scored other weights; replaced", path, ", ".join(sorted(previous)))
    if section is not None:
        kept[algorithm] = section
    return dict(sorted(kept.items()))


def _write_trace(path: Path, engine: Engine, steps: tuple[int, ...], rlog: logging.LoggerAdapter) -> None:
    """Gather every rank's spans of the traced steps (collective) and write them on the main rank."""
    spans = engine.trace_spans()
    if not engine.is_main:
        return
    if spans:
        write_trace(path, spans)
        rlog.info("timeline of steps %s (%d spans): %s (open it in https://ui.perfetto.dev)", list(steps), len(spans),
                  path)
    else:  # a resumed run that starts after the traced steps
        rlog.warning("pipeline.trace_steps %s: no step of them ran in this invocation; no %s written", list(steps),
                     path.name)


def _write_search_log(path: Path, rc: RunConfig, evals: dict[Arch, EvalResult], cost: SubnetCost) -> None:
    """Every scored arch in scoring order: its generation (for random search, the same-sized
    batches evolution would have had), accuracy, loss and parameters."""
    lines = []
    for i, (arch, ev) in enumerate(evals.items()):  # dicts keep insertion (= scoring) order
        lines.append(json.dumps({
            "index": i, "generation": i // rc.search.population, "arch": dict(arch), "val_accuracy": ev.accuracy,
            "val_loss": _finite(ev.loss), "nonfinite": not math.isfinite(ev.loss), "params": cost.params(arch),
        }) + "\n")
    atomic_write_text(path, "".join(lines))


def _show_bars(engine: Engine) -> bool:
    """Progress bars on the main rank's terminal only: in a log file or a pipe a bar is only
    fragments of carriage-return redraws."""
    return engine.is_main and sys.stderr.isatty()


def _memory_fields(m: Any) -> dict[str, Any]:
    """A step's tensor-manager figures for metrics.jsonl (null when the engine reports none)."""
    return {k: None if m is None else getattr(m, k) for k in MEMORY_FIELDS}


def _memory_totals(engine: Engine) -> dict[str, Any] | None:
    tensors = getattr(engine, "tensors", None)
    if tensors is None:
        return None
    m = tensors.stats()
    return {"device_budget_bytes": m.budget_bytes, "resident_bytes_peak": m.resident_bytes_peak,
            "fetched_bytes": m.fetched_bytes, "written_back_bytes": m.written_back_bytes, "fetches": m.fetches,
            "write_backs": m.write_backs, "evictions": m.evictions, "hits": m.hits, "late": m.late,
            "misses": m.misses, "hit_rate": m.hit_rate, "stall_s": round(m.stall_s, 6), "busy_s": round(m.busy_s, 6)}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no NaN


def _entry(arch: Arch, ev: EvalResult, cost: SubnetCost) -> dict[str, Any]:
    try:
        flops: int | None = cost.flops(arch)
    except Exception as e:  # FLOPs are informational here; a space may have ops torch cannot count
        log.warning("cannot count the FLOPs of %s: %s", arch, e)
        flops = None
    return {"arch": dict(arch), "val_accuracy": ev.accuracy, "val_loss": _finite(ev.loss),
            "nonfinite": not math.isfinite(ev.loss), "params": cost.params(arch), "flops": flops}
