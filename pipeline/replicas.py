"""Replicated stages: the 2-D process mesh (replica x stage) and the exact gradient reduction.

**Layout.** World size N = S x R. Rank ``r`` is stage ``r % S`` of replica ``r // S``: the
ranks of one replica's pipeline are consecutive (``torchrun`` puts them on one node, where the
schedule's many small messages go), and the ranks of one stage are ``S`` apart (the gradient
reduction, one message per update, may cross nodes). Each replica has its own channels
(migration and gathers, the schedule's messages, moves made ahead); each stage has one replica
channel (the reduction, the loss gather).

**Micro-batches.** Every replica runs the same plans and schedule on its own share of the
step's M micro-batches: replica k runs micro-batches k*M/R .. (k+1)*M/R - 1, so its schedule
has M/R micro-batches, and each micro-batch keeps its global index wherever it runs (its
dropout masks and its loss are those of the reference).

**Exact reduction (bit-identical to one process).** The reference accumulates an op's
micro-batch gradients in ascending order, ``((g0 + g1) + g2) + g3``, an in-place float add per
micro-batch. Replica 0 accumulates its micro-batches as usual: its ``.grad`` is that chain's
first partial. Replicas k > 0 keep each micro-batch's contribution apart (a post-accumulate
hook takes ``.grad`` and clears it, so every backward starts from ``None``). Before the update
the partial travels along the replica chain 0 -> 1 -> ... -> R-1: replica k receives the partial
of micro-batches < k*M/R and adds its own contributions to it one by one, in order, exactly as
the reference's ``+=`` does; the last replica sends the final sum back to every other. Batch-norm
running statistics are a chain too (each micro-batch's forward updates them): replicas k > 0
record each batch-norm input of the step and replay the update on the running statistics they
receive, with the kernel the forward uses. The statistics are final once a replica's last
forward of the subnet has run, so they take a channel of their own and leave early: replica 0
sends them right after that forward (:meth:`ReplicaReducer.forwards_done`; subnets' last forwards
may come in another order than their updates, so each update takes its own subnet's message),
and a replica k > 0 replays them while the gradients' partial is still on its way (before, the replay ran after the
partial arrived, on the chain's critical path: 1.1 ms of the default space's ~20 ms
data-parallel step). Cost: R - 1 hops in sequence plus one fan-out, per update, of the stage's
gradients; a replica's contributions are kept until then (M/R copies of the gradients of its
stage's ops). Every replica reduces the same modules, so a hop's message is payload only (a
presence mask, then flat buffers per dtype), its receives posted at once.

**Same host, shared memory.** When every replica of a stage runs on one host on the CPU (and
the CPU keeps memory order: x86-64), the whole chain runs in ``/dev/shm``
(:class:`pipeline.shm.SharedReduction`): replica 0 writes its partial there chunk by chunk (about
1 MB each), replica k > 0 adds its contributions to a chunk in place as soon as its
predecessor's counter on a shared page says the chunk is done, while the predecessor goes on
with the next; the losses, the presence mask and the final statistics lie beside the
gradients. No message and no copy out: every replica steps with the sum where it lies (its
``.grad`` are views of the shared buffers until :meth:`ReplicaReducer.released`, after the
update; nothing may scale them in place, which is why clipping makes a scaled copy). Clipping in
a pipeline folds a subnet at its last backward, ahead of its update, and another subnet's fold
may come before that update: there :meth:`ReplicaReducer.own` copies the sum out at once. gloo's
loopback copied every message through the kernel on both sides, on the cores that compute, and
each hop's wake-up cost 0.2-0.3 ms inside a loaded step: the transformer w256's data-parallel
step spent 9.7 ms in the reduction with the gradients on the wire, 3.5 ms with them in shared
memory and the chain's messages on gloo, 1.8-2.8 ms now.

**Fast mode** (``pipeline.reduce: fast``): every replica accumulates its own micro-batches and
one all-reduce (per dtype) sums the replicas' partials in the backend's order. Not
bit-identical to one process (float addition is regrouped: ``(g0 + g1) + (g2 + g3)`` and the
ring's chunk order), but every replica receives the same bytes, so replicas never drift apart;
batch-norm statistics still take the exact chain (small). One collective instead of R - 1 hops.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .layout import LayoutError, replicas_of
from .shm import SharedReduction
from .transport import PostedRecv, Transport, peer_errors, wait_for
from .wire import TensorSpec

__all__ = ["Mesh", "MeshError", "ReplicaReducer", "new_group_per"]


MeshError = LayoutError  # the world size, ``pipeline.stages`` and ``train.microbatches`` do not fit a mesh


@dataclass(frozen=True)
class Mesh:
    """Where rank ``rank`` sits on the (replica, stage) mesh of ``stages`` x ``replicas`` ranks."""

    rank: int
    stages: int
    replicas: int

    @classmethod
    def of(cls, rank: int, world_size: int, stages: int, microbatches: int) -> Mesh:
        return cls(rank, stages, replicas_of(world_size, stages, microbatches))

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def replica(self) -> int:
        return self.rank // self.stages

    def stage_ranks(self, replica: int | None = None) -> tuple[int, ...]:
        """The global ranks of one replica's pipeline, by stage (default: this rank's replica)."""
        k = self.replica if replica is None else replica
        return tuple(k * self.stages + s for s in range(self.stages))

    def replica_ranks(self, stage: int | None = None) -> tuple[int, ...]:
        """The global ranks holding one stage, by replica (default: this rank's stage)."""
        s = self.stage if stage is None else stage
        return tuple(k * self.stages + s for k in range(self.replicas))

    def microbatches(self, total: int) -> range:
        """The global indices of the micro-batches this replica runs."""
        per = total // self.replicas
        return range(self.replica * per, (self.replica + 1) * per)


def new_group_per(mesh: Mesh, dim: str) -> dist.ProcessGroup:
    """A new channel along ``dim`` ("stage": this replica's pipeline; "replica": this stage's
    replicas). Collective: every rank creates every group, in the same order."""
    mine = None
    n = mesh.replicas if dim == "stage" else mesh.stages
    for i in range(n):
        ranks = mesh.stage_ranks(i) if dim == "stage" else mesh.replica_ranks(i)
        group = dist.new_group(list(ranks))
        if (mesh.replica if dim == "stage" else mesh.stage) == i:
            mine = group
    return mine


class ReplicaReducer:
    """The exact reduction of one stage's gradients (and batch-norm statistics) across replicas."""

    def __init__(self, mesh: Mesh, transport: Transport, group: dist.ProcessGroup, bn_transport: Transport,
                 mode: str = "exact", shared_memory: bool = False, shm_bytes: int = 0) -> None:
        self.mesh, self.transport, self.group = mesh, transport, group
        # the gradients' flat buffers in this host's shared memory, when every replica of this
        # stage runs here on the CPU (the wire then carries the masks, losses and statistics);
        # ``shm_bytes``: every gradient of the supernet (no stage needs more), what /dev/shm must
        # have room for twice
        self.shm = (SharedReduction.open(mesh, group, transport.device, shm_bytes, transport.timeout.total_seconds())
                    if shared_memory else None)
        self._lent: list[nn.Parameter] = []  # parameters whose .grad are views of the shared buffers
        # forwards_done's walks, until reduce takes them (bounded: subnets in flight are fewer)
        self._found: deque[tuple[tuple[nn.Module, ...], list[_BatchNorm]]] = deque(maxlen=16)
        # the batch-norm statistics' own channel (another group of the same ranks: its messages
        # leave at a subnet's last forward, the gradients' at its update, so the two interleave
        # differently with several subnets in flight)
        self.bn_transport = bn_transport
        # by subnet (its batch norms' key): replica 0's statistics already sent; replica 1's receives
        # of them, posted (subnets in flight together run distinct modules: a key names one subnet)
        self._bn_out: set[tuple[int, ...]] = set()
        self._bn_in: dict[tuple[int, ...], PostedRecv] = {}
        self.fast = mode == "fast"  # gradients by one all-reduce (not bit-identical); see the module doc
        self.first = mesh.replica == 0
        self.recording = False  # training forwards and backwards only (not evaluation)
        self._contrib: dict[int, tuple[nn.Parameter, list[torch.Tensor]]] = {}
        self._bn_inputs: dict[int, tuple[_BatchNorm, list[torch.Tensor]]] = {}
        self.reduce_s = 0.0  # time in the reduction since the last read (benchmarks)

    # -- recording (replicas k > 0) ---------------------------------------------------------
    def watch(self, module: nn.Module) -> nn.Module:
        """Hook ``module`` (once) so a replica k > 0 keeps each micro-batch's contribution apart."""
        if self.first or getattr(module, "_pipenas_replica_watched", False):
            return module
        module._pipenas_replica_watched = True
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._take_grad)
        for m in module.modules():
            if isinstance(m, _BatchNorm) and m.track_running_stats:
                m.register_forward_pre_hook(self._take_input)
        return module

    def watching(self, module_of: Callable[[str], nn.Module]) -> Callable[[str], nn.Module]:
        return lambda op: self.watch(module_of(op))

    def _take_grad(self, p: nn.Parameter) -> None:
        if self.recording and not self.fast and p.grad is not None:
            self._contrib.setdefault(id(p), (p, []))[1].append(p.grad)
            p.grad = None  # the next micro-batch's backward starts from None: its contribution alone

    def _take_input(self, bn: _BatchNorm, args: tuple) -> None:
        if self.recording and bn.training:
            self._bn_inputs.setdefault(id(bn), (bn, []))[1].append(args[0].detach())

    # -- the batch-norm chain ----------------------------------------------------------------
    def forwards_done(self, modules: Sequence[nn.Module]) -> None:
        """After this stage's last training forward of a subnet (``modules``: the ops it will
        update, as :meth:`reduce` gets them): replica 0's batch-norm statistics are final now and
        go to replica 1, which posts their receive now. Every replica runs the same schedule, so
        the channel's sends and receives come in the same order: that of the subnets' last
        forwards here, which need not be that of their updates (a subnet may finish its forwards
        while an earlier one still waits for an op, and update after it: the updates of an op
        shared by both come in subnet order), so an update takes its own subnet's message, by key.
        Replicas further down receive at the update, in update order, which is when their
        predecessor sends."""
        bns = _bns(modules)
        self._found.append((tuple(modules), bns))  # (for :meth:`reduce`: one walk of the modules a subnet)
        if not bns:
            return
        if self.first:
            self.bn_transport.send_payload(_pack([], [], bns), 1)
            self._bn_out.add(_key(bns))
        elif self.mesh.replica == 1:
            self._bn_in[_key(bns)] = self.bn_transport.post_recv(0, _message_specs([], bns))

    def _bns_of(self, modules: Sequence[nn.Module]) -> list[_BatchNorm]:
        """The batch norms of ``modules``: those :meth:`forwards_done` found for the same modules
        (the same objects, held until now), else walked again."""
        for i, (held, bns) in enumerate(self._found):
            if len(held) == len(modules) and all(a is b for a, b in zip(held, modules)):
                del self._found[i]
                return bns
        return _bns(modules)

    def _chain_bn(self, bns: Sequence[_BatchNorm]) -> None:
        """This replica's link of the batch-norm chain, before the gradients': replica 0 sends
        its statistics (unless :meth:`forwards_done` did); a replica k > 0 takes its
        predecessor's, replays its own micro-batches' updates on them and passes them on."""
        if not bns:
            return
        k, key = self.mesh.replica, _key(bns)
        if self.first:
            if key in self._bn_out:
                self._bn_out.discard(key)
            else:  # no forwards_done call: send them now
                self.bn_transport.send_payload(_pack([], [], bns), 1)
            return
        posted = self._bn_in.pop(key, None)
        if posted is None:  # replicas past the first, or no forwards_done call: receive now
            posted = self.bn_transport.post_recv(k - 1, _message_specs([], bns))
        _set_bn(bns, _unpack(posted.wait(), [], bns)[1])
        self._replay(bns)
        if k < self.mesh.replicas - 1:
            self.bn_transport.send_payload(_pack([], [], bns), k + 1)

    def _replay(self, bns: Sequence[_BatchNorm]) -> None:
        for bn in bns:
            for x in self._bn_inputs.pop(id(bn), (bn, []))[1]:
                _replay_bn(bn, x)

    # -- the reduction ----------------------------------------------------------------------
    def reduce(self, modules: Sequence[nn.Module], losses: Sequence[float] | None = None) -> tuple[float, ...] | None:
        """Replace every parameter's ``.grad`` of ``modules`` (this stage's updated ops, in the
        same order on every replica) by the sum over all M micro-batches, folded in micro-batch
        order, and the batch-norm running statistics by those after all M micro-batches.
        ``losses``: this replica's micro-batch losses, carried along the chain (exact mode):
        every replica's, in global micro-batch order, are returned."""
        t0 = time.perf_counter()
        params = [p for m in modules for p in m.parameters() if p.requires_grad]
        bns = self._bns_of(modules)
        self._chain_bn(bns)  # on its own channel, ahead of the gradients (their hops carry none)
        if self.fast:  # every replica accumulated its own micro-batches; the chain carries the statistics only
            for p, g in zip(params, self._all_reduce(params)):
                p.grad = g
            params = []
            if not bns and losses is None:
                self.reduce_s += time.perf_counter() - t0
                return None
        k, last, tr = self.mesh.replica, self.mesh.replicas - 1, self.transport
        dev = tr.device
        # Every replica reduces the same modules, so each knows the message's layout ahead: the
        # message is its payload alone (a presence mask, one flat buffer per dtype of gradients
        # and of batch-norm statistics, the losses so far), every receive posted at once.
        # Self-describing messages cost a header, its overflow and the buffers, one wait each (on
        # a loaded 2-core machine a wait can cost a scheduler tick): the default space's
        # data-parallel step spent 11-14 of 33 ms here with one message per tensor, 4-6 now.
        per = len(losses) if losses is not None else 0

        def specs(replicas_before: int, with_bns: Sequence[_BatchNorm]) -> list[TensorSpec]:
            head = [TensorSpec((replicas_before * per,), torch.float64)] if losses is not None else []
            return head + _message_specs(params, with_bns)

        mine = torch.tensor(list(losses), dtype=torch.float64, device=dev) if losses is not None else None
        if self.shm is not None and params and not self.fast:
            so_far = self._reduce_shared(params, bns, mine, per)
            self.bn_transport.flush()
            self.reduce_s += time.perf_counter() - t0
            return tuple(so_far.tolist()) if so_far is not None else None
        sends_bns = bns if k == last else []  # the final message carries the final statistics
        if self.first:
            grads = [p.grad for p in params]
            so_far = mine
            payload = _pack(grads, params, sends_bns)
        else:
            got = tr.post_recv(k - 1, specs(k, [])).wait()
            so_far = torch.cat([got.pop(0), mine]) if losses is not None else None
            grads, payload = [], got  # (no gradients: the fast mode's chain of statistics and losses)
            if params:  # the received buffers, summed in place, go on as they are
                mask, flats = got[0], got[1:]
                views = _split_views(dict(zip(_dtypes(params), flats)), params)
                has = _add_contribs(views, [self._contrib.pop(id(p), (p, []))[1] for p in params], mask.tolist())
                if has is not None:  # a parameter had no partial sum: it has the first contribution now
                    mask.copy_(torch.tensor(has, dtype=torch.uint8))
                grads = [v if h else None for v, h in zip(views, mask.tolist())]
            payload = payload + _pack([], [], sends_bns)
        if losses is not None:
            payload = [so_far] + payload
        if k < last:
            final = tr.exchange([(payload, k + 1)], (last, specs(last + 1, bns))).wait()  # posted with the send
            so_far = final.pop(0) if losses is not None else None
            grads, stats = _unpack(final, params, bns)
            _set_bn(bns, stats)
        else:
            tr.exchange([(payload, dst) for dst in range(last)], None)
        tr.flush()
        self.bn_transport.flush()
        for p, g in zip(params, grads):
            p.grad = g
        self.reduce_s += time.perf_counter() - t0
        return tuple(so_far.tolist()) if so_far is not None else None

    def _reduce_shared(self, params: list[nn.Parameter], bns: Sequence[_BatchNorm], mine: torch.Tensor | None,
                       per: int) -> torch.Tensor | None:
        """:meth:`reduce`'s chain in shared memory (:class:`pipeline.shm.SharedReduction`), in
        chunks of parameters: replica 0 writes its partial there chunk by chunk, and replica
        k > 0 adds its contributions to a chunk in place as soon as its predecessor's counter
        says the chunk is done, while the predecessor goes on with the next (the copy and the
        adds overlap on two cores). The same adds on the same bytes as the wire's chain. Every
        replica's losses go to their own slots, the last replica's final statistics to the
        message buffer; every replica then steps with the sum where it lies (``.grad`` are
        views of the shared buffers until :meth:`released`: nothing copied out)."""
        shm, k, last = self.shm, self.mesh.replica, self.mesh.replicas - 1
        layout = _Message(self.mesh.replicas * per, len(params), bns)
        flats, message = shm.begin(params, layout.nbytes)
        views = _split_views(flats, params)
        losses, mask = layout.losses(message), layout.mask(message)
        chunks = _chunks(params)
        if self.first:
            for j, (a, b) in enumerate(chunks):
                for i in range(a, b):
                    g = params[i].grad
                    if g is not None:
                        views[i].copy_(g)
                mask[a:b] = torch.tensor([params[i].grad is not None for i in range(a, b)], dtype=torch.uint8)
                shm.post(j + 1)
        else:
            contribs = [self._contrib.pop(id(p), (p, []))[1] for p in params]
            for j, (a, b) in enumerate(chunks):
                shm.wait(k - 1, j + 1)
                has = _add_contribs(views[a:b], contribs[a:b], mask[a:b].tolist())
                if has is not None:  # a parameter had no partial sum: it has the first contribution now
                    mask[a:b] = torch.tensor(has, dtype=torch.uint8)
                shm.post(j + 1)
            shm.wait(k - 1, len(chunks) + 1)  # (its losses are written: the last replica's post says all are)
        if mine is not None:
            losses[k * per:(k + 1) * per] = mine
        if k == last:
            for region, flat in zip(layout.stats(message), _pack([], [], bns)):
                region.copy_(flat)
        shm.post(len(chunks) + 1)
        if k < last:
            shm.wait(last, len(chunks) + 1)
            _set_bn(bns, _unpack(layout.stats(message), [], bns)[1])
        so_far = losses.clone() if mine is not None else None
        for p, v, has in zip(params, views, mask.tolist()):
            p.grad = v if has else None
        self._lent = params
        shm.end()
        return so_far

    def own(self) -> None:
        """Copy the gradients :meth:`reduce` left in shared memory into the parameters' own memory,
        so that the next reduction may run before their update (clipping folds a subnet at its last
        backward, and the next subnet's fold may come before this one's update)."""
        for p in self._lent:
            if p.grad is not None:
                p.grad = p.grad.clone()
        self._lent = []

    def released(self) -> None:
        """After the update of the gradients :meth:`reduce` left in shared memory: drop them
        (the next reduction but one rewrites those buffers; a later backward must not add to
        them)."""
        for p in self._lent:
            p.grad = None
        self._lent = []

    def _all_reduce(self, params: Sequence[nn.Parameter]) -> list[torch.Tensor | None]:
        """The sum of every replica's accumulated gradients (``None`` where no replica has one):
        one all-reduce per dtype, in the backend's own order."""
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.int64, device=self.transport.device)
        flats: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            flats.setdefault(p.dtype, []).append((p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1))
        summed = {}
        peer = self._a_peer()  # a lost replica is the peer's failure, not this rank's
        with peer_errors("reducing gradients with", peer):
            dist.all_reduce(present, group=self.group)
        for dt, parts in flats.items():
            flat = torch.cat(parts)
            with peer_errors("reducing gradients with", peer):
                dist.all_reduce(flat, group=self.group)
            summed[dt] = iter(flat.split([t.numel() for t in parts]))
        return self._unflatten(params, present.tolist(), summed)

    @staticmethod
    def _unflatten(params: Sequence[nn.Parameter], present: Sequence[int], summed: dict) -> list[torch.Tensor | None]:
        out = []
        for p, n in zip(params, present):
            g = next(summed[p.dtype])
            out.append(g.view_as(p).clone() if n else None)
        return out

    @contextmanager
    def recorded(self) -> Iterator[None]:
        """Record (replicas k > 0) during the block: a step's training forwards and backwards."""
        self.recording = True
        try:
            yield
        finally:
            self.recording = False

    def fold(self, losses: Sequence[float], modules: Sequence[nn.Module]) -> tuple[float, ...]:
        """After a step's backwards: every replica's micro-batch losses (returned) and the
        gradients of all M micro-batches (:meth:`reduce`; exact mode: in the same messages)."""
        if self.fast:
            losses = self.gather_losses(losses)
            self.reduce(modules)
            return losses
        return self.reduce(modules, losses)  # the losses ride along the chain: no collective of their own

    def share(self, n: int) -> range:
        """This replica's share of an evaluation's ``n`` batches: round-robin (k, k + R, ...)."""
        return range(self.mesh.replica, n, self.mesh.replicas)

    def combine_rows(self, rows: torch.Tensor) -> None:
        """Every replica's rows of an evaluation (one row per batch, filled by the replica that
        evaluated it, -0.0 elsewhere) on every replica, in place. Exact: each entry is one
        replica's value plus negative zeros, and x + -0.0 is x for every float x."""
        peer = self._a_peer()
        with peer_errors("combining the evaluation's results with", peer):
            work = dist.all_reduce(rows, group=self.group, async_op=True)
        wait_for(work, self.transport.timeout, "combining the evaluation's results with", peer)

    def gather_losses(self, losses: Sequence[float]) -> tuple[float, ...]:
        """Every replica's micro-batch losses, in global micro-batch order (on every rank)."""
        mine = torch.tensor(list(losses), dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(self.mesh.replicas)]
        peer = self._a_peer()
        with peer_errors("gathering losses with", peer):
            work = dist.all_gather(out, mine, group=self.group, async_op=True)
        wait_for(work, self.transport.timeout, "gathering losses with", peer)
        return tuple(v for t in out for v in t.tolist())

    def _a_peer(self) -> int:
        """Another replica of this stage (a collective's failure names one)."""
        return next(r for r in self.mesh.replica_ranks() if r != self.mesh.rank)


