"""How a rank joins its peers: ``init_process_group`` that survives torchrun's restarts.

Under torchrun (torch 2.4 and later, our pin included) the elastic agent hosts one TCPStore for
the whole job and hands its address to every worker (``MASTER_ADDR``/``MASTER_PORT``,
``TORCHELASTIC_USE_AGENT_STORE=True``). The store is created at the first rendezvous round
and kept for every later one, so after a restart it still holds the keys the workers of the
previous round wrote: gloo's ``default_pg/<group>//cpu//<n>/<rank>`` address of every rank of
every process group. A restarted rank whose peer has not yet published its new address reads
the old one, of a process that is gone, and ``connectFullMesh`` fails with "Connection refused"
(or a connect timeout); each group created after start-up is one more chance to lose that race
(pytorch/pytorch#135712 describes the same for NCCL's unique id). torch's own guard, the
``TORCHELASTIC_RESTART_COUNT`` prefix, is gone from ``_create_c10d_store``; the count is also
kept per agent, so on several nodes it differs between ranks (pytorch/pytorch#108158).

:func:`init_process_group` therefore gives every attempt keys of its own: rank 0 draws a fresh
namespace and hands it to each other rank through the agent's store, in answer to a request
that carries a token the other rank has just drawn — an answer to a fresh token cannot be stale.
All of the attempt's process groups then live under that namespace. Outside torchrun, or when
the agent store is not shared (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: a new store per round),
it is plain ``init_process_group``.
"""
from __future__ import annotations

import datetime
import logging
import os
import time
import uuid

import torch.distributed as dist

__all__ = ["init_process_group", "attempt_namespace", "RendezvousError"]

log = logging.getLogger(__name__)

PREFIX = "pipenas/join"
POLL_S = 0.01


class RendezvousError(RuntimeError):
    """The ranks of this attempt did not find each other in time."""


def init_process_group(backend: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Join the default process group; under torchrun's shared agent store, in keys of this
    attempt only (see the module docstring)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    ns = attempt_namespace(store, rank, world_size, timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt != "0":
        log.info("[rank %d] restart %s of this torchrun job: process groups in namespace %s", rank, attempt, ns)
    dist.init_process_group(backend, store=dist.PrefixStore(f"pipenas/{ns}/", store), rank=rank,
                            world_size=world_size, timeout=timeout)


def attempt_namespace(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> str:
    """A namespace that every rank of this attempt gets and no earlier attempt used.

    Rank ``r > 0`` posts a fresh token under ``req/<r>`` and waits for ``resp/<token>``; rank 0
    answers every token it finds until each other rank has acknowledged under ``ack/<ns>/``.
    Keys of earlier attempts are read at most as requests, which rank 0 answers harmlessly.
    """
    if world_size == 1:
        return uuid.uuid4().hex
    if rank != 0:
        token = uuid.uuid4().hex
        store.set(f"{PREFIX}/req/{rank}", token)
        try:
            ns = store.get(f"{PREFIX}/resp/{token}").decode()  # blocks up to the store's timeout
        except Exception as e:
            raise RendezvousError(f"rank {rank}: no answer from rank 0 within {timeout_s:g} s while joining "
                                  f"the process group ({type(e).__name__}: {e})") from None
        store.set(f"{PREFIX}/ack/{ns}/{rank}", "1")
        return ns
    ns = uuid.uuid4().hex
    waiting = set(range(1, world_size))
    answered: dict[int, bytes] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for r in sorted(waiting):
            if store.check([f"{PREFIX}/ack/{ns}/{r}"]):
                waiting.discard(r)
            elif store.check([f"{PREFIX}/req/{r}"]):
                token = store.get(f"{PREFIX}/req/{r}")
                if answered.get(r) != token:  # a fresh request, or one of an earlier attempt: answer both
                    store.set(f"{PREFIX}/resp/{token.decode()}", ns)
                    answered[r] = token
        if not waiting:
            return ns
        if time.monotonic() > deadline:
            raise RendezvousError(f"rank 0: ranks {sorted(waiting)} did not join the process group within "
                                  f"{timeout_s:g} s")
        time.sleep(POLL_S)
