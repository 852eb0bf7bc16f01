"""Export a searched subnet as a standalone model: ``python -m search.export <run dir> [--arch JSON] [--out DIR]``.

The run directory is one a ``python -m search`` run finished: ``summary.json``, ``checkpoint.pt``
and Hydra's ``.hydra/config.yaml`` (the config that rebuilds the space and the data). The arch is
``--arch`` (a JSON object label -> value) or the summary's best. Its ops get the checkpoint's
weights, then batch norm is recalibrated exactly as the search scores a candidate (the same
calibration batches, :func:`pipeline.engine.recalibrated_bn`, train-mode forwards through the
executor), and the recalibrated statistics are kept. Written into ``--out`` (default
``<run dir>/export/best/``, or ``export/<arch slug>/`` with ``--arch``):

* ``model.pt``: the subnet's ``state_dict`` (plain tensors), which loads strictly into the
  module :func:`load_module` builds: a :class:`supernet.Subnet` (a ``ModuleDict`` of the ops run
  in the graph's topological order, with the executor's wiring). Building it needs this project
  (the op registry) and the space's module importable, as for the run;
* ``model.pt2``: the subnet in eval mode as a ``torch.export`` program with a dynamic batch
  dimension; ``torch.export.load("model.pt2").module()(x)`` runs it in a process that imports
  nothing of this project (where ``torch.export`` cannot trace an op, the file is not written and
  ``arch.json`` says why);
* ``arch.json``: the arch, input shape, number of classes, the validation accuracy measured here
  (on ``data.val_batches(search.val_batch_size)``; the export computes on the CPU, so this equals
  the search's figure for a run that searched on the CPU; a run scored on a GPU may differ in the
  last bits, and its figure is kept beside as ``search_val_accuracy``), the wiring and how to
  load each file.

Bad input (a run directory without these files, an arch not in the space, an ``--out`` that
cannot be written) prints one line, ``error: <field or file>: expected ..., found ...``, exits 2
and writes nothing: every check runs before the first write.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from pipeline import EvalResult, params_digest
from pipeline.engine import calibrate, graph_has_batchnorm, recalibrated_bn, score_batches
from pipeline.memory.state import load_flat
from supernet import Arch, Subnet, Supernet, SupernetGraph
from supernet.execute import whole_slice

from .app import check_writable
from .checkpoint import CHECKPOINT_NAME, SUMMARY_NAME, atomic_write_bytes, atomic_write_text, load_checkpoint
from .config import RunConfig, TargetConfig, build_data, build_space, config_digest, load_config

__all__ = ["ExportError", "Exported", "export", "load_module", "subnet_module", "main", "MODEL_NAME", "PROGRAM_NAME",
           "ARCH_NAME", "CONFIG_PATH"]

MODEL_NAME = "model.pt"
PROGRAM_NAME = "model.pt2"
ARCH_NAME = "arch.json"
CONFIG_PATH = Path(".hydra") / "config.yaml"  # where Hydra keeps the run's config
_RUN = "a finished `python -m search` run"


class ExportError(ValueError):
    """The run directory, the arch or the output directory cannot be exported from or to."""


@dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote and measured."""

    arch: Arch
    files: tuple[Path, ...]  # in the order written
    val: EvalResult  # the exported module (model.pt) on the validation batches
    program_val: EvalResult | None  # the model.pt2 program; None where it was not written
    program_note: str | None  # why model.pt2 was not written
    search_accuracy: float | None  # what the run's search scored for this arch, where it did


@dataclass(frozen=True)
class _Run:
    """A run directory read and checked; nothing written yet."""

    dir: Path
    rc: RunConfig
    graph: SupernetGraph
    data: Any
    summary: dict[str, Any]
    op_states: Mapping[str, Mapping[str, torch.Tensor]]


# -- reading the run -------------------------------------------------------------------------