def _bns(modules: Sequence[nn.Module]) -> list[_BatchNorm]:
    """The batch norms of ``modules`` that keep running statistics, in order."""
    return [b for m in modules for b in m.modules() if isinstance(b, _BatchNorm) and b.track_running_stats]


def _key(bns: Sequence[_BatchNorm]) -> tuple[int, ...]:
    return tuple(id(b) for b in bns)


def _set_bn(bns: Iterable[_BatchNorm], values: Sequence[torch.Tensor]) -> None:
    values = list(values)
    with torch.no_grad():
        for i, bn in enumerate(bns):
            for buf, v in zip((bn.running_mean, bn.running_var, bn.num_batches_tracked), values[3 * i:3 * i + 3]):
                buf.copy_(v)


@torch.no_grad()
def _replay_bn(bn: _BatchNorm, x: torch.Tensor) -> None:
    """The running-statistics update of ``bn``'s training forward on ``x`` (as _BatchNorm.forward)."""
    bn.num_batches_tracked.add_(1)
    factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    if x.device.type == "cpu":  # the statistics alone: the CPU forward's own update (same kernel), a quarter cheaper
        torch.batch_norm_update_stats(x, bn.running_mean, bn.running_var, factor)
    else:  # (CUDA's forward may take cuDNN's path: replay through the same call)
        F.batch_norm(x, bn.running_mean, bn.running_var, None, None, True, factor, bn.eps)


