"""Residency over a cross-subnet schedule: what one stage's tensor manager fetches, evicts and writes back.

The stage executor (:mod:`pipeline.executor`) drives the tensor manager through a schedule's
row as events: at the segment's *start* it announces this stage's use order (its subnets in the
order of their first forward here, each one's ops) and the store fetches ahead; at a subnet's
*begin* (its first forward here) it pins the subnet's ops and waits until they are resident (an
op not there yet is fetched on demand); at its *end* (its update ``U`` here) it unpins the ops
no other subnet in flight here runs, drops the subnet from the future and fetches ahead again,
then exports the ops whose next user runs on another stage: from the arena, no write-back; the
receiving stage places the arriving op in its arena as a fetch ahead would (evicting only ops
needed later), else in a host home, so its first use there fetches it. (Before, every moved op
was written back by the sender and landed in a host home: ``adopt="host"``.)

:func:`plan_stage` replays those decisions without a device, as the runtime's working set
(:class:`pipeline.memory.working_set.WorkingSet`) makes them, with the same policy objects
(:mod:`pipeline.plan.policy`): candidates are the resident ops not pinned, least recently
used first (last use = the last begin that pinned it), each with its next use as an index into
the future (the pending subnets, those in flight first); a fetch ahead for the future entry
``idx`` evicts only what the policy gives up for ``idx``, and stops the round when it gives up
nothing; a demand fetch takes any candidate. Ahead of use the store looks at the first
``prefetch_depth + 1`` pending subnets past those in flight (``past_in_flight=False``: those in
flight counted among them, the runtime before). The
arena is a byte count (no fragmentation: the runtime may also compact, or evict a second op of
equal rank for a hole); copies in flight are not capped (``memory.max_in_flight`` only delays
when the runtime asks again). The arena holds op state only, as the runtime's does (gradients and
activations live beside it), and so does the admission builder's
:class:`~pipeline.plan.admission.ArenaBound`: the ops pinned at once fit by construction.

:func:`residency_copies` turns the plans into host-channel jobs for
:func:`pipeline.plan.simulate.simulate`: fetches ahead start after the event that issued them and
must land before their subnet's first forward here (a late one is a stall); demand fetches start
when the forward's stage is free and its input has been sent, and the forward waits for them; a
fetch into the room of a changed op waits for that op's write-back; an exported op's write-back
holds the stage (the runtime before synchronized it; an op exported from the arena writes back
nothing). Write-backs run on a channel of their own beside the fetches (``duplex``: the runtime's
CUDA copier has a stream per direction) or share the fetches' FIFO (one stream, the runtime
before). Pure: values in, values out.

**Hybrid optimizer placement** (``weights`` given: ``memory.optimizer=hybrid``, the runtime's
default). As the runtime's working set places an op for its use by a subnet: with its optimizer
state (``sizes[op]`` bytes, updated on the device, written back when evicted changed) when the
next subnet in this stage's order also runs it (:data:`pipeline.plan.hybrid.REUSE_NEXT`) and it
fits beside the ops pinned with it, else its weights alone (``weights[op]`` bytes). An op held
without its state is updated on the host: at the subnet's update here its gradients go down
(``weights[op]`` bytes), the host steps it and the op leaves the arena (the device copy is
stale; nothing to write back); its next fetch waits for that host update. An op resident with
its state serves any use on the device; one resident without it serves the use on the host.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .policy import NEVER, Candidate, policy_named
from .schedule import Action, Schedule
from .simulate import Copy

__all__ = ["Fetch", "StageEvent", "StageResidency", "StageResidencyError", "plan_stage", "residency_copies"]


class StageResidencyError(ValueError):
    """A stage's ops cannot be planned: a subnet's ops (with those pinned beside them) exceed the
    arena, or the schedule lacks what the plan needs."""


@dataclass(frozen=True)
class Fetch:
    """One host-to-device copy: ``op`` (``nbytes``) for subnet ``subnet``'s first forward here,
    after evicting ``victims`` (each written back first when it changed)."""

    op: str
    nbytes: int
    subnet: int
    victims: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageEvent:
    """What the store does at one event of a stage's row.

    ``kind``: ``start`` (the segment's first announcement), ``begin`` (subnet ``subnet``'s first
    forward here: ``hits``, ``prefetched`` and the demand ``fetches``) or ``end`` (its update:
    fetches ahead). ``writeback``: ``(op, bytes)`` of the changed ops evicted during the event, in
    order; ``leave``: ``(op, bytes written back)`` of the ops exported to another stage after an
    ``end`` (0: the device copy was clean or gone). ``used_bytes``: the arena's bytes after the
    event; ``peak_bytes``: the most during it."""

    kind: str
    subnet: int | None
    action: Action | None
    hits: tuple[str, ...] = ()
    prefetched: tuple[str, ...] = ()
    fetches: tuple[Fetch, ...] = ()
    writeback: tuple[tuple[str, int], ...] = ()
    leave: tuple[tuple[str, int], ...] = ()
    used_bytes: int = 0
    peak_bytes: int = 0
    host_updates: tuple[tuple[str, int], ...] = ()  # (op, weight bytes) updated on the host at an ``end``


@dataclass(frozen=True)
class StageResidency:
    """One stage's events and their totals (``uses``: op uses by the stage's subnets)."""

    stage: int
    policy: str
    capacity: int
    prefetch_depth: int
    events: tuple[StageEvent, ...]
    uses: int
    hits: int
    prefetched: int
    misses: int
    fetched_bytes: int
    written_bytes: int
    peak_bytes: int
    arrived: int = 0  # with ``adopt="device"``: uses by an op that came from another stage into the arena
    host_updates: int = 0  # with ``weights``: uses updated on the host (hybrid placement)
    host_bytes: int = 0  # their weight bytes (the gradients sent down, the host's update)

    @property
    def hit_rate(self) -> float:
        """Uses served by a copy on the device from before (no transfer for this use)."""
        return self.hits / self.uses if self.uses else 1.0


def plan_stage(schedule: Schedule, stage: int, sizes: Mapping[str, int], capacity: int, policy: str = "belady",
               prefetch_depth: int = 2, adopt: str = "device", past_in_flight: bool = True,
               weights: Mapping[str, int] | None = None,
               host_budget: Mapping[int, float] | None = None) -> StageResidency:
    """The tensor manager's decisions on ``stage`` over ``schedule`` (the module doc).

    ``sizes[op]``: the op's bytes in the arena (weights, buffers and optimizer state on the
    device); ``capacity``: the arena's bytes. ``adopt``: where an op that moves in lands:
    ``device`` (the runtime: its state arrives in the arena when room can be made without
    evicting an op needed sooner, else in a host home and is fetched on demand; it leaves from
    the arena, no host copy either side) or ``host`` (the runtime before: always a host home,
    so its first use here fetches it, and the stage it leaves writes it back first).
    ``past_in_flight``: the fetches ahead look ``prefetch_depth + 1`` pending subnets past those
    in flight (the runtime); ``False``: the in-flight ones count in them (the runtime before).
    ``weights[op]``: the op's weight bytes, for the hybrid optimizer placement (the module doc;
    None: every op travels with its state, ``memory.optimizer=device``). ``host_budget[t]``: the
    weight bytes the host may step for subnet ``t`` here (what it steps while the subnet runs);
    past it, the subnet's ops keep their state where it fits (None: no limit, the runtime's rule).
    Raises :class:`StageResidencyError` when the ops pinned at once exceed ``capacity``.
    """
    if adopt not in ("host", "device"):
        raise StageResidencyError(f"adopt: expected 'host' or 'device', found {adopt!r}")
    if schedule.uses is None or not schedule.updates:
        raise StageResidencyError(f"plan_stage: schedule {schedule.name!r} needs uses and explicit updates "
                                  "(a cross-subnet schedule)")
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 0:
        raise StageResidencyError(f"prefetch_depth: expected an int >= 0, found {prefetch_depth!r}")
    rule = policy_named(policy)
    row = schedule.actions[stage]
    order = [a.subnet for a in row if a.kind == "F" and a.microbatch == 0]
    uses = {t: tuple(sorted(schedule.uses[t][stage])) for t in order}
    positions: dict[str, list[int]] = {}
    for i, t in enumerate(order):
        for op in uses[t]:
            positions.setdefault(op, []).append(i)
    for op in positions:
        if op not in sizes:
            raise StageResidencyError(f"sizes: op {op!r} (used on stage {stage}) has no entry")
        if weights is not None and not 0 <= weights.get(op, -1) <= sizes[op]:
            raise StageResidencyError(f"weights: expected op {op!r}'s weight bytes, at most its sizes entry "
                                      f"({sizes[op]}), found {weights.get(op)!r}")
    at = {t: i for i, t in enumerate(order)}  # a subnet's place in this stage's order
    positions_set = {op: set(ps) for op, ps in positions.items()}  # (hybrid: is an op's next subnet a user)
    # ownership: ops arrive with a subnet's first forward, leave after an update here
    arrive: dict[int, list[str]] = {}
    leave: dict[int, list[str]] = {}
    gone_at_start: set[str] = set()
    for mv in schedule.rule.moves():
        if mv.dst == stage:
            arrive.setdefault(mv.before.subnet, []).append(mv.op)
        if mv.src == stage:
            if mv.after is None:
                gone_at_start.add(mv.op)
            else:
                leave.setdefault(mv.after.subnet, []).append(mv.op)
    origin = dict(schedule.origin) if schedule.origin is not None else {}
    owned = {op for op, us in schedule.rule.users.items() if origin.get(op, us[0][1]) == stage} - gone_at_start

    res: dict[str, int] = {}  # resident op -> bytes
    last_use: dict[str, int] = {}
    dirty: set[str] = set()
    ahead: set[str] = set()
    inflight: dict[int, tuple[str, ...]] = {}
    pinned: dict[str, int] = {}  # op -> subnets in flight here that run it
    used = 0
    begun = 0  # subnets begun here (they begin in ``order``)
    tick = 0
    stateless: set[str] = set()  # resident without their optimizer state (hybrid: updated on the host)
    host_left = dict(host_budget) if host_budget is not None else None
    totals = dict(hits=0, prefetched=0, misses=0, fetched=0, written=0, peak=0, arrived=0, host=0, host_bytes=0)
    events: list[StageEvent] = []

    def next_use(op: str) -> float:
        """The op's next use as an index into the pending subnets (in flight first)."""
        ps = positions.get(op, ())
        k = bisect.bisect_left(ps, begun)
        return len(inflight) + ps[k] - begun if k < len(ps) else NEVER

    def candidates(keep) -> list[Candidate]:
        ops = sorted((op for op in res if op not in pinned and op not in keep and res[op]),
                     key=lambda op: (last_use.get(op, 0), op))
        return [Candidate(op, next_use(op), op in ahead) for op in ops]

    class _Event:
        def __init__(self) -> None:
            self.writeback: list[tuple[str, int]] = []
            self.fetches: list[Fetch] = []
            self.peak = used

    def evict(op: str, ev: _Event) -> None:
        nonlocal used
        used -= res.pop(op)
        ahead.discard(op)
        stateless.discard(op)
        if op in dirty:
            dirty.discard(op)
            ev.writeback.append((op, sizes[op]))
            totals["written"] += sizes[op]

    def make_room(n: int, limit: float | None, keep, ev: _Event) -> tuple[str, ...] | None:
        """Evict as the policy says until ``n`` bytes fit; None when a fetch ahead would have to
        evict an op needed no later than ``limit`` (what it evicted so far stays evicted)."""
        made: list[str] = []
        while used + n > capacity:
            cands = candidates(keep)
            hole = next((c for c in rule.alike(cands, limit) if capacity - used + res[c.op_id] >= n), None)
            v = hole or rule.victim(cands, limit)
            if v is None:
                if limit is not None:
                    return None
                raise StageResidencyError(
                    f"stage {stage}: no op to evict for a fetch of {n} bytes with {used} of {capacity} bytes used "
                    f"by {len(pinned)} pinned ops; expected the admission's arena bound to leave room")
            evict(v.op_id, ev)
            made.append(v.op_id)
        return tuple(made)

    def keeps_state(op: str, subnet: int) -> bool:
        """Hybrid: whether the op's use by ``subnet`` takes its state along (the next subnet in
        this stage's order runs it too, or the host's budget for the subnet is spent)."""
        if weights is None or at[subnet] + 1 in positions_set[op]:
            return True
        return host_left is not None and host_left.get(subnet, 0.0) < weights[op]

    def size_for(op: str, subnet: int, pinned_bytes: int) -> int:
        """The bytes a fetch of ``op`` for ``subnet`` brings: with its state when the rule says
        so and it fits beside ``pinned_bytes`` of ops held with it, else its weights."""
        if weights is None:
            return sizes[op]
        if keeps_state(op, subnet) and pinned_bytes + sizes[op] <= capacity:
            return sizes[op]
        return weights[op]

    def place(op: str, subnet: int, victims: tuple[str, ...], ev: _Event, n: int | None = None) -> None:
        nonlocal used
        n = res[op] = sizes[op] if n is None else n
        if n < sizes[op]:
            stateless.add(op)
            if host_left is not None:
                host_left[subnet] = host_left.get(subnet, 0.0) - weights[op]
        used += n
        totals["fetched"] += n
        ev.fetches.append(Fetch(op, n, subnet, victims))
        ev.peak = max(ev.peak, used)

    def pump(ev: _Event) -> None:
        if not rule.prefetches:
            return
        pending = [t for t in order[:begun] if t in inflight] + order[begun:]
        for idx, t in enumerate(pending[: (len(inflight) if past_in_flight else 0) + prefetch_depth + 1]):
            keep = uses[t] if rule.spares_fetched_step else ()
            for op in uses[t]:
                if op not in owned or op in res or not sizes[op]:
                    continue
                n, victims = sizes[op], None
                if weights is not None:  # (the runtime's working set: with the state if room can be made for it)
                    if keeps_state(op, t):
                        victims = make_room(n, idx, keep, ev)
                    if victims is None:
                        n = weights[op]
                if victims is None:
                    victims = make_room(n, idx, keep, ev)
                if victims is None:
                    return  # full of ops needed no later than this one
                place(op, t, victims, ev, n)
                ahead.add(op)

    def close(kind: str, t: int | None, a: Action | None, ev: _Event, **kw) -> None:
        totals["peak"] = max(totals["peak"], ev.peak, used)
        events.append(StageEvent(kind, t, a, fetches=tuple(ev.fetches), writeback=tuple(ev.writeback),
                                 used_bytes=used, peak_bytes=max(ev.peak, used), **kw))

    ev = _Event()
    pump(ev)
    close("start", None, None, ev)
    for a in row:
        if a.kind == "F" and a.microbatch == 0:
            t = a.subnet
            ev = _Event()
            owned.update(arrive.get(t, ()))
            landed = set(arrive.get(t, ())) if adopt == "device" else set()
            need = uses[t]
            fresh = [op for op in need if op not in pinned or op not in res]
            for op in need:
                pinned[op] = pinned.get(op, 0) + 1
            inflight[t] = need
            begun += 1
            hits, pre = [], []
            for op in need:
                if op not in fresh:
                    hits.append(op)  # pinned by another subnet in flight here: resident
            for op in fresh:
                tick += 1
                last_use[op] = tick
                if op in res:
                    (pre if op in ahead else hits).append(op)
                elif op in landed and make_room(sizes[op], len(inflight) - 1, (), ev) is not None:
                    res[op] = sizes[op]  # its state came over the stage link into the arena
                    used += sizes[op]
                    totals["arrived"] += 1
                else:
                    n = size_for(op, t, sum(res.get(o, 0) for o in pinned if o != op))
                    victims = make_room(n, None, (), ev)
                    place(op, t, victims, ev, n)
                ahead.discard(op)
                if op not in schedule.frozen and op not in stateless:
                    dirty.add(op)  # its update runs on the device while it is pinned
            ev.peak = max(ev.peak, used)
            if used > capacity:
                raise StageResidencyError(
                    f"stage {stage}, subnet {t}: {len(pinned)} pinned ops take {used} bytes, over the arena's "
                    f"{capacity}; expected the admission's arena bound to keep them within it")
            totals["hits"] += len(hits)
            totals["prefetched"] += len(pre)
            totals["misses"] += len(ev.fetches)
            close("begin", t, a, ev, hits=tuple(hits), prefetched=tuple(pre))
        elif a.kind == "U":
            t = a.subnet
            ev = _Event()
            hosted = []
            for op in inflight.pop(t):
                pinned[op] -= 1
                if op in stateless and op not in schedule.frozen:
                    hosted.append((op, weights[op]))  # its gradients go home, the host steps it
                if not pinned[op]:
                    del pinned[op]
                    if op in stateless:  # the host's update leaves the device copy stale
                        evict(op, ev)
            totals["host"] += len(hosted)
            totals["host_bytes"] += sum(n for _, n in hosted)
            pump(ev)
            left = []
            for op in leave.get(t, ()):
                n = 0
                if op in res:
                    if op in dirty and adopt == "host":
                        n = sizes[op]
                        dirty.discard(op)
                        totals["written"] += n
                    used -= res.pop(op)
                    ahead.discard(op)
                    dirty.discard(op)
                owned.discard(op)
                left.append((op, n))
            close("end", t, a, ev, leave=tuple(left), host_updates=tuple(hosted))
    return StageResidency(stage, rule.name, capacity, prefetch_depth, tuple(events),
                          sum(len(uses[t]) for t in order), totals["hits"], totals["prefetched"], totals["misses"],
                          totals["fetched"], totals["written"], totals["peak"], totals["arrived"], totals["host"],
                          totals["host_bytes"])


