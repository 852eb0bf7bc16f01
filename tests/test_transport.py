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
