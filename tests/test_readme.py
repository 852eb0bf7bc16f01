"""Every command in README.md's fenced ``bash`` blocks runs, as a user would type it.

Commands run in one scratch directory, in README order, shortened only by overrides this test
appends (:data:`SHORT`: fewer steps, a smaller search) and a scratch run directory of their own
(unless they name one). Each must exit 0. What a command may not do here is marked in the README itself:

* ``# needs CUDA`` in its comment: skipped without a GPU;
* ``python3 -m venv`` / ``pip install`` / ``. .venv/bin/activate``: the environment this suite
  runs in (``.ci/run`` makes it with the quick start's own command, read from the README); of a
  quick-start line the part after the set-up runs here;
* ``python -m pytest``: this suite itself (``.ci/run`` runs it: the quick start's second line);
* ``python -m search.torch_data ...`` (writes example data) and ``mkdir``/``printf``: shell
  commands, run first, with this suite's ``python``;
* ``--rdzv_endpoint=host0:PORT``: a command for several machines; its lines run together on this
  machine with ``127.0.0.1`` and a free port for ``host0:PORT``;
* a single-node ``torchrun`` gets ``--standalone`` (a free rendezvous port, so concurrent jobs
  on the machine do not collide).

A command of a kind this file does not know fails :func:`test_every_readme_command_is_known`:
a README command that cannot run fails CI. Every torchrun command's ``params_digest`` must equal
the one-process run of the same overrides (its layout and memory settings left out: they do not
change what is computed).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.cli_driver import Case, Result, child_env, run_cases

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# appended to every run: what the test shortens, nothing else
SHORT = ["train.steps=8", "train.warmup_steps=2", "search.population=4", "search.generations=1"]
# left out of a torchrun command's one-process twin: they change the layout, not the result
LAYOUT_ONLY = ("pipeline.stages=", "memory.", "pipeline.schedule=")
SETUP = ("python3 -m venv ", ".venv/bin/pip install ", "pip install ", ". .venv/bin/activate")


@dataclass(frozen=True)
class Command:
    """One README command line: where it is and what it says."""

    line: int      # README line number
    text: str      # the command, its comment removed
    comment: str   # the comment after it ('' when none)

    @property
    def job(self) -> str:
        """The command without the environment set-up before it (``a && b && job``)."""
        parts = [p.strip() for p in self.text.split("&&")]
        while parts and parts[0].startswith(SETUP):
            parts.pop(0)
        return " && ".join(parts)

    @property
    def kind(self) -> str:
        """What the test does with it: ``cuda``, ``setup``, ``suite``, ``search``, ``torchrun``,
        ``node`` (one machine's line of a several-machine job), ``shell``, ``export`` or ``unknown``."""
        if "needs CUDA" in self.comment:
            return "cuda"
        job = self.job
        if not job:
            return "setup"
        words = shlex.split(job)
        if words[0] in ("python", ".venv/bin/python") and words[1:3] == ["-m", "pytest"]:
            return "suite"
        if words[0] in ("python", ".venv/bin/python") and words[1:3] == ["-m", "search.torch_data"]:
            return "shell"  # writes example data
        if words[0] in ("python", ".venv/bin/python") and words[1:3] == ["-m", "search.export"]:
            return "export"  # of a run an earlier command made
        if words[0] in ("python", ".venv/bin/python") and words[1:3] == ["-m", "search"]:
            return "search"
        if words[0] in ("torchrun", ".venv/bin/torchrun") and "-m" in words:
            return "node" if any(w.startswith("--rdzv_endpoint=host0:") for w in words) else "torchrun"
        if words[0] in ("mkdir", "printf", "cp", "mv"):
            return "shell"
        return "unknown"

    @property
    def args(self) -> list[str]:
        """The overrides after ``-m search``."""
        words = shlex.split(self.job)
        return words[words.index("search") + 1:]

    @property
    def id(self) -> str:
        return f"README.md:{self.line}"


def readme_commands(text: str | None = None) -> list[Command]:
    """Every command of every fenced ``bash`` block, in order (comment lines skipped)."""
    text = README.read_text() if text is None else text
    commands = []
    for block in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M):
        first = text[:block.start(1)].count("\n") + 1
        for k, raw in enumerate(block.group(1).splitlines()):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            code, comment = _split_comment(line)
            commands.append(Command(first + k, code, comment))
    return commands


