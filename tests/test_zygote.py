"""tests/zygote.py: a forked child behaves as the fresh ``python`` the tests used to start."""
from __future__ import annotations

import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.cli_driver import child_env
from tests.zygote import collect, launch

_SCRIPT = textwrap.dedent("""
    import json, os, random, sys, threading, time
    import torch
    what = sys.argv[1]
    if what == "report":
        print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("ZYGOTE_PROBE"),
                          "path0": sys.path[0], "name": __name__, "pid": os.getpid(), "random": random.random(),
                          "torch": torch.ones(2).sum().item(), "stdin": sys.stdin.read()}))
        print("to stderr", file=sys.stderr)
    elif what == "raise":
        raise ValueError("the rank's own error")
    elif what == "exit":
        sys.exit(int(sys.argv[2]))
    elif what == "thread":  # the interpreter waits for a non-daemon thread before it exits
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True))).start()
    elif what == "sleep":
        time.sleep(60)
""")


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("zygote") / "child.py"
    path.write_text(_SCRIPT)
    return path


def _both(monkeypatch: pytest.MonkeyPatch, args: list[str], cwd: Path, **env: str) -> list[tuple[int, str, str]]:
    """The same command forked and as a fresh interpreter: (status, stdout, stderr) each."""
    got = []
    for exec_ in ("0", "1"):
        with monkeypatch.context() as m:
            m.setenv("PIPENAS_TEST_EXEC", exec_)
            p = launch(args, child_env(**env), cwd)
        out, err = p.communicate(timeout=60)
        got.append((p.returncode, out, err))
    return got


def test_a_forked_child_sees_its_argv_cwd_env_and_path_and_writes_its_own_output(script, tmp_path,
                                                                                  monkeypatch) -> None:
    import json

    (forked, fresh) = _both(monkeypatch, [str(script), "report", "x"], tmp_path, ZYGOTE_PROBE="yes")
    assert forked[0] == fresh[0] == 0, forked[2] + fresh[2]
    a, b = json.loads(forked[1]), json.loads(fresh[1])
    for key in ("argv", "cwd", "env", "path0", "name", "torch", "stdin"):
        assert a[key] == b[key], key
    assert a["argv"] == [str(script), "report", "x"] and a["env"] == "yes" and a["name"] == "__main__"
    assert forked[2] == fresh[2] == "to stderr\n"


def test_two_forked_children_draw_their_own_random_streams(script, tmp_path) -> None:
    import json

    a, b = (launch([str(script), "report"], child_env(), tmp_path) for _ in range(2))
    ra, rb = (json.loads(p.communicate(timeout=60)[0]) for p in (a, b))
    assert ra["pid"] != rb["pid"] and ra["random"] != rb["random"]


@pytest.mark.parametrize("args, status", [(["raise"], 1), (["exit", "3"], 3), (["thread"], 0)])
def test_exit_status_tracebacks_and_threads_as_a_fresh_interpreter(script, tmp_path, monkeypatch, args,
                                                                    status) -> None:
    (forked, fresh) = _both(monkeypatch, [str(script), *args], tmp_path)
    assert forked[0] == fresh[0] == status
    assert forked[1] == fresh[1]
    assert forked[2].splitlines()[-1:] == fresh[2].splitlines()[-1:]  # "ValueError: the rank's own error"


def test_a_killed_child_reports_the_signal_and_wait_times_out_before(script, tmp_path) -> None:
    p = launch([str(script), "sleep"], child_env(), tmp_path)
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    p.kill()
    assert p.wait(30) == -signal.SIGKILL


def test_code_given_with_dash_c(tmp_path) -> None:
    p = launch(["-c", "import sys; print(sys.argv[1:], __name__)", "a", "b"], child_env(), tmp_path)
    assert p.communicate(timeout=60) == ("['a', 'b'] __main__\n", "")
    assert p.returncode == 0


@pytest.mark.parametrize("exec_", ["0", "1"])
def test_collect_kills_every_child_at_the_first_that_overruns_the_deadline(script, tmp_path, monkeypatch,
                                                                          exec_) -> None:
    monkeypatch.setenv("PIPENAS_TEST_EXEC", exec_)
    procs = [launch([str(script), *args], child_env(), tmp_path) for args in (["exit", "0"], ["sleep"], ["sleep"])]
    procs[0].wait(60)  # finished before the deadline starts (an interpreter's start-up varies with the load)
    first, hung, after = collect(procs, 2)
    assert first is not None and first.returncode == 0
    assert hung is None  # the one that overran the deadline
    assert after is not None and after.returncode == -signal.SIGKILL  # killed with it
    assert all(p.poll() is not None for p in procs)
