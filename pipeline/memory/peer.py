"""The peer tier at run time: a stage hands saved activations to its paired stage and gets them back (BPipe).

Stage ``s`` and stage ``P - 1 - s`` are a pair (:func:`pipeline.plan.pairs.pair_of`); the
earlier one *gives* (:class:`PeerClient`, driven by the saved-tensor hooks of
:mod:`supernet.activations`), the later one *holds* (:class:`PeerServer`, a thread that serves
its giver's requests while its own stage computes: a holder busy in its own schedule must still
answer, or the two would wait on each other). The middle stage of an odd ``P`` neither gives nor
holds. The tensors travel unchanged (dtype, shape and bytes), so a run with the tier equals one
without it, bit for bit.

Two process groups carry it, made by every rank alike (:func:`open_peer`): **control** (gloo,
always: fixed-size int64 headers on the CPU) and **data** (the payloads: gloo on a CPU, NCCL on
CUDA). A header says what follows:

======  ==============================  ==================================================
kind    giver sends                     holder does
======  ==============================  ==================================================
PUT     key, dtype, shape; then the     receives the payload into a fresh buffer on its
        payload on *data*               device and keeps it under ``key``
GET     key; then receives the payload  sends the payload back on *data* and forgets it
DROP    key (a handle died unfetched)   forgets it
CLOSE   (the giver's engine closes)     ends its thread
======  ==============================  ==================================================

Messages between a pair arrive in the order they were sent on each group, so the holder sees
every PUT before the GET of its key and answers GETs in order. The first unpack of a micro-batch
asks for all of that micro-batch's activations still away, unless the executor asked already
(:meth:`PeerClient.prefetch`, one action before that backward): they arrive while the action
before the backward, or its first ops, compute.

Waits. Every wait for something owed has the run's timeout (``pipeline.timeout_s``): a payload
after its header, a send's completion. On NCCL a receive is waited for on the stream (the host
does not block; NCCL's watchdog bounds it by the data group's timeout). The one open-ended wait
is the holder's wait for its giver's next header, which may be a whole evaluation away: it ends
with the giver's CLOSE, with an error when the giver's process goes (gloo reports the closed
connection at once), or with this process (the thread is a daemon).

CUDA: the holder's thread receives and sends on a stream of its own, so its stage's compute
stream never waits for its pair's copies; a buffer sent is kept until its send has completed
(freeing a source during an asynchronous copy corrupts it). Written for NCCL, run here on gloo.
"""
from __future__ import annotations

import datetime
import logging
import threading
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..plan.pairs import gives, pair_of
from ..transport import DTYPE_CODE, WIRE_DTYPES, PeerError, TransportError, peer_errors, wait_for
from .settings import MemorySettings

__all__ = ["PeerClient", "PeerServer", "PeerTier", "PeerHandle", "open_peer", "peer_needed"]

log = logging.getLogger(__name__)

_HEADER = 12  # kind, key, dtype code, ndim, up to 8 sizes
_MAX_DIMS = _HEADER - 4
PUT, GET, DROP, CLOSE = 1, 2, 3, 4
_IDLE = datetime.timedelta(days=7)  # the holder's wait for its giver's next header (module doc)


def peer_needed(memory: MemorySettings | None, num_stages: int, world_size: int) -> bool:
    """Whether a run can hand activations to paired stages: ``memory.activations=peer``, or
    ``auto`` with an activation budget (whose plans may choose it), on at least two stages in
    several processes."""
    if memory is None or num_stages < 2 or world_size < 2:
        return False
    return memory.activations == "peer" or (memory.activations == "auto" and memory.activation_budget_bytes is not None)


def sendable(t: torch.Tensor) -> bool:
    """Whether the tier can carry ``t`` (its dtype has a code and its shape fits a header)."""
    return t.dtype in DTYPE_CODE and t.dim() <= _MAX_DIMS


class PeerHandle:
    """What the pack hook leaves in autograd's graph for one saved tensor sent to the pair."""

    __slots__ = ("key", "shape", "dtype", "device", "group", "value", "_recv", "_client", "__weakref__")

    def __init__(self, client: PeerClient, key: int, t: torch.Tensor, group: object) -> None:
        self.key, self.shape, self.dtype, self.device, self.group = key, tuple(t.shape), t.dtype, t.device, group
        self.value: torch.Tensor | None = None  # once back (autograd may unpack a tensor twice)
        self._recv: tuple[dist.Work, torch.Tensor] | None = None  # asked for, not yet waited for
        self._client = weakref.ref(client)

    def __del__(self) -> None:  # noqa: D105
        if self.value is not None:
            return
        client = self._client()
        if client is None:
            return
        if self._recv is None:  # never asked for: the holder may forget it (told with the next request)
            client._dropped.append(self.key)
        else:  # asked for and never unpacked: its receive is waited for before the next request
            client._orphans.append(self._recv)