def _split_comment(line: str) -> tuple[str, str]:
    """``command  # comment`` -> (command, comment); a ``#`` inside quotes is not a comment."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip(), line[i + 1:].strip()
    return line, ""


COMMANDS = readme_commands()


def test_every_readme_command_is_known() -> None:
    unknown = [f"{c.id}: {c.text}" for c in COMMANDS if c.kind == "unknown"]
    assert not unknown, f"README commands this test cannot run: {unknown}"
    kinds = {c.kind for c in COMMANDS}
    assert {"search", "torchrun", "node", "suite", "shell"} <= kinds, kinds
    nodes = [c for c in COMMANDS if c.kind == "node"]
    assert len(nodes) % 2 == 0, "several-machine jobs come as one line per machine (two here)"


def test_the_quick_start_is_what_ci_runs() -> None:
    """The quick start's second line (make the environment, run the tests) is what .ci/run runs."""
    quick = [c for c in COMMANDS if c.text.startswith("python3 -m venv ")]
    assert [c.kind for c in quick] == ["search", "suite"], quick
    ci = (ROOT / ".ci" / "run").read_text()
    assert "# run the tests" in README.read_text() and "quick_start_tests" in ci


def test_readme_comment_split() -> None:
    assert _split_comment("python -m search a=1   # note") == ("python -m search a=1", "note")
    assert _split_comment("python -m search 'a=#1'") == ("python -m search 'a=#1'", "")
    assert _split_comment("mkdir -p x && printf 'a: 1\\n' > x/y.yaml") == ("mkdir -p x && printf 'a: 1\\n' > x/y.yaml", "")


# -- running them -------------------------------------------------------------------------------

def _python_block(start: str) -> str:
    """The README's fenced python block whose first line is ``start`` (``# my_space.py``)."""
    for block in re.finditer(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M):
        if block.group(1).startswith(start):
            return block.group(1)
    raise AssertionError(f"README.md has no python block starting with {start!r}")


def _twin_args(c: Command) -> list[str]:
    return [a for a in c.args if not a.startswith(LAYOUT_ONLY)]


def _digest(run_dir: Path) -> str:
    return json.loads((run_dir / "summary.json").read_text())["params_digest"]


