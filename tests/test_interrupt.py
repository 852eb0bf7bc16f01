"""Signals, injected faults and the stop vote, in one process (the CLI and torchrun: test_cli.py)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from pipeline.failures import Fault, inject, parse_fault
from pipeline.files import atomic_write_bytes, settle_writes
from pipeline.stop import StopVote
from search.interrupt import Interrupts, exit_status


def test_the_first_signal_is_recorded_and_handlers_are_restored(capsys: pytest.CaptureFixture) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with Interrupts() as intr:
        assert not intr.requested
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
        assert intr.requested and intr.name == "SIGTERM" and exit_status(intr.signum) == 143
    assert signal.getsignal(signal.SIGTERM) is before
    assert "SIGTERM: stopping after this step and saving a checkpoint" in capsys.readouterr().err
    assert exit_status(signal.SIGINT) == 130


def test_faults_parse_fire_in_their_attempt_and_say_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    faults = parse_fault("1:3:1F0:kill:0,0:10:checkpoint:raise")
    assert faults == (Fault(1, 3, "1F0", "kill", 0), Fault(0, 10, "checkpoint", "raise", None))
    assert parse_fault(None) == ()
    with pytest.raises(ValueError, match=r"PIPENAS_FAULT: expected <rank>:<step>:<action>:<raise\|kill\|interrupt\|"
                                         r"terminate>\[:<attempt>\], found '0:1:step:explode'"):
        parse_fault("0:1:step:explode")
    inject(faults, 0, 9, "checkpoint")  # not its step: nothing happens
    with pytest.raises(RuntimeError, match="injected fault"):
        inject(faults, 0, 10, "checkpoint")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    inject(parse_fault("0:10:checkpoint:raise:0"), 0, 10, "checkpoint")  # meant for the first attempt only


def test_one_process_stops_on_its_own_request() -> None:
    vote = StopVote(rank=0, world_size=1, timeout_s=1.0)
    vote.post(False)
    assert vote.result(True, step=3, where="step")  # no peers: asked now is the answer at once
    vote.post(True)
    assert not vote.result(False, step=4, where="step")


def test_settling_writes_completes_the_durable_and_drops_the_partial(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path, prev = tmp_path / "checkpoint.pt", tmp_path / "checkpoint.prev.pt"
    atomic_write_bytes(path, b"old")
    settled: list[list[Path]] = []

    class Exit(BaseException):  # what os._exit would do after settling: nothing of the write runs on
        pass

    def exit_now() -> None:
        settled.append(settle_writes())
        raise Exit

    with pytest.raises(Exit):  # between keeping the previous and renaming the new: the data is durable
        atomic_write_bytes(path, b"new", prev, on_durable=exit_now)
    assert settled == [[path]] and path.read_bytes() == b"new" and prev.read_bytes() == b"old"

    def fsync_then_exit(fd: int) -> None:  # before the data is durable
        settled.append(settle_writes())
        raise Exit

    monkeypatch.setattr(os, "fsync", fsync_then_exit)
    with pytest.raises(Exit):
        atomic_write_bytes(path, b"newer", prev)
    assert settled[-1] == [] and path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]  # no temporaries


def test_a_sigterm_right_after_the_first_signal_is_a_copy(capsys: pytest.CaptureFixture) -> None:
    # a scheduler signals every process of the job and torchrun passes its own on: two SIGTERMs
    with Interrupts(on_second=lambda *a: pytest.fail("exited on a copy of the first signal")) as intr:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert intr.name == "SIGTERM"
    assert capsys.readouterr().err.count("stopping after this step") == 1
