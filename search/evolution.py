"""Architecture search over a trained supernet: evolution, random search and subnet costs.

Both searches take a ``scorer`` (arch -> float, higher is better; in the app it is the
validation accuracy of the subnet with inherited weights), a seeded ``random.Random`` and an
optional ``constraint`` (arch -> bool). Scores are memoised per arch, archs that break the
constraint are never scored, and the evaluation budget counts distinct scored archs, so the
two searches compare at equal cost. Ties are broken by the arch's JSON, so a search is the
same on every process.

A search proposes a whole batch before scoring any of it (random search: every arch;
evolution: a generation, bred from the parents ranked before it), so the random stream never
depends on how a batch is scored. A :class:`BatchScorer` gets each batch at once (the app
scores a batch's archs in parallel on every process); a plain scorer is called once per arch,
in proposal order.

Evolution (as in single-path one-shot NAS): generation 0 is the seed archs plus random ones,
``population`` in all; every later generation breeds ``population`` new archs from the best
``parents`` seen so far, by crossover (with probability ``crossover_prob``) or mutation.

:class:`SubnetCost` gives a subnet's parameter count (ops built on the meta device) and its
forward FLOPs per sample (``torch.utils.flop_counter.FlopCounterMode``, meta tensors).
"""
from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from supernet import ActiveOp, Arch, SearchSpace, SupernetGraph, build_op
from supernet.supernet import forward_ops

__all__ = [
    "Candidate", "SearchResult", "SearchError", "evolution_search", "random_search",
    "SubnetCost", "Constraints", "BatchScorer",
]

log = logging.getLogger(__name__)

Scorer = Callable[[Arch], float]
Constraint = Callable[[Arch], bool]


@dataclass(frozen=True)
class BatchScorer:
    """A scorer that takes a batch of distinct archs at once and returns their scores in the
    same order (``fn``); a search hands it each batch it proposes."""

    fn: Callable[[Sequence[Arch]], Sequence[float]]


class SearchError(ValueError):
    """A search was asked for with bad settings."""


@dataclass(frozen=True)
class Candidate:
    arch: Arch
    score: float


@dataclass(frozen=True)
class SearchResult:
    """The best ``top_k`` archs (best first), how many archs were scored, and the best score
    after each generation (one entry for random search)."""

    top: tuple[Candidate, ...]
    evaluated: int
    history: tuple[float, ...] = field(default=())

    @property
    def best(self) -> Candidate:
        return self.top[0]


class _Memo:
    """Memoised scoring with a budget and a deterministic ranking."""

    def __init__(self, scorer: Scorer | BatchScorer, constraint: Constraint | None) -> None:
        self.scorer = scorer
        self.constraint = constraint
        self.scores: dict[Arch, float] = {}
        self._allowed: dict[Arch, bool] = {}

    def allowed(self, arch: Arch) -> bool:
        if self.constraint is None:
            return True
        if arch not in self._allowed:
            self._allowed[arch] = bool(self.constraint(arch))
        return self._allowed[arch]

    def score_all(self, archs: Sequence[Arch]) -> None:
        """Score the archs of a batch not scored yet, in order (a batch scorer: all at once)."""
        fresh = [a for a in dict.fromkeys(archs) if a not in self.scores]
        if not fresh:
            return
        if isinstance(self.scorer, BatchScorer):
            values = list(self.scorer.fn(fresh))
            if len(values) != len(fresh):
                raise SearchError(f"search: the batch scorer returned {len(values)} scores for {len(fresh)} archs")
            pairs = zip(fresh, values)
        else:
            pairs = ((a, self.scorer(a)) for a in fresh)  # lazily: each recorded before the next is scored
        for arch, value in pairs:
            s = float(value)
            if math.isnan(s):
                s = -math.inf  # a NaN would make the ranking order-dependent
            self.scores[arch] = s

    def ranked(self) -> list[Candidate]:
        return [Candidate(a, s) for a, s in sorted(self.scores.items(), key=lambda e: (-e[1], e[0].to_json()))]