def _output_dir(r: Result, cwd: Path) -> Path:
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("output dir: ")]
    assert lines, r.stdout[-2000:] + r.stderr[-2000:]
    return cwd / lines[-1].removeprefix("output dir: ")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory the README's commands run in: its shell commands run first, and the
    python file they import (``my_space.py``) is there, as a user would have them."""
    tmp = tmp_path_factory.mktemp("readme")
    (tmp / "my_space.py").write_text(_python_block("# my_space.py"))
    env = child_env(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))  # `python`: this suite's
    for c in COMMANDS:
        if c.kind == "shell":
            subprocess.run(["bash", "-c", c.text], cwd=tmp, env=env, check=True)
    return tmp


@pytest.fixture(scope="module")
def one_process(scratch: Path) -> dict[str, Result]:
    """Every one-process command, and each torchrun command's one-process twin, in one
    interpreter (start-up dominates); by command id (twins: ``<id>:twin``). Torchrun commands
    with the same twin (ten of them are a layout of the default run) share one twin run."""
    cases, ran_as, twin_of, shared = [], [], {}, {}  # shared: a twin's id -> the id of the run it shares
    for c in COMMANDS:
        if c.kind == "search":
            run_dir = [] if any(a.startswith("hydra.run.dir=") for a in c.args) else [f"hydra.run.dir=runs/{c.line}"]
            cases.append(Case([*c.args, *SHORT, *run_dir], str(scratch)))
            ran_as.append(c.id)
        elif c.kind == "torchrun" or (c.kind == "node" and "--node_rank=0" in c.text):
            args, name = tuple(_twin_args(c)), f"{c.id}:twin"
            first = twin_of.setdefault(args, name)
            if first == name:
                cases.append(Case([*args, *SHORT, f"hydra.run.dir=twins/{c.line}"], str(scratch)))
                ran_as.append(name)
            else:
                shared[name] = first
    ran = dict(zip(ran_as, run_cases(cases, timeout_s=1200)))
    return ran | {name: ran[first] for name, first in shared.items()}


@pytest.mark.parametrize("c", [c for c in COMMANDS if c.kind == "search"], ids=lambda c: c.id)
def test_readme_one_process_command(c: Command, scratch: Path, one_process: dict[str, Result]) -> None:
    r = one_process[c.id]
    assert r.status == 0, f"{c.text}\n{r.stderr[-3000:]}"
    assert re.search(r"^(best arch|trained arch|trained): ", r.stdout, re.M), r.stdout[-2000:]
    assert (_output_dir(r, scratch) / "summary.json").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(words: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *words[1:], *SHORT], cwd=cwd, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen, c: Command) -> str:
    try:
        out, err = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    assert p.returncode == 0, f"{c.text}\n{(out + err)[-4000:]}"
    return out


def _check_twin(outs: list[str], c: Command, scratch: Path, one_process: dict[str, Result]) -> None:
    """The job's weights (rank 0 prints where they are) equal its one-process twin's."""
    (out,) = [o for o in outs if "output dir: " in o]
    twin = one_process[f"{c.id}:twin"]
    assert twin.status == 0, twin.stderr[-3000:]
    run_dir = _output_dir(Result(0, out, ""), scratch)
    assert _digest(run_dir) == _digest(_output_dir(twin, scratch)), f"{c.text}: not the one-process weights"


@pytest.mark.parametrize("c", [c for c in COMMANDS if c.kind == "export"], ids=lambda c: c.id)
def test_readme_export_command(c: Command, scratch: Path, one_process: dict[str, Result]) -> None:
    """After the one-process commands (the run it exports is one of them)."""
    words = shlex.split(c.job)
    p = subprocess.run([sys.executable, *words[1:]], cwd=scratch, env=child_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, f"{c.text}\n{p.stderr[-3000:]}"
    assert "val accuracy: " in p.stdout and (scratch / words[3] / "export" / "best" / "model.pt2").exists()


@pytest.mark.dist
@pytest.mark.parametrize("c", [c for c in COMMANDS if c.kind == "torchrun"], ids=lambda c: c.id)
def test_readme_torchrun_command(c: Command, scratch: Path, one_process: dict[str, Result]) -> None:
    words = [*shlex.split(c.job), *_run_dir(c, "torchrun")]
    out = _finish(_torchrun([words[0], "--standalone", *words[1:]], scratch), c)
    _check_twin([out], c, scratch, one_process)


def _run_dir(c: Command, where: str) -> list[str]:
    """A scratch run directory of its own, unless the command names one: torchrun pins it by the
    overrides, and two README commands may have the same ones."""
    return [] if any(a.startswith("hydra.run.dir=") for a in c.args) else [f"hydra.run.dir={where}/{c.line}"]


def _node_pairs() -> list[tuple[Command, Command]]:
    nodes = [c for c in COMMANDS if c.kind == "node"]
    return list(zip(nodes[::2], nodes[1::2]))


@pytest.mark.dist
@pytest.mark.parametrize("pair", _node_pairs(), ids=lambda p: p[0].id)
def test_readme_several_machine_commands(pair: tuple[Command, Command], scratch: Path,
                                         one_process: dict[str, Result]) -> None:
    """Both machines' lines at once on this one, ``host0:PORT`` -> ``127.0.0.1:<free port>``,
    in one run directory (as on a shared filesystem)."""
    port = _free_port()
    procs = []
    for c in pair:
        words = [re.sub(r"^--rdzv_endpoint=host0:\d+$", f"--rdzv_endpoint=127.0.0.1:{port}", w)
                 for w in shlex.split(c.job)]
        procs.append(_torchrun([*words, *_run_dir(pair[0], "nodes")], scratch))
    outs = [_finish(p, c) for p, c in zip(procs, pair)]
    _check_twin(outs, pair[0], scratch, one_process)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (marked so in the README)")
@pytest.mark.parametrize("c", [c for c in COMMANDS if c.kind == "cuda"], ids=lambda c: c.id)
def test_readme_cuda_command(c: Command, tmp_path: Path) -> None:
    words = shlex.split(c.job)
    p = subprocess.run([sys.executable, *words[1:], *SHORT, "hydra.run.dir=run"], cwd=tmp_path, env=child_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
