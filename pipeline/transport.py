"""Point-to-point transport of tensor lists: payload-only for the schedule, self-describing for the rest.

**Payload only** (the schedule's activations and gradients): both sides know every tensor's
shape, dtype and ``None`` entries ahead (:mod:`pipeline.wire`), so a message is its buffers
alone. ``post_recv`` allocates the buffers and posts the receives at once (before the data is
needed, so it arrives while the stage computes); ``send_payload`` posts the sends and keeps
them alive, waiting only when more than ``max_pending`` are outstanding or at ``flush``. On
NCCL, whose point-to-point operations between a pair run in order on one stream, a receive
posted ahead goes in one batch with the sends posted beside it (``exchange``), as torch's
pipelining does, so neither side can wait on a receive queued in front of the send that
would answer it.

**Self-describing** (migration, gathers, evaluation, and plans whose shapes could not be
inferred): a message is a list of tensors (``None`` allowed: "no gradient flows here") plus optional
bytes of metadata. It travels as a fixed-size int64 header (count, dtypes, shapes, metadata
length, packing), an overflow header when the first is too small, the metadata bytes, and then
the payload: one contiguous buffer per tensor, each received into its own fresh allocation (so
a received activation is laid out exactly like one computed in place), or, packed, one flat
buffer per dtype (migration and gathers: fewer messages on a latency-bound link). Sends are
posted asynchronously and kept alive until ``flush``; once a header is in, all buffers of the
message are posted together; every wait has a timeout, so a dead peer never hangs a rank.
Messages between a pair of ranks in one direction arrive in the order they were sent, which is
what NCCL requires and what the schedules guarantee.
"""
from __future__ import annotations

import datetime
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .wire import TensorSpec

__all__ = ["Transport", "PostedRecv", "TransportError", "PeerError", "peer_errors", "wait_for", "WIRE_DTYPES", "DTYPE_CODE"]

_HEADER = 64
# the dtypes a message header can name, by code (the peer tier's headers use the same codes)
WIRE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
               torch.int16, torch.int8, torch.uint8, torch.bool)
DTYPE_CODE = {dt: i for i, dt in enumerate(WIRE_DTYPES)}


class TransportError(RuntimeError):
    """A message could not be sent or received."""


class PeerError(TransportError):
    """A peer did not answer in time or went away (``peer``: its global rank; ``None``: one of
    the ranks of a collective, which cannot say which)."""

    def __init__(self, peer: int | None, what: str, cause: BaseException | str) -> None:
        super().__init__(f"{what} rank {peer} failed: {cause}" if peer is not None else f"{what} failed: {cause}")
        self.peer = peer


