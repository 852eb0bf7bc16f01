"""Shared memory between the ranks on one host: the exact reduction's buffers and the doorbell a
stage's replicas signal each other through (:class:`SharedReduction`), and the board every rank
posts its agreement digests on (:class:`DigestBoard`).

gloo's loopback copies every message through the kernel on both sides, on the cores that
compute, and a message's wake-up passes gloo's own thread: 116 us a round trip on an idle
2-core machine, 0.2-0.3 ms a hop inside a loaded step (measured in the transformer w256's
data-parallel run), against 5 us for a counter in shared memory that the waiting side polls.
So when every replica of a stage runs here on the CPU, the gradients, the chain's losses, the
presence mask and the final batch-norm statistics all live in ``/dev/shm``, and a replica tells
the next how far it got by raising its counter on a shared page.

**Ordering.** A counter is raised (one aligned 8-byte store) only after the data it announces
is written, and a reader reads the data only after it saw the counter. x86-64 keeps stores in
order and loads in order (TSO), so that is enough there; other CPUs reorder them and Python has
no fence, so elsewhere :meth:`SharedReduction.open` declines (the gradients go over the wire).

**Counters.** Replica k's counter holds ``(n << 32) | v``: how far (``v``) it got in the n-th
reduction. Counters only grow, and a reader waits for ``>=``: a counter that has moved on to
a later reduction still says the earlier one is done.

**Liveness.** A waiting replica checks every 50 ms that its peer's process still runs (every
replica of the stage is on this host: the pids came with :meth:`SharedReduction.open`), and
gives up after the transport's timeout: a failed peer is a :class:`PeerError` naming its rank,
as a closed gloo connection is, never a hang.
"""
from __future__ import annotations

import atexit
import os
import platform
import socket
import time
import uuid
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .transport import PeerError

__all__ = ["DigestBoard", "SharedReduction", "supported"]

_SLOT = 8  # int64s per counter: one 64-byte cache line each (no false sharing between replicas)
_POLL_S = 0.05  # how often a waiting replica looks at its peer's process and the clock
_SPIN_S = 50e-6  # how long a waiting replica polls without a pause (a chunk's wait: its predecessor is at work)
_SLEEP_S = 20e-6  # then its pause between looks (the kernel's timer slack makes it ~70 us)