def _read_run(run_dir: Path) -> _Run:
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: expected the run directory of {_RUN}, found "
                          f"{'a file' if run_dir.exists() else 'no such directory'}")
    summary = _read_summary(run_dir / SUMMARY_NAME)
    cfg_path = run_dir / CONFIG_PATH
    if not cfg_path.is_file():
        raise ExportError(f"{cfg_path}: expected the config Hydra writes beside {_RUN}, found no such file")
    try:
        cfg = OmegaConf.load(cfg_path)
    except Exception as e:  # YAML and OmegaConf errors: the file is not a config
        raise ExportError(f"{cfg_path}: expected a YAML config, found one that cannot be read ({_line(e)})") from None
    digest = config_digest(cfg)
    if summary.get("config_digest") not in (None, digest):
        raise ExportError(f"{cfg_path}: expected the config of the run that wrote {SUMMARY_NAME} (config digest "
                          f"{str(summary['config_digest'])[:12]}), found digest {digest[:12]}")
    cfg.device = "cpu"  # the export computes on the CPU, whatever the run trained on
    try:
        rc = load_config(cfg)
        data = build_data(rc.data)
        graph = build_space(rc.space, data.input_shape, data.num_classes)
    except ValueError as e:
        raise ExportError(f"{cfg_path}: {_line(e)}") from None
    ckpt_path = run_dir / CHECKPOINT_NAME
    ckpt = load_checkpoint(ckpt_path)  # CheckpointError (a ValueError) names the file
    if ckpt is None:
        raise ExportError(f"{ckpt_path}: expected the checkpoint of {_RUN}, found no such file")
    want = summary.get("params_digest")
    if want is not None and params_digest(ckpt.op_states) != want:
        raise ExportError(f"{ckpt_path}: expected the weights {SUMMARY_NAME} scored (params digest {want[:12]}), "
                          f"found other weights (step {ckpt.step}); export from the run that wrote both")
    return _Run(run_dir, rc, graph, data, summary, ckpt.op_states)


