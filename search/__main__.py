"""The command line: ``python -m search [hydra overrides]`` (also under torchrun).

Bad input ends with one line, ``error: <what, expected, found>``, on stderr and exit status
2; a failed pipeline rank with ``error: <rank, step, action, cause>`` and status 1; a
non-finite loss (``train.nonfinite=stop``) with one line from rank 0 naming the step, the arch
and the micro-batch, and status 1 (set ``HYDRA_FULL_ERROR=1`` for the traceback). Under torchrun every rank pins the same
run directory, derived from the overrides, so that a restarted job finds its checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import hydra
from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def torchrun_argv(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """``argv`` plus what pins a torchrun job's run directory and quiets ranks other than 0.

    Outside torchrun (no ``WORLD_SIZE``) ``argv`` comes back unchanged.
    """
    argv = list(argv)
    if "WORLD_SIZE" not in env:
        return argv
    user = argv[1:]
    if not any(a.lstrip("+").startswith("hydra.run.dir=") for a in user):
        key = hashlib.sha256("\n".join(sorted(user)).encode()).hexdigest()[:12]
        argv.append(f"hydra.run.dir=outputs/torchrun/{key}")
    if env.get("RANK", "0") != "0":
        # Only rank 0 writes .hydra/ and the log file; the others log to stderr.
        argv += ["hydra.output_subdir=null", "hydra/job_logging=rank_stderr"]
    return argv


def _one_line(text: str) -> str:
    return "; ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())


def compose_error(overrides: Sequence[str]) -> str | None:
    """Why the config does not compose with ``overrides`` (one line), or ``None`` if it does.

    Hydra reports composition errors itself, over several lines and with exit status 1; this
    check lets the CLI report them like every other bad input.
    """
    if any(a.startswith("-") for a in overrides):
        return None  # --help, --cfg, --multirun, ...: Hydra's own business
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="search"):
            compose("config", overrides=list(overrides), return_hydra_config=True)
    except MissingConfigException as e:
        if e.options and e.missing_cfg_file and "/" in e.missing_cfg_file:
            group, _, name = e.missing_cfg_file.rpartition("/")
            return f"{group}: no option {name!r}; expected one of {sorted(e.options)} (or a YAML of your own in conf/{group}/)"
        return " ".join(str(e).split("Config search path:")[0].split())
    except (HydraException, OmegaConfBaseException) as e:
        return " ".join(str(e).split()) or type(e).__name__
    return None


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from pipeline.runtime import StageFailure

    from .app import NonFiniteLoss, run

    try:
        summary = run(cfg)
    except (ValueError, StageFailure, NonFiniteLoss) as e:  # bad input (ConfigError, ...); a failed rank
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if isinstance(e, StageFailure):  # keeps its rank-by-step grid on the lines below
            print(f"error: {str(e).strip()}", file=sys.stderr)
            sys.exit(1)
        if isinstance(e, NonFiniteLoss):  # every rank stops; one line, from rank 0
            if _is_rank0():
                print(f"error: {_one_line(str(e))}", file=sys.stderr)
            sys.exit(1)
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
        sys.exit(2)
    if _is_rank0():
        best = summary["best"]
        if best is None:
            print(f"error: no architecture evaluated to a finite validation loss (non-finite steps skipped: "
                  f"{summary['nonfinite_steps_skipped']}); see {summary['output_dir']}", file=sys.stderr)
            sys.exit(1)
        print(f"best arch: {json.dumps(best['arch'], sort_keys=True)}")
        print(f"val accuracy: {best['val_accuracy']:.4f} (params {best['params']}, flops {best['flops']})")
        print(f"output dir: {summary['output_dir']}")


def cli() -> None:
    sys.argv = torchrun_argv(sys.argv, os.environ)
    problem = compose_error(sys.argv[1:])
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    if "WORLD_SIZE" not in os.environ:
        main()
        return
    # Under torchrun: once the engine has torn down its process group and every output is
    # written, leave without interpreter finalization, where gloo's threads can still hold
    # work objects and abort the process (pytorch/pytorch#179291, #190489).
    code: int | str | None = 0
    try:
        main()
    except SystemExit as e:
        code = e.code
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        if isinstance(code, str):
            print(code, file=sys.stderr)
            code = 1
        os._exit(code or 0)


if __name__ == "__main__":
    cli()
