"""Search spaces, the supernet graph, the op registry and the weight-shared supernet."""
from __future__ import annotations

from .errors import OpError, SearchSpaceError, SupernetError
from .execute import Slice, SliceRun, classification_loss, cut, loss_and_grad
from .graph import INPUT, ActiveOp, OpSlot, SupernetGraph
from .ops import OpContext, OpSpec, build_op, derive_seed, op_contexts, register_op, registered_ops
from .space import Arch, Choice, SearchSpace
from .supernet import Subnet, Supernet

__all__ = [
    "INPUT", "ActiveOp", "Arch", "Choice", "OpContext", "OpError", "OpSlot", "OpSpec",
    "SearchSpace", "SearchSpaceError", "Slice", "SliceRun", "Subnet", "Supernet",
    "SupernetError", "SupernetGraph", "build_op", "classification_loss", "cut", "derive_seed",
    "loss_and_grad", "op_contexts", "register_op", "registered_ops",
]
