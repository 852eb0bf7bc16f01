"""The exception family of the supernet package."""
from __future__ import annotations

__all__ = ["SupernetError", "SearchSpaceError", "OpError"]


class SupernetError(ValueError):
    """A supernet graph, space or op was built or used with bad input."""


class SearchSpaceError(SupernetError):
    """An arch or search space is malformed: bad label, value or structure."""


class OpError(SupernetError):
    """An op name is unknown or an op was given bad arguments."""