def supported() -> bool:
    """Whether this CPU keeps stores and loads in order (x86-64: see the module doc)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class SharedReduction:
    """One stage's shared buffers, doorbell and reduction count, on every replica of the stage.

    Buffers: two sets, one per parity of the reduction's count ``n``, each a flat buffer per
    dtype of the gradients plus one byte buffer for the messages (losses, mask, statistics). A
    replica writes set ``n % 2`` in reduction n only after every replica has finished reduction
    n - 1 (the chain's counters say so), and each replica is done with the gradients of reduction
    n - 2 (its update, which reads them in place) before it takes part in reduction n - 1: so a
    set is never rewritten while a replica still reads it. A set grows (a new file) when a
    subnet needs more than it holds; every replica sees the same parameters, so each decides
    alike. Replica 0 creates a file, the others map it once replica 0's counter says it exists
    (:meth:`begin`); replica 0 removes the name at the end of the reduction that made it (every
    replica mapped it by then: the mappings stay), so nothing is left behind."""

    def __init__(self, token: str, stage: int, replica: int, replicas: int, pids: Sequence[int] = (),
                 ranks: Sequence[int] = (), timeout_s: float = 300.0, bell: torch.Tensor | None = None) -> None:
        self.token, self.stage, self.replica, self.replicas = token, stage, replica, replicas
        self.first = replica == 0
        self.pids, self.ranks, self.timeout_s = tuple(pids), tuple(ranks), timeout_s
        self.count = 1  # the reduction under way (counters start at 0: nothing announced)
        self._bell_t = bell if bell is not None else torch.zeros(_SLOT * replicas, dtype=torch.int64)
        self._bell = self._bell_t.numpy()  # numpy: a read or an aligned store of one int64, no tensor made
        self._sets: dict[tuple[int, str], tuple[int, torch.Tensor]] = {}  # (parity, kind) -> (generation, buffer)
        self._made: list[str] = []  # files replica 0 created in this reduction
        atexit.register(self._remove)  # a reduction cut short (a peer failed) leaves no name behind

    @classmethod
    def open(cls, mesh, group: dist.ProcessGroup, device: torch.device, max_bytes: int,
             timeout_s: float) -> SharedReduction | None:
        """Collective over this stage's replicas (``mesh``: :class:`pipeline.replicas.Mesh`):
        shared buffers if every one runs on this host on the CPU, the CPU keeps memory order
        (:func:`supported`) and ``/dev/shm`` has room for two sets of ``max_bytes`` (every
        gradient of the supernet: no stage needs more), else None (the wire carries the
        gradients)."""
        ok = _usable(device)
        if ok:
            st = os.statvfs("/dev/shm")
            ok = st.f_bavail * st.f_frsize >= 2 * max_bytes + (64 << 20)
        got = _open_page(group, mesh.replica, mesh.replicas, ok, f"s{mesh.stage}-bell", "the gradient reduction's")
        if got is None:
            return None
        bell, token, pids = got
        return cls(token, mesh.stage, mesh.replica, mesh.replicas, pids, mesh.replica_ranks(), timeout_s, bell)

    # -- the buffers ---------------------------------------------------------------------------
    def begin(self, params: Sequence[nn.Parameter],
              message_bytes: int) -> tuple[dict[torch.dtype, torch.Tensor], torch.Tensor]:
        """This reduction's flat gradient buffers, one per dtype sized for ``params``, and its
        message buffer of ``message_bytes`` (views). Replica 0 creates what is missing and
        announces it (counter value 0); the others wait for that before they map."""
        if not self.first:
            self.wait(0, 0)
        parity = self.count % 2
        flats = {}
        for dt in dict.fromkeys(p.dtype for p in params):
            flats[dt] = self._buffer(parity, str(dt).replace("torch.", ""), dt,
                                     sum(p.numel() for p in params if p.dtype == dt))
        message = self._buffer(parity, "msg", torch.uint8, message_bytes)
        if self.first:
            self.post(0)
        return flats, message

    def end(self) -> None:
        """The reduction is over on this replica."""
        self.count += 1
        self._remove()  # every replica has mapped them by now

    def _buffer(self, parity: int, kind: str, dt: torch.dtype, n: int) -> torch.Tensor:
        gen, buf = self._sets.get((parity, kind), (-1, None))
        if buf is None or buf.numel() < n:
            gen += 1
            buf = self._map(f"/dev/shm/pipenas-{self.token}-s{self.stage}-p{parity}-{kind}-g{gen}", dt, max(n, 1))
            self._sets[(parity, kind)] = (gen, buf)
        return buf[:n]

    def _map(self, path: str, dt: torch.dtype, n: int) -> torch.Tensor:
        if self.first:
            _create(path, n * dt.itemsize)
            self._made.append(path)
        return torch.from_file(path, shared=True, size=n, dtype=dt)

    def _remove(self) -> None:
        made, self._made = self._made, []
        for path in made:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    # -- the doorbell --------------------------------------------------------------------------
    def post(self, value: int) -> None:
        """This replica got to ``value`` in this reduction (after the data that says so is written)."""
        self._bell[_SLOT * self.replica] = (self.count << 32) | value

    def wait(self, replica: int, value: int) -> None:
        """Until ``replica`` got to ``value`` in this reduction (or later)."""
        rank = self.ranks[replica] if self.ranks else replica
        _wait_for(self._bell, _SLOT * replica, (self.count << 32) | value,
                  self.pids[replica] if self.pids else None, rank, self.timeout_s, "reducing gradients with")


class DigestBoard:
    """Every rank's agreement digests (:class:`pipeline.agreement.Agreement`) on one page of
    shared memory, when every rank of the job runs on this host on the CPU (and the CPU keeps
    memory order: :func:`supported`). A rank posts round n's digest into its slot (one of two, by
    n's parity), then raises its round counter to n; a reader of round n waits until every
    counter reached n and reads every rank's digest. gloo's all-reduce cost each rank ~0.5 ms of
    CPU on gloo's threads and 0.2-0.5 ms on the main thread per training segment (measured on the
    2-core machine, data parallel on the default space); a post here is two stores.

    Rounds are read in order (a rank that posts with a round unread reads it first), so round n's
    slot is rewritten (in round n + 2) only by a rank that has read round n + 1: every rank had
    posted n + 1 by then, after reading round n. Counters only grow; a waiting rank checks its
    peers' processes and the timeout as :class:`SharedReduction` does."""

    def __init__(self, rank: int, world_size: int, pids: Sequence[int] = (), timeout_s: float = 300.0,
                 page: torch.Tensor | None = None) -> None:
        self.rank, self.world_size, self.pids, self.timeout_s = rank, world_size, tuple(pids), timeout_s
        self._page_t = page if page is not None else torch.zeros(_SLOT * world_size, dtype=torch.int64)
        self._page = self._page_t.numpy()
        self.posted = 0  # the last round this rank posted
        self.read_up_to = 0  # the last round this rank read
        self._values: dict[int, list[int]] = {}  # the rounds read, newest few (a round read early: see post)

    @classmethod
    def open(cls, group: dist.ProcessGroup, rank: int, world_size: int, device: torch.device,
             timeout_s: float) -> DigestBoard | None:
        """Collective over every rank (``group``: all of them): a board if every rank runs on
        this host on the CPU and the CPU keeps memory order, else None (gloo carries the check)."""
        got = _open_page(group, rank, world_size, _usable(device), "agreement", "the agreement board's")
        if got is None:
            return None
        page, _, pids = got
        return cls(rank, world_size, pids, timeout_s, page)

    def post(self, digest: int) -> int:
        """This rank's digest of the next round (a 63-bit int); returns the round."""
        if self.read_up_to < self.posted:
            self.read(self.posted)  # (rounds are read in order: see the class doc)
        n = self.posted + 1
        base = _SLOT * self.rank
        self._page[base + 1 + n % 2] = digest
        self._page[base] = n  # after the digest (TSO: readers see it there first)
        self.posted = n
        return n

    def read(self, n: int) -> list[int]:
        """Every rank's digest of round ``n`` (one this rank posted), in rank order: waits for
        the ranks that have not posted it yet, reading the rounds before it first."""
        if not 0 < n <= self.posted or n < self.read_up_to - 1:
            raise ValueError(f"DigestBoard.read: expected a round this rank posted and not long read "
                             f"({max(1, self.read_up_to - 1)}..{self.posted}), found {n}")
        while self.read_up_to < n:
            m = self.read_up_to + 1
            for r in range(self.world_size):
                _wait_for(self._page, _SLOT * r, m, self.pids[r] if self.pids else None, r, self.timeout_s,
                          "the agreement check with")
            self._values[m] = [int(self._page[_SLOT * r + 1 + m % 2]) for r in range(self.world_size)]
            self._values.pop(m - 2, None)
            self.read_up_to = m
        return self._values[n]


