"""Many ``python -m search`` command lines in one interpreter: start-up dominates a CLI test.

:func:`run_cases` spawns one process that runs each :class:`Case` through
:func:`search.__main__.status` (what ``python -m search`` runs, without leaving the process), in the
case's working directory (first on ``sys.path``, as ``python -m`` puts it) and environment, with stdout and stderr captured, and returns one
:class:`Result` per case. A case with ``ends_process=True`` must be the last: it runs uncaptured
(it leaves through ``os._exit``, as a second Ctrl-C does) and its result is the process's. A case
whose arguments are ``["<printed>"]`` runs the command the case before printed after
"to resume: " (the resume line of an interrupted run, as a user would copy it).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    args: list[str]
    cwd: str
    env: dict[str, str | None] = field(default_factory=dict)  # None: unset for this case
    ends_process: bool = False


@dataclass(frozen=True)
class Result:
    status: int
    stdout: str
    stderr: str

    @property
    def errors(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith(("error:", "interrupted:"))]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a command a test starts: this one's without the torchrun, fault and
    full-error variables, the repository first on ``PYTHONPATH`` (``tests.*`` spaces import), and
    ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "HYDRA_FULL_ERROR", "PIPENAS_FAULT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def torchrun_search(args: list[str], cwd: str | Path, nproc: int = 2, timeout_s: float = 300.0,
                    env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=<nproc> -m search <args>`` in ``cwd``, output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "search",
           *args]
    return subprocess.run(cmd, cwd=cwd, env=child_env() if env is None else env, capture_output=True, text=True,
                          timeout=timeout_s)


def run_cases(cases: list[Case], timeout_s: float = 600.0) -> list[Result]:
    tmp = Path(tempfile.mkdtemp(prefix="pipenas-cli-"))
    (tmp / "spec.json").write_text(json.dumps([asdict(c) for c in cases]))
    from tests.zygote import launch

    p = launch([str(Path(__file__)), str(tmp)], child_env(), ROOT)
    try:
        stdout, stderr = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        _, stderr = p.communicate()
        raise AssertionError(f"the driver ran past {timeout_s} s:\n{stderr[-4000:]}") from None
    out = tmp / "results.jsonl"
    results = [Result(**json.loads(line)) for line in out.read_text().splitlines()] if out.exists() else []
    if cases and cases[-1].ends_process and len(results) == len(cases) - 1:
        results.append(Result(p.returncode, stdout, stderr))
    assert len(results) == len(cases), f"the driver stopped after {len(results)} of {len(cases)} cases " \
                                       f"(status {p.returncode}):\n{stderr[-4000:]}"
    return results


def _worker(tmp: Path) -> None:
    from search.__main__ import status

    cases = [Case(**c) for c in json.loads((tmp / "spec.json").read_text())]
    last = ""
    with open(tmp / "results.jsonl", "w") as results:
        for case in cases:
            if case.args == ["<printed>"]:
                printed = last.split("to resume: ", 1)[1].splitlines()[0] if "to resume: " in last else "search"
                case = Case(shlex.split(printed)[3:], case.cwd, case.env, case.ends_process)  # after python -m search
            saved = {k: os.environ.get(k) for k in case.env}
            for k, v in case.env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            os.chdir(case.cwd)
            sys.path.insert(0, case.cwd)  # as `python -m` puts the working directory first
            if case.ends_process:
                results.flush()
                status(["search", *case.args])
                raise SystemExit("the case meant to end the process returned")
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = status(["search", *case.args])
            last = err.getvalue()
            results.write(json.dumps(asdict(Result(code, out.getvalue(), last))) + "\n")
            results.flush()
            sys.path.remove(case.cwd)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker(Path(sys.argv[1]))
