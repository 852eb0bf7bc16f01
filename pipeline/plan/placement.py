"""Who owns which op: the initial placement and the moves a new partition asks for (pure).

Every op of the supernet has exactly one owner stage at every moment. At the start, ops are
spread over the stages by node order (all candidates of a slot together), so inactive weights
are spread too. When a subnet is partitioned, each of its active ops must sit on the stage its
slice runs on; the others stay where they are. Every rank computes the same owners from the
same plans, so nobody has to ask who owns what.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from supernet import ActiveOp, OpSlot

__all__ = ["Move", "initial_owners", "stages_of", "moves"]


@dataclass(frozen=True)
class Move:
    op_id: str
    src: int
    dst: int


def initial_owners(slots: Sequence[OpSlot], num_stages: int) -> dict[str, int]:
    """Contiguous blocks of nodes per stage, in node order; candidates of a slot stay together."""
    nodes = list(dict.fromkeys(s.node for s in slots))
    stage_of_node = {n: (i * num_stages) // len(nodes) for i, n in enumerate(nodes)}
    return {s.op_id: stage_of_node[s.node] for s in slots}


def stages_of(active: Sequence[ActiveOp], bounds: Sequence[int]) -> dict[str, int]:
    """The stage each active op runs on under ``bounds``."""
    return {active[i].op_id: s for s in range(len(bounds) - 1) for i in range(bounds[s], bounds[s + 1])}


def moves(active: Sequence[ActiveOp], bounds: Sequence[int], owners: Mapping[str, int]) -> list[Move]:
    """The ops that must change owner for ``bounds``, in active-op order."""
    target = stages_of(active, bounds)
    return [Move(op.op_id, owners[op.op_id], target[op.op_id]) for op in active
            if owners[op.op_id] != target[op.op_id]]
