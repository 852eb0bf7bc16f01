"""Start the tests' rank processes by forking a process that has already imported torch.

A rank the multi-process tests start (``python tests/distributed.py <spec>``) spent about 3 s of
CPU importing torch and this project before its first step, more than most scenarios take to run;
the suite starts a few hundred of them. :func:`launch` asks a server (``python tests/zygote.py``,
one per test process, started on first use) to fork a child of itself, which runs the script as
``python <script> <args>`` would: the given environment and working directory, the script's folder
first on ``sys.path``, output to files, the interpreter's own exit (atexit, non-daemon threads,
an uncaught exception's traceback and status 1). It is a process of its own, with its own gloo
sockets, killed, waited for and read as a ``subprocess.Popen`` is (:class:`Child`).

The server imports modules only (no tensor work: no thread pool is made before a fork) and forks
from a single thread. What a fresh interpreter would read at start-up from the environment
(``PYTHONPATH``, ``PYTHONHASHSEED``) is the server's; nothing these tests start depends on it.
``PIPENAS_TEST_EXEC=1`` starts every child with ``subprocess.Popen`` instead (a fresh interpreter).
"""
from __future__ import annotations

import itertools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ("torch", "torch.distributed", "numpy", "networkx", "pipeline", "pipeline.memory", "supernet.spaces",
           "search.samplers", "distributed")


# -- the server (python tests/zygote.py) ---------------------------------------------------------

def _serve() -> dict | None:
    """Fork a child per request on stdin; report ``started <pid>`` and ``exit <pid> <status>`` on
    stdout. Returns the request in a child; returns None in the server when stdin closes."""
    for name in PRELOAD:
        __import__(name)
    out = sys.stdout
    tasks = Path("/proc/self/task")
    threads = len(list(tasks.iterdir())) if tasks.exists() else 1
    out.write("ready\n" if threads == 1 else f"{threads} threads after the imports: a fork would copy them half-made\n")
    out.flush()
    stdin = sys.stdin.fileno()
    pending = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.05)
        while children:  # reap whatever ended, as Popen.returncode reports it
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            out.write(f"exit {pid} {code}\n")
            out.flush()
        if not readable:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                return request
            children.add(pid)
            out.write(f"started {pid}\n")
            out.flush()


def _become(request: dict) -> None:
    """In the forked child: take the request's environment, directory, files and argv, then run."""
    import random

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_TRUNC)):
        new = os.open(path, flags)
        os.dup2(new, fd)
        os.close(new)
    random.seed()  # a fresh interpreter's streams, not the server's
    import numpy as np

    np.random.seed()
    argv = request["argv"]
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        import runpy

        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


# -- the client ----------------------------------------------------------------------------------

class _Server:
    def __init__(self) -> None:
        from tests.cli_driver import child_env

        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=str(ROOT),
                                     env=child_env(OMP_NUM_THREADS="1"))
        said = self.proc.stdout.readline().strip()
        assert said == "ready", f"tests/zygote.py did not start: {said or self.proc.wait()}"
        self.folder = Path(tempfile.mkdtemp(prefix="pipenas-children-"))  # the children's output files
        self.names = itertools.count()
        self.lock = threading.Lock()
        self.changed = threading.Condition()
        self.started: list[int] = []
        self.codes: dict[int, int] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            word, pid, *rest = line.split()
            with self.changed:
                if word == "started":
                    self.started.append(int(pid))
                else:
                    self.codes[int(pid)] = int(rest[0])
                self.changed.notify_all()
        with self.changed:
            self.codes[-1] = -1  # the server is gone: nothing more will be reported
            self.changed.notify_all()

    def fork(self, request: dict) -> int:
        with self.lock:
            with self.changed:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
                while not self.started and -1 not in self.codes:
                    self.changed.wait()
                assert self.started, "tests/zygote.py stopped"
                return self.started.pop()

    def wait(self, pid: int, timeout: float | None) -> int | None:
        end = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            while pid not in self.codes:
                left = None if end is None else end - time.monotonic()
                if (left is not None and left <= 0) or -1 in self.codes:
                    return None
                self.changed.wait(left)
            return self.codes[pid]


_server: _Server | None = None
_server_lock = threading.Lock()


class Child:
    """A forked process, used as the tests use ``subprocess.Popen(..., stdout=PIPE, stderr=PIPE,
    text=True)``: ``pid``, ``args``, ``returncode``, ``poll``, ``wait``, ``communicate``, ``kill``."""

    def __init__(self, server: _Server, args: list[str], env: dict[str, str], cwd: str) -> None:
        self.args = [sys.executable, *args]
        self._server = server
        n = next(server.names)
        self._files = (server.folder / f"{n}.out", server.folder / f"{n}.err")
        for f in self._files:
            f.write_bytes(b"")
        self.pid = server.fork({"argv": args, "env": env, "cwd": cwd, "stdout": str(self._files[0]),
                                "stderr": str(self._files[1])})
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.wait(self.pid, timeout)
            if self.returncode is None and timeout != 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return tuple(f.read_text(errors="replace") for f in self._files)  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def launch(args: list[str], env: dict[str, str], cwd: str | Path) -> Child | subprocess.Popen:
    """``python <args>`` (a script's path or ``-c <code>`` first) with ``env`` in ``cwd``, output
    captured: forked from the server, or a fresh interpreter under ``PIPENAS_TEST_EXEC=1``."""
    global _server
    if os.environ.get("PIPENAS_TEST_EXEC") == "1":
        return subprocess.Popen([sys.executable, *args], env=env, cwd=str(cwd), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
    return Child(_server, list(args), dict(env), str(cwd))


def collect(procs: list, timeout_s: float) -> list[subprocess.CompletedProcess | None]:
    """Wait for ``procs`` (from :func:`launch`) within one deadline, ``timeout_s`` seconds from
    now. The first that does not finish in time gets None and every process still running is
    killed (the rest then give what they wrote, with their negative return codes); on any other
    way out, every process still running is killed too."""
    end = time.monotonic() + timeout_s
    done: list[subprocess.CompletedProcess | None] = []

    def kill_all() -> None:
        killed = [q for q in procs if q.poll() is None]
        for q in killed:
            q.kill()
        for q in killed:  # reaped: no zombie left behind, and poll() gives the signal
            try:
                q.wait(30)
            except subprocess.TimeoutExpired:
                pass

    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_all()
                done.append(None)
                continue
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        kill_all()
    return done


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    request = _serve()
    if request is not None:
        _become(request)
