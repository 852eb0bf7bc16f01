"""The command line: ``python -m search [hydra overrides]`` (also under torchrun).

Exit status, with or without torchrun and ``HYDRA_FULL_ERROR``:

* 0: trained, searched, printed the best arch (``search=none``: trained, printed the fixed sampler's
  arch and its validation accuracy, or with another sampler the steps trained);
* 2: bad input or an unusable environment (a field, a preset's YAML, a run directory that cannot
  be written, a checkpoint that cannot be read or belongs to other settings): one line on stderr,
  ``error: <field or file>: expected ..., found ...``, and nothing written, not even the run
  directory;
* 1: a failure while running: a pipeline rank (rank, step, action and the schedule grid), a
  non-finite loss (one line from rank 0), anything unexpected (its traceback, then one line).
  ``HYDRA_FULL_ERROR=1`` adds the traceback to the first two;
* 130 / 143: stopped by SIGINT / SIGTERM after writing a checkpoint; the line says how to resume.

Under torchrun every rank pins the same run directory, derived from the overrides, so that a
restarted job (``--max-restarts``) or the same command run again finds its checkpoint; one process
pins Hydra's timestamped directory before anything is written, so the resume line can name it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import signal
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

# What cli() prepared before Hydra took over, for the task function below (one job per process).
_session: dict[str, Any] = {}


def torchrun_argv(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """``argv`` plus what pins a torchrun job's run directory and quiets ranks other than 0.

    Outside torchrun (no ``WORLD_SIZE``) ``argv`` comes back unchanged.
    """
    argv = list(argv)
    if "WORLD_SIZE" not in env:
        return argv
    user = argv[1:]
    if not _has_run_dir(user):
        key = hashlib.sha256("\n".join(sorted(user)).encode()).hexdigest()[:12]
        argv.append(f"hydra.run.dir=outputs/torchrun/{key}")
    if env.get("RANK", "0") != "0":
        # Only rank 0 writes .hydra/ and the log file; the others log to stderr.
        argv += ["hydra.output_subdir=null", "hydra/job_logging=rank_stderr"]
    return argv


def _has_run_dir(overrides: Sequence[str]) -> bool:
    return any(a.lstrip("+").startswith("hydra.run.dir=") for a in overrides)


def _one_line(text: str) -> str:
    return "; ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())


class BadInput(ValueError):
    """The config cannot be composed, or Hydra cannot set up the run (one line)."""


def compose_config(overrides: Sequence[str]) -> DictConfig:
    """The config as Hydra composes it for ``overrides`` (with its ``hydra`` node), or
    :class:`BadInput` with one line naming the group, field or file and line."""
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="search"):
            return compose("config", overrides=list(overrides), return_hydra_config=True)
    except MissingConfigException as e:
        if e.options and e.missing_cfg_file and "/" in e.missing_cfg_file:
            group, _, name = e.missing_cfg_file.rpartition("/")
            raise BadInput(f"{group}: no option {name!r}; expected one of {sorted(e.options)} "
                           f"(or a YAML of your own in conf/{group}/)") from None
        raise BadInput(" ".join(str(e).split("Config search path:")[0].split())) from None
    except Exception as e:
        yaml_error = next((c for c in _causes(e) if isinstance(c, yaml.YAMLError)), None)
        if yaml_error is not None:
            raise BadInput(_yaml_problem(yaml_error)) from None
        if isinstance(e, (HydraException, OmegaConfBaseException)):
            raise BadInput(" ".join(str(e).split()) or type(e).__name__) from None
        raise


def _causes(e: BaseException, implicit: bool = True) -> list[BaseException]:
    """``e`` and what caused it (``raise ... from``; with ``implicit``, also what it was raised
    while handling)."""
    seen: list[BaseException] = []
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or (e.__context__ if implicit else None)  # type: ignore[assignment]
    return seen


def _yaml_problem(e: Any) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = " ".join(filter(None, [getattr(e, "context", None), getattr(e, "problem", None)])) or str(e)
    if mark is None:
        return f"expected valid YAML, found {problem}"
    return f"{mark.name}, line {mark.line + 1}: expected valid YAML, found {problem} (column {mark.column + 1})"


@contextmanager
def _mode_known(mode: Any) -> Iterator[None]:
    """Hydra composes the whole config once only to read ``hydra.mode`` (run or sweep), then
    again to run the job: 0.5-0.7 s of every process's start on the 2-core VM. :func:`_run`
    composed it already, so Hydra is told the mode it found (None: Hydra's own default, a run);
    where Hydra's internals differ, it composes as before."""
    try:
        from hydra._internal.hydra import Hydra
        own = Hydra.get_mode
    except (ImportError, AttributeError):
        yield
        return
    Hydra.get_mode = lambda self, config_name, overrides: mode
    try:
        yield
    finally:
        Hydra.get_mode = own


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _quote(value: str) -> str:
    """A value as a Hydra override accepts it."""
    if re.fullmatch(r"[\w./:@+-]+", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


# -- reporting ---------------------------------------------------------------------------------

def _resume_hint(out: Path) -> str:
    user = _session.get("user_args", [])
    if "WORLD_SIZE" in os.environ:
        return f"to resume, run the same torchrun command again (it continues from {out})"
    args = list(user) if _has_run_dir(user) or any(a.startswith("output_dir=") for a in user) else \
        [*user, f"hydra.run.dir={_quote(str(out))}"]
    return "to resume: " + shlex.join(["python", "-m", "search", *args])


def report(e: BaseException, full: bool) -> int:
    """Print what ended the run (rank 0 for what every rank hits alike) and return the exit status."""
    from pipeline.failures import StageFailure

    from .app import NonFiniteLoss
    from .interrupt import Interrupted, exit_status

    if isinstance(e, Interrupted):
        if _is_rank0():
            where = f"; {_resume_hint(e.checkpoint.parent)}" if e.checkpoint is not None else ""
            print(f"interrupted: {e}{where}", file=sys.stderr)
        return e.status
    if isinstance(e, KeyboardInterrupt):  # a Ctrl-C where the handlers were not installed
        print("interrupted: SIGINT; no checkpoint written", file=sys.stderr)
        return exit_status(signal.SIGINT)
    if isinstance(e, ValueError):  # bad input: ConfigError, CheckpointError, SupernetError, ...
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    if not isinstance(e, (StageFailure, NonFiniteLoss, OSError)):  # unexpected: a bug, show where
        traceback.print_exception(e)
        print(f"error: {type(e).__name__}: {_one_line(str(e))}", file=sys.stderr)
        return 1
    if full:
        traceback.print_exception(e)
    if isinstance(e, StageFailure):  # keeps its rank-by-step grid on the lines below
        print(f"error: {str(e).strip()}", file=sys.stderr)
    elif not isinstance(e, NonFiniteLoss) or _is_rank0():  # every rank stops on a non-finite loss; rank 0 says it
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
    return 1


def _second_signal(signum: int, written: list[Path]) -> None:
    from .checkpoint import CHECKPOINT_NAME, previous_path

    out = _session.get("out")
    saved = f" (completed the write of {', '.join(map(str, written))})" if written else ""
    if out is None or not any(p.exists() for p in (out / CHECKPOINT_NAME, previous_path(out / CHECKPOINT_NAME))):
        hint = "; no checkpoint was written yet: the same command starts afresh"
    else:
        hint = f"; {_resume_hint(out)}"
    if _is_rank0():
        print(f"interrupted: {signal.Signals(signum).name} again: exited at once; the files on disk are whole{saved}"
              f"{hint}", file=sys.stderr, flush=True)


# -- the job -----------------------------------------------------------------------------------

@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from .app import _output_dir, run
    from .config import config_digest
    from .interrupt import Interrupts

    _session["task_started"] = True  # from here on, what fails is the run's, not Hydra's set-up
    try:
        prepared = _session.get("prepared")
        if prepared is not None and (prepared.config_digest != config_digest(cfg)
                                     or prepared.out.resolve() != _output_dir(prepared.rc.output_dir).resolve()):
            prepared = None  # not what cli() checked: check again
        summary = run(cfg, prepared=prepared, interrupts=_session.get("interrupts") or Interrupts())
    except BaseException as e:  # noqa: BLE001 - reported here, so that Hydra adds no "Error executing job"
        raise SystemExit(report(e, _session.get("full_error", False))) from None
    if _is_rank0():
        best = summary["best"]
        searched = summary["search"]["algorithm"] != "none"
        if not searched and summary["trained_arch"] is None:  # search=none, a sampler of many archs
            loss = summary["final_loss"]
            print(f"trained: {summary['steps']} steps, sampler {summary['sampler']['name']}, final loss "
                  f"{'not finite' if loss is None else f'{loss:.4f}'}; no search ran (search=none)")
            print(f"output dir: {summary['output_dir']}")
            return
        if best is None:
            which = "no architecture evaluated" if searched else "the trained arch did not evaluate"
            print(f"error: {which} to a finite validation loss (non-finite steps skipped: "
                  f"{summary['nonfinite_steps_skipped']}); see {summary['output_dir']}", file=sys.stderr)
            raise SystemExit(1)
        print(f"{'best' if searched else 'trained'} arch: {json.dumps(best['arch'], sort_keys=True)}")
        print(f"val accuracy: {best['val_accuracy']:.4f} (params {best['params']}, flops {best['flops']})")
        print(f"output dir: {summary['output_dir']}")


def _run(argv: list[str]) -> int:
    """Check the input, then hand over to Hydra; the exit status."""
    from .app import prepare
    from .interrupt import Interrupts

    overrides = argv[1:]
    full = os.environ.get("HYDRA_FULL_ERROR") == "1"
    _session.update(full_error=full)
    if any(a.startswith("-") for a in overrides):  # --help, --cfg, --multirun, ...: Hydra's own business
        if set(overrides) & {"-m", "--multirun"}:  # but every job of a sweep is checked first, as one run is
            try:
                _check_sweep([a for a in overrides if not a.startswith("-")])
            except ValueError as e:
                if _is_rank0():
                    print(f"error: {_one_line(str(e))}", file=sys.stderr)
                return 2
        sys.argv = argv
        main()
        return 0
    interrupts = Interrupts(on_second=_second_signal, announce=_is_rank0()).install()
    _session.update(interrupts=interrupts)
    try:
        try:
            cfg = compose_config(overrides)
        except BadInput as e:  # the same on every rank: rank 0 says it
            if _is_rank0():
                print(f"error: {e}", file=sys.stderr)
            return 2
        if not _has_run_dir(overrides):  # pin the timestamped directory: the resume line names it
            overrides = [*overrides, f"hydra.run.dir={_quote(str(OmegaConf.select(cfg, 'hydra.run.dir')))}"]
        run_dir = Path(str(OmegaConf.select(cfg, "hydra.run.dir")))
        job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])  # what Hydra hands the task
        try:
            prepared = prepare(job, None if job.get("output_dir") else run_dir, output_field="hydra.run.dir")
        except ValueError as e:  # the same on every rank: rank 0 says it
            if _is_rank0():
                print(f"error: {_one_line(str(e))}", file=sys.stderr)
            return 2
        _session.update(prepared=prepared, out=prepared.out)
        sys.argv = [argv[0], *overrides]
        os.environ["HYDRA_FULL_ERROR"] = "1"  # what fails in Hydra's own set-up comes to us, reported below
        try:
            with _mode_known(OmegaConf.select(cfg, "hydra.mode")):
                main()  # the task's own failures come back as SystemExit (see main)
        except Exception as e:
            if _session.get("task_started"):
                raise
            raise _setup_failure(e, run_dir) from e
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - every failure ends in a status, never 0
        return report(e, full)
    finally:
        interrupts.uninstall()