def _read_summary(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ExportError(f"{path}: expected the summary of {_RUN}, found no such file")
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: expected a JSON summary, found one that cannot be read ({_line(e)})") from None
    if not isinstance(summary, dict):
        raise ExportError(f"{path}: expected a JSON object, found {type(summary).__name__}")
    return summary


def _choose_arch(run: _Run, arch_json: str | None) -> Arch:
    space = run.graph.space()
    if arch_json is None:
        best = run.summary.get("best")
        if not isinstance(best, dict) or not isinstance(best.get("arch"), dict):
            raise ExportError(f"{run.dir / SUMMARY_NAME}: best.arch: expected the best arch of the search, found "
                              f"{json.dumps(best)} (no arch scored a finite loss, or no search ran); pass --arch")
        return space.validate(best["arch"], f"{SUMMARY_NAME} best.arch")
    try:
        arch = json.loads(arch_json)
    except ValueError as e:
        raise ExportError(f"--arch: expected a JSON object label -> value, found {arch_json!r} ({_line(e)})") from None
    return space.validate(arch, "--arch")  # SearchSpaceError names the label and lists its values


def _search_accuracy(summary: Mapping[str, Any], arch: Arch) -> float | None:
    """What the run's search scored for ``arch`` (its best or top-k), else ``None``."""
    entries = [summary.get("best"), *(summary.get("top_k") or [])]
    return next((e["val_accuracy"] for e in entries if isinstance(e, dict) and e.get("arch") == dict(arch)), None)


# -- the subnet --------------------------------------------------------------------------------

def subnet_module(graph: SupernetGraph, arch: Arch, seed: int) -> Subnet:
    """The subnet ``arch`` as a plain module (:meth:`supernet.Supernet.extract`), in eval mode;
    its ``state_dict`` keys are those ``model.pt`` holds (``ops.<op_id>.<name>``)."""
    active = graph.active_ops(arch)
    return Supernet(graph, seed, [op.op_id for op in active]).extract(arch).eval()


def _load_states(sub: Subnet, states: Mapping[str, Mapping[str, torch.Tensor]], where: Path) -> None:
    """The checkpoint's weights and buffers into the subnet's ops (the optimizer state stays out)."""
    for op_id, module in sub.ops.items():
        state = states.get(op_id)
        if state is None:
            raise ExportError(f"{where}: expected a state for op {op_id!r}, found none (a checkpoint of another "
                              "space?)")
        weights = {k: v for k, v in state.items() if not k.startswith("optim/")}
        try:
            load_flat(module, None, weights, torch.device("cpu"))  # type: ignore[arg-type] - no optimizer entries
        except (KeyError, RuntimeError) as e:
            raise ExportError(f"{where}: op {op_id!r}: expected the tensors of {type(module).__name__}, found a "
                              f"state that does not fit ({_line(e)})") from None


def _recalibrate(sub: Subnet, graph: SupernetGraph, arch: Arch, seed: int, calib: list) -> None:
    """Batch-norm statistics as the search scores ``arch`` (``ReferenceEngine._evaluate``): reset
    to a cumulative average, one train-mode forward per calibration batch through the executor,
    with the evaluation's op contexts; the statistics are kept (the search restores them)."""
    if not calib or not graph_has_batchnorm(graph):
        return
    with recalibrated_bn(sub.ops.values()):
        calibrate(whole_slice(graph, arch), sub.ops.__getitem__, seed, calib)
        stats = {k: v.clone() for k, v in sub.state_dict().items()}
    sub.load_state_dict(stats)
    sub.eval()


def _program(sub: Subnet, example: torch.Tensor) -> tuple[torch.export.ExportedProgram | None, str | None]:
    """The subnet as a ``torch.export`` program with a dynamic batch dimension, or why not."""
    example = torch.cat([example, example])[: max(2, example.shape[0])]  # a batch of 1 would be specialised
    try:
        return torch.export.export(sub, (example,), dynamic_shapes={"x": {0: torch.export.Dim("batch")}}), None
    except Exception as e:  # an op torch.export cannot trace: the state dict and the module remain
        return None, f"torch.export failed: {type(e).__name__}: {_line(e)[:500]}"


# -- export ------------------------------------------------------------------------------------

def _slug(arch: Arch) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(str(v) for v in arch.values()))
    return slug if len(slug) <= 64 else f"arch-{arch.digest()}"