@dataclass
class _Groups:
    pair: int                 # the paired stage's global rank
    control: dist.ProcessGroup
    data: dist.ProcessGroup
    device: torch.device
    timeout: datetime.timedelta
    nccl: bool = field(init=False)
    me: int = field(init=False)  # this process's global rank (for log lines)

    def __post_init__(self) -> None:
        self.nccl = dist.get_backend(self.data) == "nccl"
        self.me = dist.get_rank()

    def post(self, fn: str, t: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
        with peer_errors("sending to" if fn == "isend" else "receiving from", self.pair):
            return getattr(dist, fn)(t, self.pair, group=group)

    def wait(self, work: dist.Work, what: str, timeout: datetime.timedelta | None = None,
             data: bool = False) -> None:
        """Wait for ``work`` within ``timeout`` (the run's); a data receive on NCCL is waited
        for on the current stream (module doc)."""
        if data and self.nccl:
            with peer_errors(what, self.pair):
                work.wait()
            return
        wait_for(work, self.timeout if timeout is None else timeout, what, self.pair)

    def header(self, kind: int, key: int = 0, t: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.zeros(_HEADER, dtype=torch.int64)
        h[0], h[1] = kind, key
        if t is not None:
            h[2], h[3] = DTYPE_CODE[t.dtype], t.dim()
            h[4:4 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        return h


class PeerClient:
    """The giving stage's side: ``put`` a saved tensor, ``get`` it back (blocking within the timeout)."""

    def __init__(self, groups: _Groups, max_pending: int = 64) -> None:
        self.g = groups
        self.max_pending = max_pending
        self._key = 0
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []  # sends in flight and their buffers
        self._groups: dict[object, list[weakref.ref[PeerHandle]]] = {}  # micro-batch -> its handles, put order
        self._dropped: list[int] = []  # keys of handles that died unfetched (appended from __del__)
        self._orphans: list[tuple[dist.Work, torch.Tensor]] = []  # receives of handles that died asked for
        self.sent_bytes = 0
        self.fetched_bytes = 0
        self.closed = False

    def put(self, t: torch.Tensor, group: object = None) -> PeerHandle | None:
        """Send ``t`` to the pair (returns at once; its buffer is kept until the send ends); None
        when the tier cannot carry it (:func:`sendable`: the caller keeps it)."""
        if not sendable(t):
            return None
        self._drop_dead()
        self._key += 1
        t = t.detach().contiguous()
        h = PeerHandle(self, self._key, t, group)
        self._send(self.g.header(PUT, h.key, t), self.g.control)
        self._send(t, self.g.data)
        self.sent_bytes += t.numel() * t.element_size()
        self._groups.setdefault(group, []).append(weakref.ref(h))
        if len(self._groups) > 256:  # micro-batches never run backward (none in training): forget them
            self._groups = {k: v for k, v in self._groups.items() if any(r() is not None for r in v)}
        return h

    def prefetch(self, group: object) -> None:
        """Ask for every activation of ``group`` (a micro-batch) still away, latest first (the
        order its backward needs them): the executor calls it one action before that backward,
        so they travel while that action computes."""
        self._drop_dead()
        self._ask_group(group)

    def get(self, h: PeerHandle) -> torch.Tensor:
        """``h``'s tensor, back from the pair (asked for with the rest of its micro-batch's,
        unless :meth:`prefetch` asked already)."""
        if h.value is not None:
            return h.value
        if h._recv is None:
            self._drop_dead()
            self._ask(h)
            self._ask_group(h.group)
        work, buf = h._recv
        self.g.wait(work, "receiving activations back from", data=True)
        h.value, h._recv = buf, None
        self.fetched_bytes += buf.numel() * buf.element_size()
        return buf

    def _ask_group(self, group: object) -> None:
        """Ask for every tensor of ``group`` not yet back or asked for, latest first."""
        for ref in reversed(self._groups.pop(group, [])):
            h = ref()
            if h is not None and h.value is None and h._recv is None:
                self._ask(h)

    def _ask(self, h: PeerHandle) -> None:
        self._send(self.g.header(GET, h.key), self.g.control)
        buf = torch.empty(h.shape, dtype=h.dtype, device=h.device)
        h._recv = (self.g.post("irecv", buf, self.g.data), buf)

    def _send(self, t: torch.Tensor, group: dist.ProcessGroup) -> None:
        self._pending.append((self.g.post("isend", t, group), t))
        if len(self._pending) > self.max_pending:
            # NCCL reports completed sends (their buffers may go); gloo's complete when waited for
            self._pending = [(w, b) for w, b in self._pending if not (self.g.nccl and w.is_completed())]
        while len(self._pending) > self.max_pending:
            work, _ = self._pending.pop(0)
            self.g.wait(work, "sending activations to")

    def _drop_dead(self) -> None:
        while self._dropped:
            self._send(self.g.header(DROP, self._dropped.pop()), self.g.control)
        while self._orphans:
            work, _ = self._orphans.pop()
            self.g.wait(work, "receiving activations back from", data=True)

    def flush(self) -> None:
        """Wait until every send has completed."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self.g.wait(work, "sending activations to")

    def close(self) -> None:
        """Tell the holder to end its thread, after every send has gone."""
        if self.closed:
            return
        self.closed = True
        self._drop_dead()
        self._send(self.g.header(CLOSE), self.g.control)
        self.flush()


class PeerServer:
    """The holding stage's side: a daemon thread keeping its giver's tensors until asked for them."""

    def __init__(self, groups: _Groups) -> None:
        self.g = groups
        self.store: dict[int, torch.Tensor] = {}
        self.held_bytes = 0
        self.peak_bytes = 0
        self.error: BaseException | None = None
        self.closed = False
        self._stream = torch.cuda.Stream(groups.device) if groups.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._serve, name=f"pipenas-peer-{groups.pair}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self.g.device)
        pending: list[tuple[dist.Work, torch.Tensor]] = []
        try:
            with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
                while True:
                    h = torch.empty(_HEADER, dtype=torch.int64)
                    self.g.wait(self.g.post("irecv", h, self.g.control), "waiting for a request from", _IDLE)
                    kind, key, code, ndim = (int(v) for v in h[:4])
                    if kind == CLOSE:
                        break
                    if kind == PUT:
                        buf = torch.empty([int(v) for v in h[4:4 + ndim]], dtype=WIRE_DTYPES[code], device=self.g.device)
                        self.g.wait(self.g.post("irecv", buf, self.g.data), "receiving activations from", data=True)
                        self.store[key] = buf
                        self.held_bytes += buf.numel() * buf.element_size()
                        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
                    elif kind in (GET, DROP):
                        buf = self.store.pop(key, None)
                        if buf is None:
                            raise TransportError(f"peer tier: rank {self.g.pair} asked for activations {key}, which "
                                                 "this rank does not hold")
                        self.held_bytes -= buf.numel() * buf.element_size()
                        if kind == GET:
                            pending.append((self.g.post("isend", buf, self.g.data), buf))
                    else:
                        raise TransportError(f"peer tier: unknown request {kind} from rank {self.g.pair}")
                    pending = self._reap(pending, block=len(pending) > 64)
                self._reap(pending, block=True)
        except BaseException as e:  # noqa: BLE001 - kept for close(); the giver sees the loss itself
            self.error = e
            log.debug("[rank %d] peer tier: serving rank %d ended: %s", self.g.me, self.g.pair, e)

    def _reap(self, pending: list, block: bool) -> list:
        """Sends still in flight (their buffers kept until they complete); ``block``: wait for them."""
        if block:
            for work, _ in pending:
                self.g.wait(work, "sending activations back to")
            return []
        return [(w, b) for w, b in pending if not w.is_completed()]

    def close(self, wait: bool = True) -> None:
        """Join the thread (it ends at its giver's CLOSE) within the timeout; raise its error.
        ``wait=False`` (after a failure): leave it, the process is ending."""
        if self.closed:
            return
        self.closed = True
        if not wait:
            return
        self._thread.join(self.g.timeout.total_seconds())
        if self._thread.is_alive():
            raise PeerError(self.g.pair, "waiting for the peer tier's close from", "no CLOSE within the timeout")
        if self.error is not None:
            raise PeerError(self.g.pair, "serving the peer tier for", self.error)


@dataclass
class PeerTier:
    """This rank's part of the tier: ``client`` (a giver), ``server`` (a holder) or neither."""

    client: PeerClient | None = None
    server: PeerServer | None = None

    def close(self, wait: bool = True) -> None:
        """Orderly end (``wait``): the giver sends CLOSE and its last sends complete, the holder's
        thread ends; after a failure nothing waits."""
        if self.client is not None and wait:
            self.client.close()
            log.info("[rank %d] peer tier: %.1f MiB of saved activations handed to rank %d and fetched back",
                     self.client.g.me, self.client.fetched_bytes / 2**20, self.client.g.pair)
        if self.server is not None:
            self.server.close(wait)
            if wait:
                log.info("[rank %d] peer tier: held up to %.1f MiB for rank %d", self.server.g.me,
                         self.server.peak_bytes / 2**20, self.server.g.pair)


def open_peer(stage: int, num_stages: int, global_rank: Callable[[int], int], device: torch.device,
              timeout_s: float) -> PeerTier:
    """Make the tier's two process groups (every rank calls this alike: a collective) and this
    rank's part: a :class:`PeerClient` on a giving stage, a :class:`PeerServer` on a holding one.
    ``global_rank``: a stage index of this pipeline -> its process's global rank."""
    timeout = datetime.timedelta(seconds=timeout_s)
    with peer_errors("making the peer tier's groups"):
        control = dist.new_group(backend="gloo", timeout=_IDLE)
        data = dist.new_group(timeout=timeout)
    pair = pair_of(stage, num_stages)
    if pair == stage:
        return PeerTier()
    groups = _Groups(global_rank(pair), control, data, device, timeout)
    if gives(stage, num_stages):
        return PeerTier(client=PeerClient(groups))
    return PeerTier(server=PeerServer(groups))
