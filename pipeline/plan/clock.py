"""The timing rule of schedules, in one place: one event loop for stages, links and host channels.

A :class:`Clock` times *tasks* — a schedule's actions, then any host copies — on FIFO resources:
each stage runs its tasks one at a time, each direction of each cut carries its sender's
messages one at a time, each host channel its copies. A task starts when its resource is free
and its inputs are there; which inputs an action needs, the schedule's
:class:`~pipeline.plan.schedule.WaitRule` says, compiled here once per rule to integers (the
simulator replays a planner's candidates thousands of times). The simulator
(:mod:`pipeline.plan.simulate`) runs a clock over a schedule's lists; the admission builder
(:mod:`pipeline.plan.admission`) runs one over the actions it picks, one at a time, so its
estimates are exactly what the simulator replays. Pure: values in, values out.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Mapping, Sequence

from .schedule import Action, WaitRule
from .values import WEIGHT_SHARE, Copy, HostLinks, SimulationError, SubnetWork, weight_seconds

__all__ = ["Clock", "SimulationError", "WEIGHT_SHARE"]

# Per subnet, five rows of P costs: F, B (whole), B (input gradient only), W, U.
_KIND = {"F": 0, "B": 1, "W": 3, "U": 4}
_ROWS = 5
_INF = math.inf


class _Net:
    """A wait rule compiled to integers, once per rule: every action of the schedule an id,
    every message a slot; per action its stage, its cost's index in the cost table (subnet,
    kind, stage; a split B has its own row), the slots it receives, the same-stage actions it
    waits for, and what it sends (slot, link or -1, index of the transfer's seconds in the delay
    table)."""

    def __init__(self, rule: WaitRule) -> None:
        P, M, T = rule.P, rule.M, rule.T
        self.P, self.T = P, T
        acts = []
        for t in range(T):
            for s in range(P):
                acts += [Action(s, "F", m, t) for m in range(M)]
                if rule.training:
                    acts += [Action(s, "B", m, t) for m in range(M)]
                if (t, s) in rule.split:
                    acts += [Action(s, "W", m, t) for m in range(M)]
                if rule.updates:
                    acts.append(Action(s, "U", 0, t))
        self.actions = acts
        self.split = bool(rule.split)
        self.ids = {a: i for i, a in enumerate(acts)}
        cuts = max(P - 1, 0)
        # the delay table: activation sends per (subnet, cut), gradient sends, zero, each op's move
        self.zero = 2 * T * cuts
        self.ops = tuple(sorted(rule.users))
        move = {op: self.zero + 1 + k for k, op in enumerate(self.ops)}
        slots: dict[tuple, int] = {}

        def slot(w) -> int:
            return slots.setdefault((w.action, w.message, w.op), len(slots))

        self.init = tuple(dict.fromkeys((slot(w), move[w.op]) for _, w in rule.sends(None)))
        self.stage = [a.stage for a in acts]
        self.cost = [(a.subnet * _ROWS + _KIND[a.kind] + (a.kind == "B" and (a.subnet, a.stage) in rule.split)) * P
                     + a.stage for a in acts]
        self.deps: list[tuple[int, ...]] = []
        self.local: list[tuple[int, ...]] = []
        self.outs: list[tuple[tuple[int, int, int], ...]] = []
        for a in acts:
            waits = rule.waits(a)
            self.deps.append(tuple(slot(w) for w in waits if w.message is not None))
            self.local.append(tuple(self.ids[w.action] for w in waits if w.message is None))
            outs: dict[int, tuple[int, int, int]] = {}
            for _, w in rule.sends(a):
                k = slot(w)
                if w.message == "activation":
                    outs[k] = (k, a.stage, a.subnet * cuts + a.stage)
                elif w.message == "gradient":
                    outs[k] = (k, cuts + a.stage - 1, (T + a.subnet) * cuts + a.stage - 1)
                else:  # losses and gradient norms: no cost; state: the op's move, beside the links
                    outs[k] = (k, -1, move[w.op] if w.message == "state" else self.zero)
            self.outs.append(tuple(outs.values()))
        self.slots = len(slots)

    def per_stage_costs(self, fwd: Sequence[float], bwd: Sequence[float], send: Sequence[float],
                        gsend: Sequence[float], bwd_weight: Sequence[float] | None = None
                        ) -> tuple[list[float], list[float]]:
        """The cost and delay tables of per-stage costs: every subnet alike, updates and moves
        free; a split backward's W takes ``bwd_weight`` of ``bwd`` (None: :data:`WEIGHT_SHARE`)."""
        P, T = self.P, self.T
        table = [float(x) for x in fwd] + [float(x) for x in bwd]
        if self.split:
            weight = weight_seconds(table[P:], bwd_weight)
            table += [b - w for b, w in zip(table[P:], weight)] + list(weight) + [0.0] * P
        else:  # a planner's hot path: no split rows to fill
            table += [0.0] * (3 * P)
        delays = [float(x) for x in send] * T + [float(x) for x in gsend] * T
        return table * T, delays + [0.0] * (1 + len(self.ops))

    def work_costs(self, work: Sequence[SubnetWork], state_time: Mapping[str, float]) -> tuple[list[float], list[float]]:
        """The cost and delay tables of one :class:`SubnetWork` per subnet and per-op move seconds."""
        table = [x for w in work for x in (*w.fwd, *w.bwd, *(b - g for b, g in zip(w.bwd, w.bwd_weight)),
                                           *w.bwd_weight, *w.update)]
        sends = [x for w in work for x in w.send]
        return table, sends + sends + [0.0] + [float(state_time.get(op, 0.0)) for op in self.ops]


