"""The tensor manager: where a process's ops (weights, buffers, optimizer state) live, and how they move.

A process reaches the ops it owns through one :class:`TensorManager`, which holds them in a
store: all resident on the device (no budget), or virtual (``memory.device_budget_bytes``): every
op has a home in host memory (pinned on CUDA) and a bounded device arena of the budget's size
holds the working set, so the device tier can never hold more. An op is *resident* when its
bytes sit in a region of the arena and its module's tensors are views of that region.

The engine says what it will need: ``prefetch`` takes the op sets of the coming steps (the first
is the step about to run); ``ensure`` pins a step's ops and waits for them (a *hit* when resident
before, *late* when its prefetch was still in flight, a *miss* when fetched on demand; the wait is
stall time); ``release_step`` unpins them and moves the future on. Fetches for the coming steps
run in the background (a side stream on CUDA), at most ``max_in_flight`` copies at once; what is
evicted is the policy's choice (:mod:`.policy`, the same objects the offline planner
:func:`pipeline.plan.residency.plan_residency` asks).

Physics of the placement (``memory.optimizer``). ``device``: the optimizer state travels with
the op and is updated on the device, so a fetch or write-back of an fp32 op moves 4 bytes per
parameter of weights plus 4 (SGD momentum) or 8 (AdamW moments) of state: 12 or 16 bytes each
way, but an op that stays resident across steps moves nothing. ``host``: the state stays in the
host home and the host runs the update: 4 bytes of weights per parameter go to the device and 4
of gradients come back, every step the op is used (the device copy is stale after the update),
and the host's update time is on the critical path of a synchronous step. Gradients are not in
the arena: autograd allocates them during the backward and the step frees them.

Modules, one concern each:

* :mod:`.manager` - :class:`TensorManager`, the ops of one process behind one store;
* :mod:`.store` - the :class:`~.store.Store` interface and the all-resident store;
* :mod:`.virtual` - the virtual store: host homes, the step's protocol, the host update;
* :mod:`.working_set` - what sits in the arena: placement, eviction, compaction, copies in flight;
* :mod:`.policy` - the eviction policies (pure), shared with the offline residency planner;
* :mod:`.placement` - one op's host home, arena region and tensor views;
* :mod:`.arena` - the device arena and host homes; :mod:`.copies` - the copy engines;
* :mod:`.state` - the flat op-state format and its byte layout, the digest;
* :mod:`.optim` - per-op optimizer settings and the one-call step of many ops;
* :mod:`.sizing` - op footprints, and what the settings mean to the planner;
* :mod:`.peer` - the peer tier: saved activations handed to the paired stage and back;
* :mod:`.settings` - :class:`MemorySettings`; :mod:`.stats` - counters and audit;
  :mod:`.errors` - :class:`MemoryBudgetError`, the one text that names the budget (and the
  activation budget's, for the run's pre-check, :mod:`pipeline.feasibility`).
"""
from __future__ import annotations

from .errors import MemoryBudgetError
from .manager import TensorManager
from .optim import OptimConfig
from .settings import MemorySettings
from .sizing import MemoryModel
from .state import OpState, params_digest
from .stats import MemoryAudit, MemoryStats

__all__ = ["TensorManager", "OptimConfig", "MemorySettings", "MemoryStats", "MemoryAudit", "MemoryBudgetError",
           "MemoryModel", "OpState", "params_digest"]