def residency_copies(schedule: Schedule, plans: Sequence[StageResidency], timed_start: bool = True,
                     more: Mapping[Action, Sequence[tuple[str, float]]] | None = None,
                     duplex: bool = True) -> list[Copy]:
    """The host-channel jobs of ``plans`` (one per stage) for :func:`~pipeline.plan.simulate.simulate`
    (the module doc). ``duplex=True``: write-backs on ``d2h`` beside the fetches (two streams, a
    full-duplex link: the runtime's copier); ``False``: both share one FIFO (channel ``h2d``), as
    the runtime's copier issued them before on one stream. ``timed_start=False``: the segment's first fetches
    ahead were made before it began (a warm arena), so they cost nothing here. ``more[F0]``:
    further jobs ``(channel, bytes)`` of a subnet's first forward's stage, after that forward
    (activation swaps, ...)."""
    copies: list[Copy] = []
    more = more or {}
    back = "d2h" if duplex else "h2d"
    for plan in plans:
        s = plan.stage
        row = schedule.actions[s]
        prev = {a: row[k - 1] if k else None for k, a in enumerate(row)}
        after_u = {a: row[k + 1] for k, a in enumerate(row[:-1]) if a.kind == "U"}
        written: dict[str, int] = {}  # op -> index of its last write-back copy
        stepped: dict[str, int] = {}  # op -> index of its last host update (hybrid)

        def jobs(ev: StageEvent, after: Action | None, ready: float, sent: Action | None = None) -> None:
            """``sent``: the event's copies also wait for that action (the input's send): a job of
            no bytes on each channel they use, just before them (the host channel, where it once
            waited, may be busy with updates)."""
            gates: dict[str, tuple[int, ...]] = {}

            def gate(channel: str) -> tuple[int, ...]:
                if sent is None or not ev.fetches:
                    return ()
                if channel not in gates:
                    gates[channel] = (len(copies),)
                    copies.append(Copy(s, channel, 0.0, after=sent, label="input sent"))
                return gates[channel]

            for op, n in ev.writeback:
                g = gate(back)
                written[op] = len(copies)
                copies.append(Copy(s, back, n, ready=ready, after=after, waits_for=g, label=f"writeback {op}"))
            for f in ev.fetches:
                waits = gate("h2d") + tuple(written[v] for v in f.victims if v in written)
                if f.op in stepped:  # its weights come up once the host has stepped it
                    waits += (stepped[f.op],)
                copies.append(Copy(s, "h2d", f.nbytes, ready=ready, after=after,
                                   before=Action(s, "F", 0, f.subnet), waits_for=waits, label=f.op))

        for ev in plan.events:
            if ev.kind == "start":
                if timed_start:
                    jobs(ev, None, 0.0)
            elif ev.kind == "begin":
                # the store hears of the forward once the stage is free and its input was sent
                jobs(ev, prev[ev.action], 0.0, Action(s - 1, "F", 0, ev.subnet) if s > 0 else None)
                for ch, n in more.get(ev.action, ()):
                    if n:
                        copies.append(Copy(s, ch, n, ready=0.0, after=ev.action, label=f"{ch} more"))
            else:
                for op, n in ev.host_updates:  # the gradients down, then the host's step of the op
                    copies.append(Copy(s, back, n, ready=0.0, after=ev.action, label=f"grads {op}"))
                    stepped[op] = len(copies)
                    copies.append(Copy(s, "host", n, ready=0.0, after=ev.action, waits_for=(len(copies) - 1,),
                                       label=f"host update {op}"))
                jobs(ev, ev.action, 0.0)
                nxt = after_u.get(ev.action)
                for op, n in ev.leave:
                    if n:  # the export waits for the write-back; the stage's next action waits for the export
                        copies.append(Copy(s, back, n, ready=0.0, after=ev.action, before=nxt,
                                           label=f"export {op}"))
    return copies
