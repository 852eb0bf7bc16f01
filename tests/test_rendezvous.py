"""Each attempt of a torchrun job gets store keys of its own, whatever the previous attempt left."""
from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from pipeline.rendezvous import RendezvousError, attempt_namespace


def attempt(store: dist.Store, world: int, delay: dict[int, float] | None = None) -> list[str]:
    """Every rank of one attempt in a thread (as torchrun starts them); returns each rank's namespace."""
    got: list[str | None] = [None] * world
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            time.sleep((delay or {}).get(r, 0.0))
            got[r] = attempt_namespace(store, r, world, timeout_s=20)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return got  # type: ignore[return-value]


def test_every_rank_of_an_attempt_agrees_and_no_attempt_reuses_keys() -> None:
    # One store for the whole job, as torchrun's agent keeps it across restarts.
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=20))
    first = attempt(store, 3)
    assert len(set(first)) == 1
    # The restarted rank 0 comes late (the stale requests of the first attempt are waiting for
    # it), then rank 2 comes late (rank 0 finds rank 2's stale request first): the same answer.
    second = attempt(store, 3, delay={0: 0.3})
    third = attempt(store, 3, delay={2: 0.3})
    assert len(set(second)) == 1 and len(set(third)) == 1
    assert len({first[0], second[0], third[0]}) == 3


def test_a_rank_that_never_comes_is_named() -> None:
    store = dist.HashStore()
    with pytest.raises(RendezvousError, match=r"rank 0: ranks \[1\] did not join the process group within 0.2 s"):
        attempt_namespace(store, 0, 2, timeout_s=0.2)