def _check(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise SearchError(f"search.{name}: expected an integer >= {minimum}, found {value!r}")


def _fresh(memo: _Memo, propose: Callable[[], Arch], tries: int, batch: Sequence[Arch]) -> Arch | None:
    """A proposed arch that is neither scored yet, nor in the ``batch`` being proposed, nor
    outside the constraint, or ``None``."""
    for _ in range(tries):
        arch = propose()
        if arch not in memo.scores and arch not in batch and memo.allowed(arch):
            return arch
    return None


def _seeded(space: SearchSpace, seed_archs: Iterable[Arch], memo: _Memo) -> list[Arch]:
    out = []
    for i, a in enumerate(seed_archs):
        arch = space.validate(a, f"search.seed_archs[{i}]")
        if memo.allowed(arch) and arch not in out:
            out.append(arch)
    return out


def _fill(memo: _Memo, space: SearchSpace, rng: random.Random, seed_archs: Sequence[Arch], count: int,
          max_tries: int) -> None:
    """Score archs until ``count`` are scored: the seed archs first, then fresh random ones
    (stops early when no fresh arch satisfying the constraint turns up), as one batch."""
    batch = _seeded(space, seed_archs, memo)[:count]
    while len(memo.scores) + len(batch) < count:
        arch = _fresh(memo, lambda: space.random(rng), max_tries, batch)
        if arch is None:
            break
        batch.append(arch)
    memo.score_all(batch)


def random_search(
    space: SearchSpace, scorer: Scorer | BatchScorer, rng: random.Random, *, budget: int, top_k: int = 5,
    constraint: Constraint | None = None, seed_archs: Sequence[Arch] = (), max_tries: int = 100,
) -> SearchResult:
    """Score ``budget`` distinct random archs (seed archs first) that satisfy ``constraint``."""
    _check("budget", budget, 1)
    _check("top_k", top_k, 1)
    memo = _Memo(scorer, constraint)
    _fill(memo, space, rng, seed_archs, budget, max_tries)
    return _result(memo, top_k, constraint, [])


def evolution_search(
    space: SearchSpace, scorer: Scorer | BatchScorer, rng: random.Random, *, population: int, generations: int,
    mutate_prob: float = 0.1, crossover_prob: float = 0.5, parents: int | None = None, top_k: int = 5,
    constraint: Constraint | None = None, seed_archs: Sequence[Arch] = (), max_tries: int = 100,
) -> SearchResult:
    """Evolutionary search; scores at most ``population * generations`` distinct archs."""
    _check("population", population, 2)
    _check("generations", generations, 1)
    _check("top_k", top_k, 1)
    if not 0.0 <= mutate_prob <= 1.0:
        raise SearchError(f"search.mutate_prob: expected a probability in [0, 1], found {mutate_prob!r}")
    if not 0.0 <= crossover_prob <= 1.0:
        raise SearchError(f"search.crossover_prob: expected a probability in [0, 1], found {crossover_prob!r}")
    parents = max(2, population // 2) if parents is None else parents
    _check("parents", parents, 1)

    memo = _Memo(scorer, constraint)
    history: list[float] = []
    _fill(memo, space, rng, seed_archs, population, max_tries)
    if not memo.scores:
        return _result(memo, top_k, constraint, history)
    history.append(memo.ranked()[0].score)

    for _ in range(1, generations):
        pool = [c.arch for c in memo.ranked()[:parents]]

        def child() -> Arch:
            if len(pool) > 1 and rng.random() < crossover_prob:
                a, b = rng.sample(pool, 2)
                return space.crossover(a, b, rng)
            return space.mutate(pool[rng.randrange(len(pool))], rng, mutate_prob)

        born: list[Arch] = []  # this generation, proposed in full before any of it is scored
        while len(born) < population:
            arch = _fresh(memo, child, max_tries, born)
            if arch is None:
                break
            born.append(arch)
        memo.score_all(born)
        history.append(memo.ranked()[0].score)
        if len(born) < population:
            log.info("evolution: the neighbourhood of the parents is exhausted; stopping early")
            break
    return _result(memo, top_k, constraint, history)


def _result(memo: _Memo, top_k: int, constraint: Constraint | None, history: list[float]) -> SearchResult:
    ranked = memo.ranked()
    if not ranked:
        raise SearchError(
            "search: found no architecture that satisfies search.constraints "
            "(max_params / max_flops); loosen them" if constraint is not None else
            "search: found no architecture to score"
        )
    return SearchResult(tuple(ranked[:top_k]), len(ranked), tuple(history or [ranked[0].score]))


# -- subnet costs ---------------------------------------------------------------------------

class SubnetCost:
    """Parameter counts and forward FLOPs (per sample) of subnets of ``graph``.

    Parameters: the sum of ``numel`` over the active ops, each built on the meta device (no
    memory, no init). FLOPs: ``FlopCounterMode`` over one forward of the subnet in eval mode
    on a meta tensor of batch 1. It counts the ops torch has formulas for — matmuls,
    convolutions, attention — at 2 FLOPs per multiply-add, and ignores element-wise ops,
    norms and pooling, which are cheap beside them. If some op cannot run on meta tensors,
    the forward runs instead on zeros on the CPU, building only the active ops there (the
    same count, slower).
    """

    def __init__(self, graph: SupernetGraph, input_shape: Sequence[int], seed: int = 0) -> None:
        self.graph = graph
        self.input_shape = tuple(int(d) for d in input_shape)
        self.seed = seed
        self._op_params: dict[str, int] = {}
        self._flops: dict[Arch, int] = {}
        self._modules: dict[str, nn.Module] = {}
        self._device = "meta"

    def _module(self, op: ActiveOp) -> nn.Module:
        if op.op_id not in self._modules:
            with torch.device(self._device):
                self._modules[op.op_id] = build_op(op.spec, op.op_id, self.seed)
        return self._modules[op.op_id]

    def params(self, arch: Arch) -> int:
        total = 0
        for op in self.graph.active_ops(arch):
            if op.op_id not in self._op_params:
                with torch.device("meta"):
                    module = build_op(op.spec, op.op_id, self.seed)
                self._op_params[op.op_id] = sum(p.numel() for p in module.parameters())
            total += self._op_params[op.op_id]
        return total

    def cheapest(self, space: SearchSpace, measure: str) -> tuple[Arch, int]:
        """The arch of ``space`` with the fewest ``measure`` (``"params"`` or ``"flops"``) and
        that count, found without training. Both are sums over the active ops, and a slot's
        candidates read and produce the same shapes (every op downstream runs whichever is
        chosen), so each slot's cheapest candidate can be chosen alone. A candidate's FLOPs are
        its arch's FLOPs minus the base arch's (the first value of every slot)."""
        count = self.params if measure == "params" else self.flops
        base = Arch({c.label: c.values[0] for c in space.choices})
        best = dict(base)
        for c in space.choices:
            best[c.label] = min(c.values, key=lambda v: count(Arch({**base, c.label: v})))
        arch = Arch(best)
        return arch, count(arch)

    def flops(self, arch: Arch) -> int:
        if arch not in self._flops:
            try:
                self._flops[arch] = self._count(arch)
            except Exception as e:  # an op without a meta kernel: count on real CPU tensors
                if self._device != "meta":
                    raise
                log.info("FLOP count on meta tensors failed (%s); counting on CPU instead", e)
                self._device, self._modules = "cpu", {}
                self._flops[arch] = self._count(arch)
        return self._flops[arch]

    def _count(self, arch: Arch) -> int:
        active = self.graph.active_ops(arch)
        modules = nn.ModuleDict({op.op_id: self._module(op) for op in active})
        x = torch.zeros((1, *self.input_shape), device=self._device)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            forward_ops(active, modules, x, self.graph.output, self.seed, 0, 0, training=False)
        return int(counter.get_total_flops())


@dataclass(frozen=True)
class Constraints:
    """Upper bounds on a subnet's cost; ``None`` means no bound."""

    max_params: int | None = None
    max_flops: int | None = None

    @property
    def active(self) -> bool:
        return self.max_params is not None or self.max_flops is not None

    def check_feasible(self, space: SearchSpace, cost: SubnetCost) -> None:
        """Raise :class:`SearchError` when no arch of ``space`` can meet a bound: the cheapest
        arch's parameters (FLOPs) exceed ``max_params`` (``max_flops``). Nothing is trained."""
        for field_, limit in (("params", self.max_params), ("flops", self.max_flops)):
            if limit is None:
                continue
            arch, least = cost.cheapest(space, field_)
            if least > limit:
                raise SearchError(
                    f"search.constraints.max_{field_}: expected at least {least}, the fewest {field_} of any "
                    f"architecture of the space ({arch.to_json()}), found {limit}; no architecture can meet it"
                )

    def check(self, cost: SubnetCost) -> Constraint | None:
        """The constraint as an ``arch -> bool`` callable, or ``None`` when unconstrained."""
        if not self.active:
            return None

        def ok(arch: Arch) -> bool:
            if self.max_params is not None and cost.params(arch) > self.max_params:
                return False
            return self.max_flops is None or cost.flops(arch) <= self.max_flops

        return ok