def _check_sweep(overrides: Sequence[str]) -> None:
    """Every job of a Hydra sweep (``-m a=1,2 b=x,y``: the cartesian product, as Hydra's basic
    sweeper makes it) checked as one run is, before Hydra writes the sweep directory: the first
    bad job's one line, naming the job (:class:`BadInput` or the config's own error)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from .app import prepare

    try:
        (jobs,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(list(overrides)), None)
    except Exception as e:  # noqa: BLE001 - Hydra's parse errors: one line, as for one run
        raise BadInput(" ".join(str(e).split()) or type(e).__name__) from None
    for num, job in enumerate(jobs):
        cfg = compose_config(job)
        sweep_dir = Path(str(OmegaConf.select(cfg, "hydra.sweep.dir")))
        try:
            prepare(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), sweep_dir / str(num),
                    output_field="hydra.sweep.dir")
        except ValueError as e:
            raise type(e)(f"{e} (sweep job {num}: {' '.join(job)})") from None


def _setup_failure(e: Exception, run_dir: Path) -> Exception:
    """What failed while Hydra set the run up (its directory, its log file), as bad input."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    os_error = next((c for c in _causes(e, implicit=False) if isinstance(c, OSError)), None)
    if os_error is not None:
        return BadInput(f"hydra.run.dir: expected a directory you can write, found {run_dir}: {_one_line(str(os_error))}")
    if isinstance(e, (HydraException, OmegaConfBaseException)):
        return BadInput(" ".join(str(e).split()) or type(e).__name__)
    return e


def status(argv: Sequence[str]) -> int:
    """Run the command line ``argv`` (``["search", *overrides]``) to its exit status, printing what
    :func:`cli` prints but leaving the process as it is (the tests run many in one interpreter)."""
    _session.clear()
    _session.update(user_args=list(argv[1:]))
    full_error = os.environ.get("HYDRA_FULL_ERROR")
    try:
        return _run(torchrun_argv(argv, os.environ))
    finally:
        if full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = full_error
        _session.clear()


def cli() -> None:
    code = status(sys.argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if "WORLD_SIZE" in os.environ:
        # Under torchrun: once the engine has torn down its process group and every output is
        # written, leave without interpreter finalization, where gloo's threads can still hold
        # work objects and abort the process (pytorch/pytorch#179291, #190489).
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    cli()