# compiled once per rule, and forgotten with it (a cross-subnet rule of thousands of actions is large)
_NETS: weakref.WeakKeyDictionary[WaitRule, _Net] = weakref.WeakKeyDictionary()


def _net(rule: WaitRule) -> _Net:
    net = _NETS.get(rule)
    if net is None:
        net = _NETS[rule] = _Net(rule)
    return net


# ---------------------------------------------------------------------------- the event loop


class Clock:
    """The timing rule of the module doc, in one place: tasks (a schedule's actions, then any
    host copies) on FIFO resources (stages ``0..P-1``, then the host channels), each started
    when its resource is free and its inputs are there. :meth:`run` times tasks in an order
    that respects every wait (the simulator's order, or the admission builder's choices one at
    a time); :meth:`ready` says when an action's inputs are all there (None: not yet sent)."""

    def __init__(self, rule: WaitRule, table: list[float], delays: list[float]) -> None:
        net = self.net = _net(rule)
        n = len(net.actions)
        self.table, self.delays = table, delays
        self.res, self.cost, self.deps, self.outs, self.local = net.stage, net.cost, net.deps, net.outs, net.local
        self.cdeps: list[tuple[int, ...]] | None = None  # with copies: the copies an action waits for
        self.free = [0.0] * net.P
        self.link = [0.0] * (2 * max(net.P - 1, 0))
        self.arrive = [_INF] * net.slots
        for k, d in net.init:
            self.arrive[k] = delays[d]
        self.start: list[float | None] = [None] * n
        self.end: list[float | None] = [None] * n
        self.stall = [0.0] * net.P

    @classmethod
    def per_stage(cls, rule: WaitRule, fwd: Sequence[float], bwd: Sequence[float], send: Sequence[float],
                  grad_send: Sequence[float] | None = None, bwd_weight: Sequence[float] | None = None) -> Clock:
        """A clock with per-stage costs (per micro-batch; per cut): every subnet alike, updates
        and moves free; ``bwd_weight``: the W's seconds of a split backward (its B takes the rest)."""
        net = _net(rule)
        return cls(rule, *net.per_stage_costs(fwd, bwd, send, send if grad_send is None else grad_send, bwd_weight))

    @classmethod
    def per_subnet(cls, rule: WaitRule, work: Sequence[SubnetWork], state_time: Mapping[str, float] | None = None
                   ) -> Clock:
        """A clock with ``work[t]``'s costs for subnet ``t`` and ``state_time[op]`` seconds per move of ``op``."""
        return cls(rule, *_net(rule).work_costs(work, state_time or {}))

    def id(self, a: Action) -> int:
        return self.net.ids[a]

    def ready(self, i: int) -> float | None:
        """When task ``i``'s inputs are all there, or None when one has not been sent yet."""
        t = 0.0
        for j in self.local[i]:
            e = self.end[j]
            if e is None:
                return None
            t = e if e > t else t
        for k in self.deps[i]:
            x = self.arrive[k]
            if x == _INF:
                return None
            t = x if x > t else t
        return t

    def run(self, order: Iterable[int]) -> None:
        """Time the tasks of ``order``, each after everything it waits for (the caller's order
        must respect the waits, and each resource's order)."""
        free, arrive, link, delays, table = self.free, self.arrive, self.link, self.delays, self.table
        res, cost, deps, outs, cdeps = self.res, self.cost, self.deps, self.outs, self.cdeps
        starts, ends, stall = self.start, self.end, self.stall
        for i in order:
            r = res[i]
            start = free[r]
            for k in deps[i]:
                x = arrive[k]
                if x > start:
                    start = x
            if cdeps is not None:  # host copies: an action's wait for them is its stage's stall
                if cdeps[i]:
                    could = start
                    for k in cdeps[i]:
                        x = arrive[k]
                        if x > start:
                            start = x
                    stall[r] += start - could
                if start == -_INF:  # a copy with nothing before it
                    start = 0.0
            end = start + table[cost[i]]
            free[r] = end
            starts[i], ends[i] = start, end
            for k, ln, d in outs[i]:
                if ln < 0:
                    arrive[k] = end + delays[d]
                else:  # the link's direction is FIFO, in its sender's order
                    x = link[ln]
                    x = (end if end > x else x) + delays[d]
                    link[ln] = arrive[k] = x

    def add_copies(self, copies: tuple[Copy, ...], links: HostLinks) -> list[list[int]]:
        """Append ``copies`` as tasks on their host channels (after the actions, in input order);
        return each channel's queue of task ids."""
        net, n = self.net, len(self.net.actions)
        self.res, self.cost, self.deps, self.outs = list(self.res), list(self.cost), list(self.deps), list(self.outs)
        self.local = list(net.local) + [()] * len(copies)
        self.table, self.delays = list(self.table), list(self.delays)
        self.cdeps = [()] * (n + len(copies))
        self.copies = copies
        arrive = self.arrive

        def slot(value: float = _INF) -> int:
            arrive.append(value)
            return len(arrive) - 1

        done = [slot() for _ in copies]
        channel: dict[tuple[str, int], int] = {}
        queues: list[list[int]] = []
        for k, c in enumerate(copies):
            r = channel.get((c.channel, c.stage))
            if r is None:
                r = channel[(c.channel, c.stage)] = len(self.free)
                free = getattr(links, f"{c.channel}_free_at")
                self.free.append(-_INF if free is None else float(free[c.stage]))
                queues.append([])
            queues[r - net.P].append(n + k)
            deps = [slot(c.ready)] + [done[j] for j in c.waits_for]
            if c.after is not None:
                j, after = net.ids[c.after], slot()
                self.outs[j] = (*self.outs[j], (after, -1, net.zero))
                deps.append(after)
            if c.before is not None:
                j = net.ids[c.before]
                self.cdeps[j] = (*self.cdeps[j], done[k])
            self.res.append(r)
            self.cost.append(len(self.table))
            self.table.append(c.nbytes / links.rate(c.channel, c.stage))
            self.deps.append(tuple(deps))
            self.outs.append(((done[k], -1, net.zero),))
        self.start += [None] * len(copies)
        self.end += [None] * len(copies)
        self.channel = channel
        return queues

    def order(self, queues: Sequence[Sequence[int]]) -> list[int]:
        """An order of every task in ``queues`` (one FIFO queue per resource) that respects
        each queue and every wait: each queue runs as far as its inputs allow, round after
        round. Raises :class:`SimulationError` when no queue can go on."""
        P = self.net.P
        produced = [x != _INF for x in self.arrive]  # sent at the start: moves from the origin, copies' ready
        done = [False] * len(self.res)
        deps, local, outs = self.deps, self.local, self.outs
        cdeps = self.cdeps or [()] * len(self.res)
        pos = [0] * len(queues)
        out: list[int] = []
        progress = True
        while progress:
            progress = False
            for q, queue in enumerate(queues):
                while pos[q] < len(queue):
                    i = queue[pos[q]]
                    if not (all(produced[k] for k in deps[i]) and all(done[j] for j in local[i])
                            and all(produced[k] for k in cdeps[i])):
                        break
                    done[i] = True
                    for k, _, _ in outs[i]:
                        produced[k] = True
                    out.append(i)
                    pos[q] += 1
                    progress = True
        if len(out) < sum(len(q) for q in queues):
            if self.cdeps is None:  # validate() rules this out; never loop forever on a bug
                raise SimulationError(f"simulate: no stage could progress at positions {pos}")
            n = len(self.net.actions)
            by_res = {r: key for key, r in self.channel.items()}
            stuck = [f"{self.copies[queue[pos[q]] - n].label or queue[pos[q]] - n} on {by_res[q][0]}[{by_res[q][1]}]"
                     for q, queue in enumerate(queues) if q >= P and pos[q] < len(queue)]
            raise SimulationError(f"simulate: copies and actions wait for each other (a copy after an action "
                                  f"that needs it?): stages at {pos[:P]}, copies waiting: {stuck}")
        return out
