"""Architecture samplers for supernet training: deterministic streams with lookahead.

A sampler is built from ``(space, seed)`` and yields one :class:`supernet.Arch` per training
step. ``next()`` consumes an arch, ``peek(k)`` returns the next ``k`` without consuming them
(a pipeline planner may want to see what comes), and the stream depends on the seed alone.
``state_dict()`` stores how many archs were consumed; ``load_state_dict()`` rebuilds the
stream from the seed and replays that many, which is always right and cheap.

* ``uniform`` — single-path one-shot (SPOS): every label drawn uniformly and independently.
* ``fair`` — strict fairness (FairNAS): archs come in rounds of ``n`` (the largest number of
  values of any label); within a round every value of a label with ``n`` values is used
  exactly once. A label with fewer values draws from back-to-back shuffled passes over its
  values, so its counts never differ by more than one and are equal after every full pass.
* ``fixed`` — one given arch every step: the supernet trains that subnet alone (its other
  ops get no gradient), which is stand-alone training through the same engine
  (``bench/ranking.py`` uses it for the ground truth). From the command line:
  ``sampler=fixed sampler.arch='{layer00: k3e3, ...}'``, with ``search=none`` to train (and score)
  only that arch.

``order``: ``stream`` yields the archs as drawn. ``locality`` cuts the drawn stream into blocks
(a fair round; ``block`` draws for ``uniform``, by default as many as a fair round) and yields
each block in :func:`search.order.locality_order`, archs that reuse recently used ops first: the
same archs per block, so the same fairness counts per round, in an order meant to raise the
tensor manager's hit rate. Either order is a pure function of ``(space, seed, order, block)``.
"""
from __future__ import annotations

import hashlib
import json
import random
from collections import deque
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

from supernet import Arch, SearchSpace

from .order import locality_order, record_uses

__all__ = ["Sampler", "UniformSampler", "FairSampler", "FixedSampler", "SamplerError", "SAMPLERS", "ORDERS",
           "make_sampler", "check_order"]

ORDERS = ("stream", "locality")


class SamplerError(ValueError):
    """A sampler was built or restored with bad input."""


class Sampler:
    """A deterministic arch stream with lookahead. Subclasses define :meth:`_stream`."""

    kind = "base"

    def __init__(self, space: SearchSpace, seed: int, order: str = "stream", block: int | None = None) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise SamplerError(f"sampler seed: expected an integer, found {seed!r}")
        if len(space) == 0:
            raise SamplerError("sampler: the search space has no choices; there is nothing to sample")
        check_order(self.kind, order, block)
        self.space = space
        self.seed = seed
        self.order = order
        self._block = block
        self._reset()

    def _reset(self) -> None:
        stream = self._stream(random.Random(self.seed))
        self._it: Iterator[Arch] = stream if self.order == "stream" else self._reordered(stream)
        self._buffer: deque[Arch] = deque()
        self._consumed = 0

    def _stream(self, rng: random.Random) -> Iterator[Arch]:
        raise NotImplementedError

    @property
    def block(self) -> int | None:
        """How many drawn archs the locality order permutes at a time; None with ``order=stream``."""
        return None if self.order == "stream" else self._block_size()

    def _block_size(self) -> int:
        # by default a fair round's size, which for the fair sampler (no block of its own) keeps
        # each round's archs together
        return self._block if self._block is not None else _widest(self.space)

    def _reordered(self, stream: Iterator[Arch]) -> Iterator[Arch]:
        # Whole blocks are drawn before any is yielded, so the order is a pure function of the
        # drawn stream whatever the consumer's peeking pattern.
        n, step, last_use = self._block_size(), 0, {}
        while True:
            block = [next(stream) for _ in range(n)]
            ordered = [block[i] for i in locality_order(block, last_use, step)]
            last_use = record_uses(ordered, last_use, step)
            step += n
            yield from ordered

    @property
    def consumed(self) -> int:
        """How many archs ``next()`` has returned since the start of the stream."""
        return self._consumed

    def next(self) -> Arch:
        arch = self._buffer.popleft() if self._buffer else next(self._it)
        self._consumed += 1
        return arch

    def __iter__(self) -> Iterator[Arch]:
        while True:
            yield self.next()

    def peek(self, k: int = 1) -> list[Arch]:
        """The next ``k`` archs, exactly what ``next()`` will return, without consuming them."""
        if k < 0:
            raise SamplerError(f"sampler peek: expected k >= 0, found {k}")
        while len(self._buffer) < k:
            self._buffer.append(next(self._it))
        return list(self._buffer)[:k]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "seed": self.seed, "space": space_digest(self.space), "order": self.order,
                "block": self.block, "consumed": self._consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a stream position saved by :meth:`state_dict` (replays from the seed). A state
        without ``order`` (written before there was a choice) is of the ``stream`` order."""
        saved = {"order": "stream", "block": None, **state}
        mine = {"kind": self.kind, "seed": self.seed, "space": space_digest(self.space), "order": self.order,
                "block": self.block}
        for key, value in mine.items():
            if saved.get(key) != value:
                raise SamplerError(
                    f"sampler state: saved {key} is {saved.get(key)!r} but this sampler has {value!r}; "
                    "a checkpoint can only resume the run (sampler, seed, space, order) that wrote it"
                )
        consumed = state.get("consumed")
        if not isinstance(consumed, int) or consumed < 0:
            raise SamplerError(f"sampler state: expected consumed >= 0, found {consumed!r}")
        self._reset()
        for _ in range(consumed):
            self.next()


class UniformSampler(Sampler):
    """Single-path uniform sampling (SPOS)."""

    kind = "uniform"

    def _stream(self, rng: random.Random) -> Iterator[Arch]:
        while True:
            yield self.space.random(rng)


class FairSampler(Sampler):
    """Strict-fair sampling (FairNAS), see the module docstring."""

    kind = "fair"

    @property
    def round_size(self) -> int:
        return _widest(self.space)

    def _stream(self, rng: random.Random) -> Iterator[Arch]:
        n = self.round_size
        passes = {c.label: _passes(c.values, rng) for c in self.space.choices}
        while True:
            # Labels are drawn in space order, one round at a time, so the stream is a pure
            # function of the seed whatever the consumer's peeking pattern.
            columns = {label: [next(it) for _ in range(n)] for label, it in passes.items()}
            for i in range(n):
                yield Arch({label: col[i] for label, col in columns.items()})


class FixedSampler(Sampler):
    """The same arch every step (stand-alone training of that subnet)."""

    kind = "fixed"

    def __init__(self, space: SearchSpace, seed: int, arch: Arch, order: str = "stream",
                 block: int | None = None) -> None:
        self.arch = arch
        super().__init__(space, seed, order, block)

    def _stream(self, rng: random.Random) -> Iterator[Arch]:
        while True:
            yield self.arch

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "arch": self.arch.to_json()}


def _widest(space: SearchSpace) -> int:
    """The most values of any label: a fair round's size."""
    return max(len(c.values) for c in space.choices)