def _wait_for(words, i: int, target: int, pid: int | None, rank: int, timeout_s: float, what: str) -> None:
    """Until ``words[i] >= target``: poll, then sleep between looks (a long wait leaves the core to
    the other processes' threads); every :data:`_POLL_S` check that process ``pid`` (global rank
    ``rank``) still runs and the timeout: a :class:`PeerError` ``{what} rank {rank} failed``."""
    if words[i] >= target:
        return
    start = time.monotonic()
    check, spin_until = start + _POLL_S, start + _SPIN_S
    while words[i] < target:
        now = time.monotonic()
        if now >= spin_until:
            time.sleep(_SLEEP_S)
        if now >= check:
            check = now + _POLL_S
            if pid is not None and not _running(pid):
                raise PeerError(rank, what, "its process exited")
            if now - start > timeout_s:
                raise PeerError(rank, what, f"no answer within {timeout_s:g} s")


def _usable(device: torch.device) -> bool:
    """Whether this rank could share memory with the others: on the CPU, one that keeps memory
    order (:func:`supported`), with ``/dev/shm`` writable."""
    return device.type == "cpu" and supported() and os.access("/dev/shm", os.W_OK)


def _open_page(group: dist.ProcessGroup, rank: int, size: int, ok: bool, name: str,
               what: str) -> tuple[torch.Tensor, str, list[int]] | None:
    """Collective over ``group`` (``size`` ranks, this one its ``rank``): when every rank runs on
    this host (same host name and boot) and says ``ok``, a page of one :data:`_SLOT` of int64s per
    rank in ``/dev/shm`` that every rank maps (its name removed once all have mapped it), the
    job's token and every rank's pid; else None. ``what`` names the page in an error."""
    here = (socket.gethostname(), _boot_id(), ok, uuid.uuid4().hex, os.getpid())
    every: list = [None] * size
    dist.all_gather_object(every, here, group=group)
    if not all(e[:3] == every[0][:3] for e in every) or not every[0][2]:
        return None
    token = every[0][3]
    path, words = f"/dev/shm/pipenas-{token}-{name}", _SLOT * size
    if rank == 0:
        _create(path, words * 8, what)
    dist.barrier(group=group)
    page = torch.from_file(path, shared=True, size=words, dtype=torch.int64)
    dist.barrier(group=group)  # every rank has mapped it: the name can go
    if rank == 0:
        os.unlink(path)
    return page, token, [e[4] for e in every]


def _create(path: str, nbytes: int, what: str = "the gradient reduction's") -> None:
    """A new file of ``nbytes`` in /dev/shm, its pages reserved now: a full /dev/shm fails here,
    not with SIGBUS at a write (``what`` names the file in that error)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise RuntimeError(f"no room in /dev/shm for {what} {nbytes} bytes ({e}); run with "
                           "PIPENAS_REDUCE_SHM=0 to send it over the wire") from e
    os.close(fd)


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (not gone, not a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
