"""The framework-free search-space API: labelled choices and frozen architectures.

A search space is a tuple of :class:`Choice` (a label and the values it may take). An
:class:`Arch` is a frozen ``label -> value`` mapping. Nothing here knows about torch or
networkx; the supernet graph derives its :class:`SearchSpace` from its choice slots, and a
user can build one by hand. Every random operation takes the generator as an argument.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from .errors import SearchSpaceError

__all__ = ["Choice", "Arch", "SearchSpace"]

_SCALARS = (str, int, float, bool)


@dataclass(frozen=True)
class Choice:
    """One labelled decision: ``label`` takes exactly one of ``values``."""

    label: str
    values: tuple[Hashable, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not self.label:
            raise SearchSpaceError(f"choice label: expected a non-empty string, found {self.label!r}")
        values = tuple(self.values)
        object.__setattr__(self, "values", values)
        if not values:
            raise SearchSpaceError(f"choice {self.label!r}: expected at least one value, found none")
        if len(set(values)) != len(values):
            raise SearchSpaceError(f"choice {self.label!r}: values must be distinct, found {list(values)}")
        for v in values:
            if not isinstance(v, _SCALARS):
                raise SearchSpaceError(
                    f"choice {self.label!r}: values must be str/int/float/bool (JSON scalars), found {v!r}"
                )


class Arch(Mapping):
    """A frozen, hashable ``label -> value`` mapping: one architecture.

    Labels are kept sorted, so equal archs compare, hash, print and encode the same.
    """

    __slots__ = ("_items",)

    def __init__(self, choices: Mapping[str, Hashable] | Iterable[tuple[str, Hashable]] = ()) -> None:
        items = dict(choices)
        self._items: tuple[tuple[str, Hashable], ...] = tuple(sorted(items.items()))

    def __getitem__(self, label: str) -> Hashable:
        for k, v in self._items:
            if k == label:
                return v
        raise KeyError(label)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Arch):
            return self._items == other._items
        if isinstance(other, Mapping):
            return dict(self._items) == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return "Arch(" + ", ".join(f"{k}={v!r}" for k, v in self._items) + ")"

    def replace(self, **changes: Hashable) -> Arch:
        """A copy with some labels set to other values (not validated)."""
        d = dict(self._items)
        d.update(changes)
        return Arch(d)

    def to_json(self) -> str:
        return json.dumps(dict(self._items), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Arch:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SearchSpaceError(f"arch JSON: expected a JSON object, could not parse it ({e})") from None
        if not isinstance(data, dict):
            raise SearchSpaceError(f"arch JSON: expected an object label -> value, found {type(data).__name__}")
        return cls(data)

    def digest(self) -> str:
        """A short stable hash of the arch (hex), the same on every process and machine."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


class SearchSpace:
    """A finite product space of labelled choices.

    ``validate`` checks an arch and names the bad label and the valid values; ``random``,
    ``mutate`` and ``crossover`` take a ``random.Random`` so that a search is reproducible.
    """

    def __init__(self, choices: Iterable[Choice]) -> None:
        self.choices: tuple[Choice, ...] = tuple(choices)
        self._by_label = {c.label: c for c in self.choices}
        if len(self._by_label) != len(self.choices):
            seen: set[str] = set()
            dup = next(c.label for c in self.choices if c.label in seen or seen.add(c.label))
            raise SearchSpaceError(f"search space: labels must be unique, {dup!r} appears twice")

    # -- queries ---------------------------------------------------------------------------
    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(c.label for c in self.choices)

    def choice(self, label: str) -> Choice:
        try:
            return self._by_label[label]
        except KeyError:
            raise SearchSpaceError(
                f"unknown label {label!r}: expected one of {_preview(self.labels)}"
            ) from None

    def size(self) -> int:
        """The number of distinct architectures (a Python int: it can be astronomically big)."""
        return math.prod(len(c.values) for c in self.choices)

    def __len__(self) -> int:
        return len(self.choices)

    def __repr__(self) -> str:
        return f"SearchSpace({len(self.choices)} choices, size={self.size():.3e})"

    # -- validation ------------------------------------------------------------------------
    def validate(self, arch: Mapping[str, Hashable], where: str = "arch") -> Arch:
        """Return ``arch`` as an :class:`Arch` if it picks a valid value for every label.

        Raises :class:`SearchSpaceError` naming the first bad label (``where`` prefixes the
        path, e.g. ``search.seed_archs[2]``) and listing what was expected.
        """
        if not isinstance(arch, Mapping):
            raise SearchSpaceError(f"{where}: expected a mapping label -> value, found {type(arch).__name__}")
        extra = sorted(set(arch) - set(self._by_label))
        if extra:
            raise SearchSpaceError(
                f"{where}.{extra[0]}: unknown label; expected labels are {_preview(self.labels)}"
            )
        for c in self.choices:
            if c.label not in arch:
                raise SearchSpaceError(f"{where}.{c.label}: missing; expected one of {list(c.values)}")
            if arch[c.label] not in c.values:
                raise SearchSpaceError(
                    f"{where}.{c.label}: expected one of {list(c.values)}, found {arch[c.label]!r}"
                )
        return arch if isinstance(arch, Arch) else Arch(arch)

    # -- random operations -----------------------------------------------------------------
    def random(self, rng: random.Random) -> Arch:
        return Arch({c.label: c.values[rng.randrange(len(c.values))] for c in self.choices})

    def mutate(self, arch: Arch, rng: random.Random, prob: float = 0.1) -> Arch:
        """Resample each label with probability ``prob`` (to a different value where one exists).

        At least one label changes when any label has two or more values, so a mutation is
        never a silent copy.
        """
        if not 0.0 <= prob <= 1.0:
            raise SearchSpaceError(f"mutate prob: expected a value in [0, 1], found {prob}")
        arch = self.validate(arch)
        d = dict(arch)
        mutable = [c for c in self.choices if len(c.values) > 1]
        changed = False
        for c in mutable:
            if rng.random() < prob:
                d[c.label] = _other_value(c, d[c.label], rng)
                changed = True
        if not changed and mutable:
            c = mutable[rng.randrange(len(mutable))]
            d[c.label] = _other_value(c, d[c.label], rng)
        return Arch(d)

    def crossover(self, a: Arch, b: Arch, rng: random.Random) -> Arch:
        """Uniform crossover: each label comes from ``a`` or ``b`` with equal chance."""
        a, b = self.validate(a, "crossover.a"), self.validate(b, "crossover.b")
        return Arch({c.label: (a[c.label] if rng.random() < 0.5 else b[c.label]) for c in self.choices})

    # -- JSON ------------------------------------------------------------------------------
    def encode(self, arch: Arch) -> str:
        return self.validate(arch).to_json()

    def decode(self, text: str, where: str = "arch") -> Arch:
        return self.validate(Arch.from_json(text), where)


def _other_value(c: Choice, current: Hashable, rng: random.Random) -> Hashable:
    others = [v for v in c.values if v != current]
    return others[rng.randrange(len(others))]


def _preview(items: tuple[str, ...], limit: int = 12) -> str:
    shown = ", ".join(repr(x) for x in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}] ({len(items)} in all)"
