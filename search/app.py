"""The search run: train the supernet with sampled archs, then search it with inherited weights.

:func:`run` takes the composed config and returns the summary. It is one code path for one
process and for many: every rank calls every engine method with the same arguments in the
same order (training, gathering op states, evaluating candidates; or, under torchrun, each rank
scoring its share of every batch of candidates: :mod:`search.parallel`), and only the main rank
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
:class:`search.interrupt.Interrupted`; during the search it stops after the arch being scored
(scored on every process: after the batch being scored).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm.contrib.logging import logging_redirect_tqdm

import supernet.spaces  # noqa: F401 - registers the built-in spaces and their ops
from pipeline import Engine, create_engine, dist_env, params_digest
from pipeline.determinism import use_deterministic_kernels
from pipeline.eager import skip_dynamo
from pipeline.malloc import keep_freed_memory
from pipeline.engine import engine_device
from pipeline.failures import parse_fault
from pipeline.layout import Layout, LayoutError, resolve_layout
from pipeline.stop import StopVote
from pipeline.trace import write_trace
from supernet import Arch, SearchSpace, SupernetGraph, derive_seed

from .checkpoint import (CHECKPOINT_NAME, SUMMARY_NAME, Checkpoint, CheckpointError, atomic_write_text,
                         remove_temporaries, resume_checkpoint)
from .config import (ConfigError, RunConfig, build_data, build_space, config_digest, field_differences, load_config,
                     train_fields, train_digest)
from .evolution import SubnetCost
from .init_from import InitFrom, read_init_from
from .interrupt import Interrupts
from .metrics import METRICS_NAME, reference_archs
from .samplers import FixedSampler, Sampler, make_sampler
from .scoring import NO_SEARCH, entry, merge_searches, search_supernet, write_search_log
from .training import NonFiniteLoss, RankLog, Stop, finite, show_bars, train_supernet

log = logging.getLogger(__name__)

__all__ = ["run", "prepare", "Prepared", "InitFrom", "NonFiniteLoss", "METRICS_NAME", "SUMMARY_NAME", "TRACE_NAME"]

TRACE_NAME = "trace.json"
COSTS_NAME = "costs.json"  # the measured costs a chosen layout was priced with (pipeline/layout.py)




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
    skip_dynamo()  # no torch._dynamo import in this eager process: 1.5-2 s of its start (pipeline/eager.py)
    rc = load_config(cfg)
    if rc.keep_host_memory:
        keep_freed_memory()  # freed host memory stays in the process: fewer page faults a step (pipeline/malloc.py)
    use_deterministic_kernels(engine_device(rc.device), rc.deterministic)  # before any CUDA work
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
    init = read_init_from(rc.train.init_from, graph, read=ckpt is None) if rc.train.init_from is not None else None
    from pipeline.feasibility import check_memory

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
    rlog = RankLog(log, {"rank": engine.rank})
    # On a terminal log lines go through the progress bar instead of tearing it
    with logging_redirect_tqdm() if show_bars(engine) else nullcontext():
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
            states = train_supernet(rc, engine, sampler, data, out, start, losses, p, rlog,
                            keep_previous=ckpt_file is None or ckpt_file == ckpt_path,
                            stop=Stop(interrupts, vote, faults, engine.rank))
            train_s = time.perf_counter() - t0
            rate = engine.tensors.measured_host_rate
            if rate is not None and engine.is_main:  # memory.host_update_rate: auto, measured when the first plan asked
                rlog.info("memory: the host's optimizer steps %.0f M parameters a second here (memory.host_update_rate: "
                          "auto; hybrid sends home no more than that while a subnet computes)", rate / 1e6)
            if rc.pipeline.trace_steps:
                _write_trace(out / TRACE_NAME, engine, rc.pipeline.trace_steps, rlog)
            if engine.is_main and getattr(engine, "runtime_costs", None) is not None:  # what a report replays with
                from pipeline.profile import table_to_json

                atomic_write_text(out / COSTS_NAME, json.dumps({"table": table_to_json(engine.planner.costs),
                                                                "runtime": engine.runtime_costs.to_json()}) + "\n")

            t0 = time.perf_counter()
            result, evals = search_supernet(rc, engine, space, data, cost, p.seed_archs,
                                    Stop(interrupts, vote, faults, engine.rank), ckpt_path, trained=trained,
                                    rlog=rlog, graph=graph, states=states)
            search_s = time.perf_counter() - t0
            if engine.is_main and rc.search.algorithm != "none":
                write_search_log(out / f"search-{rc.search.algorithm}.jsonl", rc, evals, cost)
        except BaseException:
            try:
                engine.close()
            except Exception as e:  # the failure that got us here is the one to report
                rlog.warning("closing the engine after a failure failed too: %s", e)
            raise
        engine.close()

    top = [entry(c.arch, evals[c.arch], cost) for c in result.top]
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
        "final_loss": finite(losses[-1]) if losses else None,  # null: not the main rank, or diverged
        "mean_loss_last10": finite(sum(losses[-10:]) / len(losses[-10:])) if losses else None,
        # train.nonfinite=skip: steps that updated nothing (null: not the main rank)
        "nonfinite_steps_skipped": sum(not math.isfinite(v) for v in losses) if engine.is_main else None,
        "best": best,
        "top_k": top,
        "search": {"algorithm": rc.search.algorithm, "evaluated": result.evaluated,
                   "best_per_generation": list(result.history),
                   **({} if searched else {"note": NO_SEARCH[trained is not None]})},
        # every search of these weights run in this directory, by algorithm (this run's and those before)
        "searches": merge_searches(out / SUMMARY_NAME if engine.is_main else None, digest, rc.search.algorithm, section,
                              rlog),
        "trained_arch": dict(trained) if trained is not None else None,  # the fixed sampler's; else null
        "params_digest": digest,
        "world_size": engine.world_size,
        # the order subnets were trained in (the same subnets per fair round or block with locality)
        "sampler": {"name": rc.sampler.name, "order": sampler.order, "block": sampler.block},
        # how subnets were trained together: in flight at once, and how ops in every subnet were read
        "pipeline": {"window": _window(engine, rc), "shared_ops": rc.pipeline.shared_ops,
                     "shared_delay": rc.pipeline.shared_delay if rc.pipeline.shared_ops == "delayed" else None,
                     "shared_delays": (dict(rc.pipeline.shared_delays or {}) if rc.pipeline.shared_ops == "delayed" else None),
                     "delay_compensation": ([rc.pipeline.delay_compensation, rc.pipeline.delay_compensation_coef]
                                            if rc.pipeline.shared_ops == "delayed" else None)},
        # stages x replicas and window run; with auto, the predicted samples/s of each alternative (pipeline/layout.py)
        "layout": engine.layout.to_json() if hasattr(engine, "layout") else Layout(1, 1).to_json(),
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


def _window(engine: Engine, rc: RunConfig) -> int:
    """The window the run trained with: the engine's (``pipeline.window=auto``: the layout
    chooser's pick; one process: 1), else the config's."""
    chosen = getattr(getattr(engine, "layout", None), "window", None)
    if chosen is not None:
        return chosen
    return rc.pipeline.window if isinstance(rc.pipeline.window, int) else 1


def _memory_totals(engine: Engine) -> dict[str, Any] | None:
    tensors = getattr(engine, "tensors", None)
    if tensors is None:
        return None
    m = tensors.stats()
    return {"device_budget_bytes": m.budget_bytes, "resident_bytes_peak": m.resident_bytes_peak,
            "fetched_bytes": m.fetched_bytes, "written_back_bytes": m.written_back_bytes, "fetches": m.fetches,
            "write_backs": m.write_backs, "evictions": m.evictions, "hits": m.hits, "late": m.late,
            "misses": m.misses, "hit_rate": m.hit_rate, "stall_s": round(m.stall_s, 6), "busy_s": round(m.busy_s, 6),
            # memory.host_update_rate: auto, as measured on this rank (null: never asked for)
            "host_update_rate_measured": tensors.measured_host_rate}