def export(run_dir: str | Path, arch_json: str | None = None, out: str | Path | None = None) -> Exported:
    """Export ``arch_json`` (default: the summary's best arch) of the run in ``run_dir`` into
    ``out`` (see the module docstring). Raises :class:`ValueError` (one line, naming the field or
    file) for bad input, before anything is written."""
    run = _read_run(Path(run_dir))
    arch = _choose_arch(run, arch_json)
    if out is None:
        out = run.dir / "export" / ("best" if arch_json is None else _slug(arch))
    out = Path(out)
    check_writable(out, "--out")

    rc, s = run.rc, run.rc.search
    if rc.threads is not None:
        torch.set_num_threads(rc.threads)  # as the run scored it: the same kernels, the same bits
    sub = subnet_module(run.graph, arch, rc.seed)
    _load_states(sub, run.op_states, run.dir / CHECKPOINT_NAME)
    _recalibrate(sub, run.graph, arch, rc.seed, run.data.calib_batches(s.bn_calib_batches, s.calib_batch_size))
    val_batches = run.data.val_batches(s.val_batch_size)
    val = score_batches(lambda _, x: sub(x), val_batches)
    program, note = _program(sub, val_batches[0][0])
    program_val = (score_batches(lambda _, x, m=program.module(): m(x), val_batches) if program is not None
                   else None)

    state = {k: v.detach().clone().contiguous() for k, v in sub.state_dict().items()}
    search_acc = _search_accuracy(run.summary, arch)
    info = {
        "arch": dict(arch),
        "input_shape": list(run.data.input_shape),
        "num_classes": run.data.num_classes,
        "val_accuracy": val.accuracy,
        "val_loss": val.loss if math.isfinite(val.loss) else None,  # JSON has no NaN
        "val_samples": val.total,
        "program_val_accuracy": program_val.accuracy if program_val is not None else None,
        "search_val_accuracy": search_acc,  # null: the search did not score this arch (or not in its top-k)
        "bn_recalibration": {"batches": s.bn_calib_batches, "batch_size": s.calib_batch_size},
        "space": {"target": rc.space.target, "options": rc.space.options},
        "seed": rc.seed,
        "output": sub.output,
        "ops": [{"op_id": op.op_id, "node": op.node, "inputs": list(op.inputs), "spec": str(op.spec)}
                for op in sub.active],  # run in this order; each reads its inputs' outputs
        "files": {
            MODEL_NAME: "state_dict of search.export.load_module(<this dir>), a supernet.Subnet (needs this "
                        "project and the space's ops)",
            PROGRAM_NAME: ("torch.export.load(path).module()(x): logits (batch, num_classes); needs torch only"
                           if program is not None else None),
        },
        "program_note": note,
        "run_dir": str(run.dir),
        "params_digest": run.summary.get("params_digest"),
    }
    written: list[Path] = []
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(out / MODEL_NAME, buf.getvalue())
    written.append(out / MODEL_NAME)
    if program is not None:
        buf = io.BytesIO()
        torch.export.save(program, buf)
        atomic_write_bytes(out / PROGRAM_NAME, buf.getvalue())
        written.append(out / PROGRAM_NAME)
    atomic_write_text(out / ARCH_NAME, json.dumps(info, indent=2) + "\n")
    written.append(out / ARCH_NAME)
    return Exported(arch, tuple(written), val, program_val, note, search_acc)


def load_module(export_dir: str | Path) -> Subnet:
    """The exported subnet as a module (eval mode) with ``model.pt`` loaded strictly. Builds the
    space named in ``arch.json``: needs this project (the op registry) and the space's module."""
    export_dir = Path(export_dir)
    info = json.loads((export_dir / ARCH_NAME).read_text())
    space = info["space"]
    graph = build_space(TargetConfig("space", space["target"], dict(space["options"])), info["input_shape"],
                        info["num_classes"])
    sub = subnet_module(graph, graph.space().validate(info["arch"], f"{export_dir / ARCH_NAME} arch"), info["seed"])
    sub.load_state_dict(torch.load(export_dir / MODEL_NAME, map_location="cpu", weights_only=True), strict=True)
    return sub


# -- the command line --------------------------------------------------------------------------

def _line(e: BaseException) -> str:
    return " ".join(str(e).split())


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m search.export``: the exit status (0, or 2 for bad input, with one line)."""
    ap = argparse.ArgumentParser(prog="python -m search.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="the run directory (summary.json, checkpoint.pt, .hydra/config.yaml)")
    ap.add_argument("--arch", default=None, help="the arch as a JSON object label -> value (default: the best)")
    ap.add_argument("--out", type=Path, default=None, help="where to write (default: <run dir>/export/<best|slug>)")
    args = ap.parse_args(argv)
    try:
        done = export(args.run_dir, args.arch, args.out)
    except ValueError as e:  # ExportError, ConfigError, CheckpointError, SearchSpaceError, ...
        print(f"error: {_line(e)}", file=sys.stderr)
        return 2
    for path in done.files:
        print(f"wrote {path}")
    if done.program_note is not None:
        print(f"warning: {PROGRAM_NAME} not written: {done.program_note}", file=sys.stderr)
    program = ("" if done.program_val is None else
               f"; {PROGRAM_NAME}: {done.program_val.accuracy:.4f}" if done.program_val.correct != done.val.correct else
               f"; {PROGRAM_NAME} alike")
    searched = "" if done.search_accuracy is None else f"; the search scored {done.search_accuracy:.4f}"
    print(f"val accuracy: {done.val.accuracy:.4f} ({done.val.correct}/{done.val.total}{program}{searched})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
