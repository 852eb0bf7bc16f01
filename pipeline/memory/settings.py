"""Memory settings (the ``memory`` config group): the device budget of the tensor manager.

``device_budget_bytes``: the bytes of the device arena that holds the resident ops' weights,
buffers and optimizer state (``null``: no arena, every op resident, today's behaviour);
``device_budget_fraction``: instead, that fraction of the CUDA device's free memory when the
manager starts (CUDA only; at most one of the two).
``host_memory``: where non-resident ops live: ``pageable``, ``pinned`` (page-locked, what
makes host-to-device copies asynchronous and fast on CUDA) or ``shared`` (shared memory, so
other processes on the machine can map it). ``policy``: what is evicted and when ops are
fetched (:mod:`pipeline.plan.policy`): ``belady`` (evict the op whose next use in the known
future is furthest away, prefetch from the lookahead), ``lru`` (prefetch from the lookahead,
evict the least recently used op) or ``on_demand`` (no prefetch: fetch synchronously when used,
evict LRU).
``prefetch_depth``: how many future steps the manager fetches ahead (as the budget allows).
``max_in_flight``: copies in flight at once. ``activations``: where each op's saved activations
wait for its backward (``keep``, ``swap``, ``recompute`` for every op; ``peer``: every op of the
earlier stage of each pair (stage ``s`` with ``P - 1 - s``, BPipe's pairing) hands them to its
pair, :mod:`pipeline.memory.peer`; or ``auto``: a keep/swap/recompute/peer choice per op, planned
with each partition by :mod:`pipeline.plan.activations` so that a stage's kept activations, and
what it holds for its pair, fit ``activation_budget_bytes`` at the least added time; swaps are
priced at ``host_link_bandwidth`` bytes/s each way, peer copies at ``peer_link_bandwidth``, the
device-to-device link's, e.g. NVLink). ``activation_budget_bytes``: per stage, the
device bytes the activations the schedule keeps may take (``null``: no bound, ``auto`` keeps
everything); it is separate from the arena, as gradients are. ``optimizer``: where the optimizer
state lives and is updated: ``device`` (it travels with the op and is updated on the device: an
fp32 op with AdamW moves 12 bytes per parameter each way, weights and both moments, and none while
it stays resident), ``host`` (it stays in the op's host home and the host updates it: 4 bytes of
weights per parameter go to the device, 4 of gradients come back, and the device copy is stale
after each step, so every use fetches) or ``hybrid`` (per op and step, :mod:`pipeline.plan.hybrid`:
the device's way while the next subnet reuses the op, so it stays resident and moves nothing, the
host's way otherwise; the state comes along only where the arena has room for it, so ``hybrid``
runs at ``host``'s budget). ``hybrid`` is the default: simulated on NASPipe's space
(``bench/vtm.py``, bench/RESULTS.md) it is at least the better of the other two in all 28 settings
(0.81-1.00x of all-resident, against 0.61-0.99 for ``device`` and 0.48-0.98 for ``host``).
``host_update_rate`` (hybrid): the parameters a second the host's optimizer steps, so that the
host steps no more of a subnet's ops than it can while the subnet computes on the stage (the
plan's estimate: under torchrun; one process plans nothing and sets no limit); ``auto`` (the
default) measures it once, on the host-update threads with the run's optimizer, when a plan
first asks; ``null``: no limit.
``host_update_threads``: the threads that run the host's updates (:mod:`pipeline.memory.host_updates`)
while the training thread goes on; ``0`` runs them on the training thread; ``null`` (the default)
one per core this process may use (its share under torchrun), less one, at most 8.
``cpu_copies`` (CPU only): ``inline`` (the default) copies on the calling thread, ``thread`` on a
background thread, the CPU stand-in for a CUDA side stream (the same control flow: handles
waited on before use, copies in order). On a CPU both tiers are host memory, so there is no
copy engine to overlap with: measured on the 2-core machine the thread cost +9-14 % per step
against +2 % inline (bench/RESULTS.md), hence the default.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..plan.policy import POLICIES

__all__ = ["MemorySettings", "HOST_MEMORY", "POLICIES", "ACTIVATIONS", "OPTIMIZER_PLACEMENTS"]

HOST_MEMORY = ("pageable", "pinned", "shared")
ACTIVATIONS = ("keep", "swap", "recompute", "peer", "auto")
OPTIMIZER_PLACEMENTS = ("device", "host", "hybrid")
CPU_COPIES = ("thread", "inline")


@dataclass(frozen=True)
class MemorySettings:
    """How the tensor manager bounds the device working set (see the module docstring)."""

    device_budget_bytes: int | None = None
    device_budget_fraction: float | None = None
    host_memory: str = "pinned"
    policy: str = "belady"
    prefetch_depth: int = 2
    max_in_flight: int = 16
    activations: str = "keep"
    activation_budget_bytes: int | None = None
    host_link_bandwidth: float = 25e9
    peer_link_bandwidth: float = 150e9
    optimizer: str = "hybrid"
    cpu_copies: str = "inline"
    host_update_rate: float | str | None = "auto"  # hybrid: parameters/s the host steps; auto: measured; null: no limit
    host_update_threads: int | None = None  # threads stepping ops at home; 0: on the training thread; null: auto

    @property
    def state_can_stay_home(self) -> bool:
        """Whether an op can run with its optimizer state in its host home (``host``, ``hybrid``):
        the arena must hold at least its weights and buffers, not its state."""
        return self.optimizer != "device"

    @property
    def virtual(self) -> bool:
        """Whether a budget is set (ops live in host memory and a bounded arena)."""
        return self.device_budget_bytes is not None or self.device_budget_fraction is not None

    def budget_for(self, device: torch.device, free_bytes: Callable[[torch.device], int] | None = None) -> int:
        """The arena's bytes on ``device``: the set bytes, or the fraction of its free memory
        (``free_bytes`` defaults to ``torch.cuda.mem_get_info``)."""
        if self.device_budget_bytes is not None:
            return self.device_budget_bytes
        if self.device_budget_fraction is None:
            raise ValueError("memory.device_budget_bytes: no budget set (null means every op resident)")
        if device.type != "cuda":
            raise ValueError(f"memory.device_budget_fraction: a fraction of free device memory needs a CUDA "
                             f"device, found {device}; set memory.device_budget_bytes instead")
        free = free_bytes(device) if free_bytes is not None else torch.cuda.mem_get_info(device)[0]
        return max(1, int(free * self.device_budget_fraction))

    def __post_init__(self) -> None:
        b = self.device_budget_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
            raise ValueError(f"memory.device_budget_bytes: expected a positive integer (bytes) or null, found {b!r}")
        f = self.device_budget_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise ValueError(f"memory.device_budget_fraction: expected a number in (0, 1] or null, found {f!r}")
        if f is not None and b is not None:
            raise ValueError("memory.device_budget_fraction: expected null when memory.device_budget_bytes is set "
                             f"(found {f!r} and {b!r}); set one of them")
        if self.host_memory not in HOST_MEMORY:
            raise ValueError(f"memory.host_memory: expected one of {list(HOST_MEMORY)}, found {self.host_memory!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"memory.policy: expected one of {list(POLICIES)}, found {self.policy!r}")
        for name in ("prefetch_depth", "max_in_flight"):
            v = getattr(self, name)
            lo = 0 if name == "prefetch_depth" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"memory.{name}: expected an integer >= {lo}, found {v!r}")
        a = self.activation_budget_bytes
        if a is not None and (isinstance(a, bool) or not isinstance(a, int) or a <= 0):
            raise ValueError(f"memory.activation_budget_bytes: expected a positive integer (bytes) or null, found {a!r}")
        for name in ("host_link_bandwidth", "peer_link_bandwidth"):
            h = getattr(self, name)
            if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 < h < float("inf"):
                raise ValueError(f"memory.{name}: expected a positive number (bytes/s), found {h!r}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"memory.activations: expected one of {list(ACTIVATIONS)}, found {self.activations!r}")
        if self.cpu_copies not in CPU_COPIES:
            raise ValueError(f"memory.cpu_copies: expected one of {list(CPU_COPIES)}, found {self.cpu_copies!r}")
        r = self.host_update_rate
        if r is not None and r != "auto" and (isinstance(r, bool) or not isinstance(r, (int, float))
                                              or not 0 < r < float("inf")):
            raise ValueError(f"memory.host_update_rate: expected a positive number (parameters/s), 'auto' or null, "
                             f"found {r!r}")
        t = self.host_update_threads
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0):
            raise ValueError(f"memory.host_update_threads: expected an integer >= 0 or null (one per core this "
                             f"process may use, less one, at most 8), found {t!r}")
        if self.optimizer not in OPTIMIZER_PLACEMENTS:
            raise ValueError(f"memory.optimizer: expected one of {list(OPTIMIZER_PLACEMENTS)}, found {self.optimizer!r}")