def _dtypes(tensors: Iterable[torch.Tensor]) -> list[torch.dtype]:
    return list(dict.fromkeys(t.dtype for t in tensors))


def _bn_buffers(bns: Sequence[_BatchNorm]) -> list[torch.Tensor]:
    return [t for b in bns for t in (b.running_mean, b.running_var, b.num_batches_tracked)]


def _message_specs(params: Sequence[nn.Parameter], bns: Sequence[_BatchNorm]) -> list[TensorSpec]:
    """A reduction message's buffers: which parameters have a gradient (uint8, one each), the
    gradients flat per dtype (zeros where none), the batch-norm statistics flat per dtype."""
    specs = [TensorSpec((len(params),), torch.uint8)] if params else []
    specs += [TensorSpec((sum(p.numel() for p in params if p.dtype == dt),), dt) for dt in _dtypes(params)]
    buffers = _bn_buffers(bns)
    specs += [TensorSpec((sum(t.numel() for t in buffers if t.dtype == dt),), dt) for dt in _dtypes(buffers)]
    return specs


def _pack(grads: Sequence[torch.Tensor | None], params: Sequence[nn.Parameter],
          bns: Sequence[_BatchNorm]) -> list[torch.Tensor]:
    out = [torch.tensor([g is not None for g in grads], dtype=torch.uint8, device=params[0].device)] if params else []
    for dt in _dtypes(params):
        out.append(torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                              for p, g in zip(params, grads) if p.dtype == dt]))
    buffers = _bn_buffers(bns)
    out += [torch.cat([t.reshape(-1) for t in buffers if t.dtype == dt]) for dt in _dtypes(buffers)]
    return out


