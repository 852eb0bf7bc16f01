"""The supernet graph: a networkx DAG of fixed ops and choice slots. networkx stays in here.

Nodes are built in order with ``add_fixed`` / ``add_choice``; each names its inputs, which
must already exist, so the graph is acyclic by construction. The data enters at the node
``"input"``; the graph's output is its single sink. For an :class:`Arch` (one value per
choice slot) ``active_ops`` returns the ops that run, as the project's own
:class:`ActiveOp` values, in a deterministic topological order (ties broken by insertion
order), the same on every process.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from .errors import SupernetError
from .ops import OpSpec
from .space import Arch, Choice, SearchSpace

__all__ = ["INPUT", "ActiveOp", "OpSlot", "SupernetGraph"]

INPUT = "input"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class ActiveOp:
    """One op that runs in a subnet: which weights (``op_id``), where (``node``), fed by what."""

    op_id: str  # "<slot>/<candidate>" for a choice, "<node>" for a fixed op
    node: str
    inputs: tuple[str, ...]  # producer node names, in argument order
    spec: OpSpec


@dataclass(frozen=True)
class OpSlot:
    """One op of the supernet, active or not: the unit of weights, placement and migration."""

    op_id: str
    node: str
    spec: OpSpec


class SupernetGraph:
    """A weight-shared supernet as a DAG. See the module docstring."""

    def __init__(self, name: str = "supernet") -> None:
        self.name = name
        self._g = nx.DiGraph()
        self._g.add_node(INPUT, order=0, op=None, candidates=None, inputs=())
        self._order = 1
        self._active: dict[Arch, tuple[ActiveOp, ...]] = {}  # valid archs seen; cleared by _add
        self._nodes: tuple[str, ...] | None = None  # nodes() and space(), made once; cleared by _add
        self._space: SearchSpace | None = None

    # -- construction ----------------------------------------------------------------------
    def add_fixed(self, name: str, op: OpSpec, inputs: Sequence[str]) -> str:
        self._add(name, inputs, op=op, candidates=None)
        return name

    def add_choice(self, name: str, candidates: Mapping[str, OpSpec], inputs: Sequence[str]) -> str:
        if not candidates:
            raise SupernetError(f"choice slot {name!r}: expected at least one candidate, found none")
        for cand in candidates:
            if not _NAME.match(str(cand)):
                raise SupernetError(
                    f"choice slot {name!r}: candidate name {cand!r} must match {_NAME.pattern}"
                )
        self._add(name, inputs, op=None, candidates=tuple(candidates.items()))
        return name

    def _add(self, name: str, inputs: Sequence[str], op: OpSpec | None, candidates: tuple | None) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise SupernetError(f"node name {name!r}: expected an identifier matching {_NAME.pattern}")
        if name in self._g:
            raise SupernetError(f"node {name!r} already exists in graph {self.name!r}")
        inputs = tuple(inputs)
        if not inputs:
            raise SupernetError(f"node {name!r}: expected at least one input, found none")
        for src in inputs:
            if src not in self._g:
                raise SupernetError(
                    f"node {name!r}: input {src!r} does not exist yet; add producers before consumers"
                )
        self._g.add_node(name, order=self._order, op=op, candidates=candidates, inputs=inputs)
        self._active.clear()
        self._nodes = self._space = None
        self._order += 1
        for port, src in enumerate(inputs):
            # A node may take the same producer twice; the edge keeps the first port.
            if not self._g.has_edge(src, name):
                self._g.add_edge(src, name, port=port)

    # -- structure -------------------------------------------------------------------------
    @property
    def output(self) -> str:
        sinks = [n for n in self._g if self._g.out_degree(n) == 0 and n != INPUT]
        if len(sinks) != 1:
            raise SupernetError(
                f"graph {self.name!r}: expected exactly one output node (a sink), found {sorted(sinks)}"
            )
        return sinks[0]

    def nodes(self) -> tuple[str, ...]:
        """All op nodes (not the input) in deterministic topological order (sorted once: the
        planners ask several times for every subnet they plan)."""
        if self._nodes is None:
            self._nodes = tuple(n for n in self._topo() if n != INPUT)
        return self._nodes

    def _topo(self) -> list[str]:
        return list(nx.lexicographical_topological_sort(self._g, key=lambda n: self._g.nodes[n]["order"]))

    def is_choice(self, node: str) -> bool:
        return self._g.nodes[node]["candidates"] is not None

    def inputs_of(self, node: str) -> tuple[str, ...]:
        return self._g.nodes[node]["inputs"]

    def consumers_of(self, node: str) -> tuple[str, ...]:
        return tuple(sorted(self._g.successors(node), key=lambda n: self._g.nodes[n]["order"]))

    def space(self) -> SearchSpace:
        """The search space: one choice per choice slot, its values the candidate names."""
        if self._space is None:
            self._space = SearchSpace(
                Choice(n, tuple(c for c, _ in self._g.nodes[n]["candidates"]))
                for n in self.nodes()
                if self.is_choice(n)
            )
        return self._space

    def slots(self) -> tuple[OpSlot, ...]:
        """Every op of the supernet (each candidate of each slot, each fixed op), in node order."""
        out: list[OpSlot] = []
        for n in self.nodes():
            data = self._g.nodes[n]
            if data["candidates"] is None:
                out.append(OpSlot(n, n, data["op"]))
            else:
                out.extend(OpSlot(f"{n}/{c}", n, spec) for c, spec in data["candidates"])
        return tuple(out)

    def active_ops(self, arch: Arch) -> tuple[ActiveOp, ...]:
        """The ops that run for ``arch``, in deterministic topological order (cached: every
        step of every engine asks, and the topological sort is the costly part)."""
        hit = self._active.get(arch) if isinstance(arch, Arch) else None
        if hit is not None:
            return hit
        arch = self.space().validate(arch)
        ops: list[ActiveOp] = []
        for n in self.nodes():
            data = self._g.nodes[n]
            if data["candidates"] is None:
                ops.append(ActiveOp(n, n, data["inputs"], data["op"]))
            else:
                cand = arch[n]
                spec = dict(data["candidates"])[cand]
                ops.append(ActiveOp(f"{n}/{cand}", n, data["inputs"], spec))
        if len(self._active) >= 4096:
            self._active.clear()
        self._active[arch] = out = tuple(ops)
        return out

    def __repr__(self) -> str:
        n_choice = sum(self.is_choice(n) for n in self.nodes())
        return f"SupernetGraph({self.name!r}, {len(self.nodes())} nodes, {n_choice} choice slots, {len(self.slots())} ops)"
