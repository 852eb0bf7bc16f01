"""Transport errors: a peer that went away is named as the peer's failure, whether gloo reports
it at the wait or already when the send or receive is posted, and whether the call is a
point-to-point message or a collective (the agreement check)."""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeline import agreement as ag
from pipeline import transport as tr
from pipeline.failures import FailureReporter, StageFailure
from pipeline.plan.schedule import one_f_one_b
from pipeline.transport import PeerError, Transport
from pipeline.wire import TensorSpec

CLOSED = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:36786. GLHF!\nmore"


@pytest.fixture
def closed(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args, **_kwargs):
        raise RuntimeError(CLOSED)
    monkeypatch.setattr(tr.dist, "isend", refuse)
    monkeypatch.setattr(tr.dist, "irecv", refuse)


@pytest.mark.parametrize("call, what", [
    (lambda t: t.send_payload([torch.ones(2)], 1), "sending to"),
    (lambda t: t.post_recv(1, [TensorSpec((2,), torch.float32)]), "receiving from"),
    (lambda t: t.send([torch.ones(2)], 1, b"meta"), "sending to"),
    (lambda t: t.recv(1), "receiving from"),
])
def test_a_closed_connection_at_posting_is_the_peers_failure(closed: None, call, what: str) -> None:
    transport = Transport(0, torch.device("cpu"), timeout_s=1.0, peers=[4, 7])
    with pytest.raises(PeerError) as info:
        call(transport)
    assert info.value.peer == 7  # the peer's global rank
    assert str(info.value) == f"{what} rank 7 failed: {CLOSED.splitlines()[0]}"
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_wait_that_times_out_names_the_peer_and_the_timeout() -> None:
    class Late:
        def wait(self, timeout):
            return False
    transport = Transport(0, torch.device("cpu"), timeout_s=2.5)
    with pytest.raises(PeerError, match=r"^receiving from rank 3 failed: no answer within 2.5 s$"):
        transport._wait(Late(), "receiving from", 3)
    assert not dist.is_initialized()


class _Plan:
    digest = 12345


@pytest.mark.parametrize("call", ["check", "post", "read"])
def test_a_lost_rank_in_the_agreement_check_is_a_peers_failure(monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    class Closed:
        def wait(self, timeout):
            raise RuntimeError(CLOSED)

    def all_reduce(t, op=None, group=None, async_op=False):
        if call == "read":
            return Closed()
        raise RuntimeError(CLOSED)
    monkeypatch.setattr(ag.dist, "all_reduce", all_reduce)
    agreement = ag.Agreement(torch.device("cpu"), 1.0, enabled=True, group=object())
    with pytest.raises(PeerError) as info:
        if call == "check":
            agreement.check(_Plan().digest, "a plan", None)
        else:
            agreement.post(_Plan().digest, "a plan")
            agreement.read()
    assert info.value.peer is None
    assert str(info.value) == f"the agreement check with the other ranks failed: {CLOSED.splitlines()[0]}"


def _boards(n: int, pids=None, timeout_s: float = 5.0) -> list:
    """``n`` ranks' digest boards over one page (one process stands in for every rank)."""
    import os

    from pipeline.shm import DigestBoard

    page = torch.zeros(8 * n, dtype=torch.int64)
    return [DigestBoard(r, n, pids or [os.getpid()] * n, timeout_s, page) for r in range(n)]


def test_the_digest_board_gives_every_rank_every_digest_round_by_round() -> None:
    """:class:`pipeline.shm.DigestBoard`: round n's digests stay readable while a rank goes on
    to post round n + 1 (two slots by parity); a rank that posts with a round unread reads it
    first, so no slot is rewritten before every rank read it; a round read early is kept."""
    a, b, c = _boards(3)
    assert [x.post(d) for x, d in ((a, 11), (b, 11), (c, 12))] == [1, 1, 1]
    assert a.read(1) == b.read(1) == [11, 11, 12]
    assert a.post(21) == 2 and b.post(22) == 2
    assert c.post(23) == 2 and c.read_up_to == 1  # c read round 1 before posting round 2
    assert c.read(1) == [11, 11, 12] and c.read(2) == [21, 22, 23]
    assert a.post(31) == 3 and a.read_up_to == 2  # round 2 read on the way: round 3 overwrites round 1's slot
    assert a.read(2) == [21, 22, 23]
    with pytest.raises(ValueError, match=r"expected a round this rank posted .* found 4"):
        a.read(4)


def test_the_digest_board_names_a_lost_or_silent_rank() -> None:
    import os
    import subprocess
    import sys
    import time

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    a, b = _boards(2, pids=[os.getpid(), int(gone.stdout)], timeout_s=0.3)
    a.post(5)
    with pytest.raises(PeerError, match=r"^the agreement check with rank 1 failed: its process exited$"):
        a.read(1)
    a, b = _boards(2, timeout_s=0.3)
    a.post(5)
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=r"^the agreement check with rank 1 failed: no answer within 0.3 s$"):
        a.read(1)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("same", [True, False])
def test_the_agreement_over_the_board_decides_as_the_all_reduce_does(same: bool) -> None:
    """With a board every rank reads every digest: all agree, or every rank sees the
    disagreement (a read with ``strict`` false returns None on each; a check raises)."""
    boards = _boards(2)
    ranks = [ag.Agreement(torch.device("cpu"), 5.0, enabled=True, group=object(), board=bd) for bd in boards]
    digests = [7, 7 if same else 8]
    for r, d in zip(ranks, digests):
        r.post(d, "a plan")
    assert [r.read(strict=False) for r in ranks] == (digests if same else [None, None])
    boards[0].post(digests[0])  # rank 0's side of a check (one process: it cannot wait for rank 1 here)
    if same:
        ranks[1].check(digests[1], "a plan")
    else:
        with pytest.raises(ag.AgreementError, match="ranks disagree on a plan"):
            ranks[1].check(digests[1], "a plan")
    assert ranks[1].round_trips == 1


def test_a_peers_failure_leaves_no_note_and_quotes_the_root_cause(tmp_path: Path) -> None:
    """A rank's own error leaves a note naming it; a rank that lost its peer leaves none (it
    would name the wrong rank) and quotes the note of the rank that failed."""
    schedule = one_f_one_b(2, 2)
    failed, survivor = (FailureReporter(r, schedule, tmp_path) for r in (1, 0))
    with pytest.raises(StageFailure):
        with failed.failing(3, "1B1"):
            raise ValueError("bad input")
    with pytest.raises(StageFailure) as info:
        with survivor.failing(3, "0F1"):
            with tr.peer_errors("receiving from", 1):
                raise RuntimeError(CLOSED)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1.json"]
    assert str(info.value).startswith(f"rank 0 (stage 0) failed at step 3 during 0F1: PeerError: receiving from "
                                      f"rank 1 failed: {CLOSED.splitlines()[0]}\n  root cause: rank 1 failed at "
                                      f"step 3 during 1B1: ValueError: bad input")
