"""The built-in search spaces by name; importing this package registers every space's ops.

Each space module exposes ``build(*, input_shape, num_classes, **options) -> SupernetGraph``
and registers its own ops with ``@register_op`` on import. Importing any one space module
imports this package first, and so registers the ops of all of them: a graph built by one
space can be turned into a :class:`~supernet.Supernet` wherever ``supernet.spaces`` (or any
of its modules) was imported. Hydra configs name a builder directly
(``_target_: supernet.spaces.transformer.build``); :func:`build_space` is the by-name form.
"""
from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..errors import SupernetError
from ..graph import SupernetGraph

__all__ = ["SPACES", "build_space"]


# -- option checks shared by the space modules ---------------------------------------------
# Defined before the space modules are imported at the bottom of this file, because they
# import these helpers from here (``from . import ...``) while this package is initialising.

def reject_unknown(space: str, unknown: Mapping[str, Any], known: Iterable[str]) -> None:
    """Raise for options a space's ``build`` does not take, suggesting the closest known one."""
    if not unknown:
        return
    known = sorted(known)
    name = sorted(unknown)[0]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise SupernetError(f"{space}: unknown option {name!r}; expected one of {known}.{hint}")


def check_int(space: str, option: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SupernetError(f"{space}.{option}: expected an int >= {minimum}, found {value!r}")
    return value


def check_float(space: str, option: str, value: Any, low: float, high: float) -> float:
    """A float in ``[low, high)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < high:
        raise SupernetError(f"{space}.{option}: expected a number in [{low}, {high}), found {value!r}")
    return float(value)


def check_int_list(
    space: str, option: str, value: Any, minimum: int = 1, allow_empty: bool = False
) -> tuple[int, ...]:
    """A list of distinct ints >= ``minimum`` (YAML lists arrive as ListConfig: any sequence)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise SupernetError(f"{space}.{option}: expected a list of ints, found {value!r}")
    items = tuple(value)
    if not items and not allow_empty:
        raise SupernetError(f"{space}.{option}: expected a non-empty list of ints, found []")
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise SupernetError(f"{space}.{option}: expected ints >= {minimum}, found {v!r} in {list(items)}")
    if len(set(items)) != len(items):
        raise SupernetError(f"{space}.{option}: expected distinct values, found {list(items)}")
    return items


def check_input_shape(space: str, value: Any, ndims: Sequence[int]) -> tuple[int, ...]:
    """The shape of one sample, e.g. ``(C, H, W)``: positive ints, ``len`` one of ``ndims``."""
    want = " or ".join(str(n) for n in ndims)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) not in ndims:
        raise SupernetError(
            f"{space}.input_shape: expected the shape of one sample ({want} positive ints, "
            f"without the batch dim), found {value!r}"
        )
    shape = tuple(value)
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
        raise SupernetError(f"{space}.input_shape: expected positive ints, found {value!r}")
    return shape


# The space modules import the helpers above, so they come after them.
from . import cell, conv, resmlp, transformer  # noqa: E402

SPACES: dict[str, Callable[..., SupernetGraph]] = {
    "transformer": transformer.build,
    "conv": conv.build,
    "cell": cell.build,
    "resmlp": resmlp.build,
}


def build_space(name: str, **options: Any) -> SupernetGraph:
    """Build the built-in space ``name`` with ``options`` (``input_shape``, ``num_classes``, ...)."""
    try:
        builder = SPACES[name]
    except (KeyError, TypeError):
        raise SupernetError(
            f"unknown search space {name!r}; built-in spaces are {sorted(SPACES)}. "
            "A space of your own is a function returning a SupernetGraph: name it with _target_."
        ) from None
    return builder(**options)