def _unpack(got: Sequence[torch.Tensor], params: Sequence[nn.Parameter],
            bns: Sequence[_BatchNorm]) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    """:func:`_pack`'s inverse: the gradients (views of the flat buffers; None where the mask
    says none) and the batch-norm statistics, in order."""
    got = list(got)
    grads: list[torch.Tensor | None] = []
    if params:
        present = got.pop(0).tolist()
        flats = {dt: got.pop(0) for dt in _dtypes(params)}
        grads = [v if has else None for v, has in zip(_split_views(flats, params), present)]
    buffers = _bn_buffers(bns)
    return grads, _split_views({dt: got.pop(0) for dt in _dtypes(buffers)}, buffers)


def _split_views(flats: dict[torch.dtype, torch.Tensor], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's view (its shape) of the per-dtype flat buffers ``flats``, in order."""
    parts = {dt: iter(f.split([t.numel() for t in tensors if t.dtype == dt])) for dt, f in flats.items()}
    return [next(parts[t.dtype]).view_as(t) for t in tensors]


_CHUNK = 1 << 18  # elements: the shared chain's unit of progress (1 MB of float32 gradients)


def _chunks(params: Sequence[nn.Parameter]) -> list[tuple[int, int]]:
    """``params`` in consecutive ranges of at least :data:`_CHUNK` elements (the last one may
    hold fewer): the same ranges on every replica."""
    out, start, n = [], 0, 0
    for i, p in enumerate(params):
        n += p.numel()
        if n >= _CHUNK:
            out.append((start, i + 1))
            start, n = i + 1, 0
    if start < len(params):
        out.append((start, len(params)))
    return out


def _add_contribs(views: Sequence[torch.Tensor], contribs: Sequence[Sequence[torch.Tensor]],
                  has: list[int]) -> list[int] | None:
    """Add each parameter's contributions, in micro-batch order, to its partial sum in ``views``
    (``has[i]``: whether it has one; where not, its first contribution is copied there), the
    reference's ``+=`` per micro-batch: one ``_foreach_add_`` per micro-batch in the common case
    (every parameter has a partial sum and the same number of contributions), else one add per
    parameter. Returns the new ``has`` where it changed, else None."""
    n = len(contribs[0]) if contribs else 0
    if all(has) and all(len(c) == n for c in contribs):
        for j in range(n):
            torch._foreach_add_(list(views), [c[j] for c in contribs])
        return None
    changed = False
    for i, cs in enumerate(contribs):
        for c in cs:
            if has[i]:
                views[i].add_(c)
            else:
                views[i].copy_(c)
                has[i], changed = 1, True
    return has if changed else None


class _Message:
    """The shared chain's message buffer (bytes): every replica's micro-batch losses (float64,
    in global micro-batch order), the presence mask (uint8, one per parameter), then the final
    batch-norm statistics flat per dtype (:func:`_pack`'s order), each part 8-byte aligned."""

    def __init__(self, losses: int, params: int, bns: Sequence[_BatchNorm]) -> None:
        self.parts: list[tuple[int, int, torch.dtype]] = []  # (offset, count, dtype)
        offset = 0

        def add(count: int, dt: torch.dtype) -> None:
            nonlocal offset
            self.parts.append((offset, count, dt))
            offset += -(-count * dt.itemsize // 8) * 8

        add(losses, torch.float64)
        add(params, torch.uint8)
        buffers = _bn_buffers(bns)
        for dt in _dtypes(buffers):
            add(sum(t.numel() for t in buffers if t.dtype == dt), dt)
        self.nbytes = offset

    def _part(self, message: torch.Tensor, i: int) -> torch.Tensor:
        offset, count, dt = self.parts[i]
        size = dt.itemsize
        return message[offset:offset + count * size].view(dt)

    def losses(self, message: torch.Tensor) -> torch.Tensor:
        return self._part(message, 0)

    def mask(self, message: torch.Tensor) -> torch.Tensor:
        return self._part(message, 1)

    def stats(self, message: torch.Tensor) -> list[torch.Tensor]:
        return [self._part(message, i) for i in range(2, len(self.parts))]