@contextmanager
def peer_errors(what: str, peer: int | None = None) -> Iterator[None]:
    """Raise a ``RuntimeError`` from the block as the :class:`PeerError` ``{what} rank {peer}
    failed`` (``peer``: a global rank, or ``None`` for a collective). Gloo raises one when a
    peer's connection has closed, at posting as well as at the wait, and on a timeout; it is the
    peer's failure, not this rank's (no failure note, the root cause looked up)."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, TransportError):
            raise
        raise PeerError(peer, what, _short(e)) from e


def wait_for(work: dist.Work, timeout: datetime.timedelta, what: str, peer: int | None = None) -> None:
    """Wait for a collective's ``work``: a lost rank or no answer within ``timeout`` is the
    :class:`PeerError` ``{what} [rank {peer}] failed`` (see :func:`peer_errors`)."""
    with peer_errors(what, peer):
        ok = work.wait(timeout)
    if ok is False:
        raise PeerError(peer, what, f"no answer within {timeout.total_seconds():g} s")


class PostedRecv:
    """Buffers whose receives are posted; ``wait`` returns them once they have arrived."""

    def __init__(self, transport: Transport, src: int, out: list[torch.Tensor | None], works: list[dist.Work]) -> None:
        self._transport, self.src, self._out, self._works = transport, src, out, works

    def wait(self) -> list[torch.Tensor | None]:
        works, self._works = self._works, []
        for work in works:
            self._transport._wait(work, "receiving from", self.src)
        return self._out


class Transport:
    def __init__(self, rank: int, device: torch.device, timeout_s: float, group: dist.ProcessGroup | None = None,
                 max_pending: int = 64, peers: Sequence[int] | None = None) -> None:
        self.rank = rank
        self.group = group  # None: the default group; a separate group is a separate channel
        # ``peers``: the global rank of each peer index (the stages of one replica, or the
        # replicas of one stage, on a 2-D mesh); None: peer indices are global ranks
        self.peers = tuple(peers) if peers is not None else None
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.max_pending = max_pending
        self._pending: list[tuple[dist.Work, int, torch.Tensor]] = []
        # NCCL runs a pair's point-to-point operations in order on one stream: batch them
        self.batched = dist.is_initialized() and dist.get_backend(group) == "nccl"

    def global_rank(self, peer: int) -> int:
        """The global rank of peer index ``peer`` (what torch.distributed addresses)."""
        return self.peers[peer] if self.peers is not None else peer

    # -- payload only ----------------------------------------------------------------------
    def post_recv(self, src: int, specs: Sequence[TensorSpec | None]) -> PostedRecv:
        """Allocate one buffer per tensor of ``specs`` and post its receive now."""
        return self.exchange((), (src, specs))

    def send_payload(self, tensors: Sequence[torch.Tensor | None], dst: int) -> None:
        """Post the sends of ``tensors`` (``None`` entries carry nothing) without waiting."""
        self.exchange(((tensors, dst),), None)

    def exchange(self, sends: Sequence[tuple[Sequence[torch.Tensor | None], int]],
                 recv: tuple[int, Sequence[TensorSpec | None]] | None) -> PostedRecv | None:
        """Post payload sends and (optionally) one payload receive together: one batch on NCCL,
        one after another on gloo. Returns the receive's handle."""
        ops: list[tuple[str, torch.Tensor, int]] = []  # ("isend" or "irecv", tensor, peer)
        buffers: list[tuple[torch.Tensor, int]] = []
        for tensors, dst in sends:
            for t in tensors:
                if t is not None:
                    t = t.detach().contiguous()
                    ops.append(("isend", t, dst))
                    buffers.append((t, dst))
        out: list[torch.Tensor | None] = []
        n_sends = len(ops)
        if recv is not None:
            src, specs = recv
            for sp in specs:
                buf = None if sp is None else torch.empty(sp.shape, dtype=sp.dtype, device=self.device)
                out.append(buf)
                if buf is not None:
                    ops.append(("irecv", buf, src))
        g = self.global_rank
        if self.batched and ops:
            with peer_errors("exchanging with", g(ops[0][2])):
                works = dist.batch_isend_irecv([dist.P2POp(getattr(dist, fn), t, g(peer), group=self.group)
                                                for fn, t, peer in ops])
        else:
            works = [self._post(fn, t, peer) for fn, t, peer in ops]
        for work, (buf, dst) in zip(works[:n_sends], buffers):
            self._pending.append((work, dst, buf))
        while len(self._pending) > self.max_pending:  # bounded: wait for the oldest
            work, dst, _ = self._pending.pop(0)
            self._wait(work, "sending to", dst)
        return PostedRecv(self, recv[0], out, list(works[n_sends:])) if recv is not None else None

    # -- sending ---------------------------------------------------------------------------
    def send(self, tensors: Sequence[torch.Tensor | None], dst: int, meta: bytes = b"", pack: bool = False) -> int:
        """Post a message to ``dst`` without waiting; returns the payload bytes.

        ``pack=True`` sends all tensors of one dtype as one flat buffer (fewer messages: for
        migration and gathers, whose receiver copies the tensors anyway); otherwise each tensor
        travels, and arrives, as its own buffer.
        """
        words = [len(tensors), len(meta), int(pack)]
        bufs: list[torch.Tensor] = []
        for t in tensors:
            if t is None:
                words.append(-1)
                continue
            if t.dtype not in DTYPE_CODE:
                raise TransportError(f"cannot send dtype {t.dtype}; supported: {list(WIRE_DTYPES)}")
            words += [DTYPE_CODE[t.dtype], t.dim(), *t.shape]
            bufs.append(t.detach().to(self.device).contiguous())  # state exported from host memory: to the wire's device (NCCL)
        if pack:
            bufs = [torch.cat([b.reshape(-1) for b in bufs if b.dtype == dt]) for dt in _dtypes_in_order(bufs)]
        header = torch.zeros(_HEADER, dtype=torch.int64)
        total = len(words) + 1
        header[0] = total
        first = words[: _HEADER - 1]
        header[1 : 1 + len(first)] = torch.tensor(first, dtype=torch.int64)
        msgs = [header]
        if total > _HEADER:
            msgs.append(torch.tensor(words[_HEADER - 1 :], dtype=torch.int64))
        if meta:
            msgs.append(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        msgs = [m.to(self.device) for m in msgs] + bufs
        for m in msgs:
            self._pending.append((self._post("isend", m, dst), dst, m))
        return sum(b.numel() * b.element_size() for b in bufs)

    def send_state(self, op_id: str, state: Mapping[str, torch.Tensor], dst: int) -> int:
        """Post one op's flat state (named tensors), packed; returns the payload bytes."""
        keys = sorted(state)
        return self.send([state[k] for k in keys], dst, json.dumps([op_id, keys]).encode(), pack=True)

    def recv_state(self, op_id: str, src: int) -> dict[str, torch.Tensor]:
        """Receive the flat state of ``op_id`` from ``src``; another op arriving is an error
        (both sides must walk their moves in the same order)."""
        tensors, meta = self.recv(src)
        got, keys = json.loads(meta)
        if got != op_id:
            raise TransportError(f"op state out of order from rank {src}: expected {op_id!r}, received {got!r}")
        return dict(zip(keys, tensors))

    def flush(self) -> None:
        """Wait until every posted send has completed (its buffers may then be reused)."""
        pending, self._pending = self._pending, []
        for work, dst, _buffer in pending:
            self._wait(work, "sending to", dst)

    # -- receiving -------------------------------------------------------------------------
    def recv(self, src: int) -> tuple[list[torch.Tensor | None], bytes]:
        """Receive one message from ``src`` (blocks up to the timeout). Once the header is in,
        every buffer of the message is posted at once and then waited for."""
        header = self._recv_now(torch.empty(_HEADER, dtype=torch.int64, device=self.device), src).cpu().tolist()
        total = header[0]
        words = header[1:total] if total <= _HEADER else header[1:]
        if total > _HEADER:
            more = self._recv_now(torch.empty(total - _HEADER, dtype=torch.int64, device=self.device), src)
            words += more.cpu().tolist()
        count, meta_len, packed = words[0], words[1], bool(words[2])
        specs: list[tuple[torch.dtype, list[int]] | None] = []
        i = 3
        for _ in range(count):
            if words[i] == -1:
                specs.append(None)
                i += 1
                continue
            ndim = words[i + 1]
            specs.append((WIRE_DTYPES[words[i]], words[i + 2 : i + 2 + ndim]))
            i += 2 + ndim
        posted: list[tuple[dist.Work, torch.Tensor]] = []

        def post(buf: torch.Tensor) -> torch.Tensor:
            posted.append((self._post("irecv", buf, src), buf))
            return buf

        meta_buf = post(torch.empty(meta_len, dtype=torch.uint8, device=self.device)) if meta_len else None
        if packed:
            real = [sp for sp in specs if sp is not None]
            flats = {dt: post(torch.empty(sum(math.prod(sh) for d, sh in real if d == dt), dtype=dt, device=self.device))
                     for dt in _dtypes_in_order([torch.empty(0, dtype=d) for d, _ in real])}
            offsets = dict.fromkeys(flats, 0)
            out: list[torch.Tensor | None] = []
            for sp in specs:
                if sp is None:
                    out.append(None)
                    continue
                dt, shape = sp
                n = math.prod(shape)
                out.append(flats[dt][offsets[dt] : offsets[dt] + n].view(shape))
                offsets[dt] += n
        else:
            out = [None if sp is None else post(torch.empty(sp[1], dtype=sp[0], device=self.device)) for sp in specs]
        for work, _buf in posted:
            self._wait(work, "receiving from", src)
        meta = bytes(meta_buf.cpu().numpy()) if meta_buf is not None else b""
        return out, meta

    def _recv_now(self, buf: torch.Tensor, src: int) -> torch.Tensor:
        self._wait(self._post("irecv", buf, src), "receiving from", src)
        return buf

    def _post(self, fn: str, tensor: torch.Tensor, peer: int) -> dist.Work:
        """Post one ``dist.isend`` or ``dist.irecv``. Gloo raises at posting, not only at the
        wait, once the peer's connection has closed: that is the peer's failure, not this rank's."""
        rank = self.global_rank(peer)
        with peer_errors("sending to" if fn == "isend" else "receiving from", rank):
            return getattr(dist, fn)(tensor, rank, group=self.group)

    def _wait(self, work: dist.Work, what: str, peer: int) -> None:
        try:
            ok = work.wait(self.timeout)
        except Exception as e:  # gloo raises on timeout and on a closed connection
            raise PeerError(self.global_rank(peer), what, _short(e)) from e
        if ok is False:
            raise PeerError(self.global_rank(peer), what, f"no answer within {self.timeout.total_seconds():g} s")


def _dtypes_in_order(tensors: Sequence[torch.Tensor]) -> list[torch.dtype]:
    return list(dict.fromkeys(t.dtype for t in tensors))


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