def _passes(values: tuple[Hashable, ...], rng: random.Random) -> Iterator[Hashable]:
    """Back-to-back shuffled passes over ``values``: each value once per pass."""
    while True:
        order = list(values)
        rng.shuffle(order)
        yield from order


def space_digest(space: SearchSpace) -> str:
    """A short hash of the space's labels and values, to match a saved state to its space."""
    text = json.dumps([[c.label, list(c.values)] for c in space.choices], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


SAMPLERS: dict[str, type[Sampler]] = {"uniform": UniformSampler, "fair": FairSampler, "fixed": FixedSampler}


def check_order(name: str, order: str, block: int | None) -> None:
    """Which samplers take which ``sampler.order`` and ``sampler.block``: SamplerError naming the field."""
    if order not in ORDERS:
        raise SamplerError(f"sampler.order: expected one of {list(ORDERS)}, found {order!r}")
    if name == "fixed" and order != "stream":
        raise SamplerError(f"sampler.order: expected 'stream' for the fixed sampler (one arch every step: nothing "
                           f"to reorder), found {order!r}")
    if block is None:
        return
    if not isinstance(block, int) or isinstance(block, bool) or block < 2:
        raise SamplerError(f"sampler.block: expected an integer >= 2 or null, found {block!r}")
    if name != "uniform":
        raise SamplerError(f"sampler.block: expected null for the {name} sampler (only uniform draws are cut into "
                           f"blocks; a fair round is the fair sampler's block), found {block!r}")
    if order != "locality":
        raise SamplerError(f"sampler.block: expected null with sampler.order={order} (only the locality order cuts "
                           f"the stream into blocks), found {block!r}")


def make_sampler(name: str, space: SearchSpace, seed: int, arch: Mapping[str, Any] | None = None,
                 order: str = "stream", block: int | None = None) -> Sampler:
    """The sampler ``name``; ``fixed`` takes the arch it trains (validated against ``space``);
    ``order`` and ``block`` as in the module docstring."""
    try:
        cls = SAMPLERS[name]
    except KeyError:
        raise SamplerError(f"sampler.name: expected one of {sorted(SAMPLERS)}, found {name!r}") from None
    if name == "fixed":
        if arch is None:
            raise SamplerError("sampler.arch: the fixed sampler needs the arch to train, e.g. "
                               "sampler.arch={layer00: k3e3, ...}; found null")
        return FixedSampler(space, seed, space.validate(arch, "sampler.arch"), order, block)
    if arch is not None:
        raise SamplerError(f"sampler.arch: only the fixed sampler takes an arch; sampler {name!r} found {dict(arch)!r}")
    return cls(space, seed, order, block)
