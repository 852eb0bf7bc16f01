"""Transport errors: a peer that went away is named as the peer's failure, whether gloo reports
it at the wait or already when the send or receive is posted."""
import pytest
import torch
import torch.distributed as dist

from pipeline import transport as tr
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
