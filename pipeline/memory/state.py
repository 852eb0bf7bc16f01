"""An op's state: its flat form (names to tensors) and its byte layout (slots in one buffer).

The flat form is what travels: migration, checkpoints, the digest and ``TensorManager.export``/
``adopt`` all use it, so an op's weights and its optimizer state always move together (a state
without ``optim/`` entries, :func:`weights_only`, loads the weights and leaves the optimizer fresh)::

    param/<name>          a parameter (``module.named_parameters()`` order)
    buffer/<name>         a buffer (batch norm's running statistics)
    optim/<i>/<key>       the optimizer state ``key`` of the op's ``i``-th parameter

The byte layout (:class:`OpLayout`) is the same state as one run of aligned slots: parameters,
then buffers, then each parameter's optimizer state. An op's host home and its region of the
device arena share it, so fetching an op is one contiguous copy and so is writing it back; the
weights and buffers come first, so an op whose optimizer state stays at home sends a prefix.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["OpState", "param_key", "buffer_key", "optim_key", "split_optim", "optim_tensors", "flat_tensors", "load_flat",
           "weights_only", "weight_shapes", "params_digest", "Slot", "OpLayout", "op_layout", "optim_state_keys",
           "alignment_for"]

OpState = dict[str, torch.Tensor]


def param_key(name: str) -> str:
    return f"param/{name}"


def buffer_key(name: str) -> str:
    return f"buffer/{name}"


def optim_key(index: int, key: str) -> str:
    return f"optim/{index}/{key}"


def split_optim(state: Mapping[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """The optimizer entries of a flat state: parameter index -> {state key: tensor}."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        if key.startswith("optim/"):
            _, index, name = key.split("/", 2)
            out.setdefault(int(index), {})[name] = t
    return out


def optim_tensors(params: Sequence[nn.Parameter], opt: torch.optim.Optimizer,
                  scalars: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """An op's optimizer state tensors in the flat form, per parameter in key order (0-d ones
    such as AdamW's ``step`` unless not ``scalars``)."""
    for i, p in enumerate(params):
        for key, t in sorted(opt.state.get(p, {}).items()):
            if isinstance(t, torch.Tensor) and (scalars or t.dim() > 0):
                yield optim_key(i, key), t


def flat_tensors(module: nn.Module, params: Sequence[nn.Parameter], opt: torch.optim.Optimizer,
                 scalars: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an op in the flat form, where it lives now: parameters, buffers, then
    the optimizer state (:func:`optim_tensors`)."""
    for name, p in module.named_parameters():
        yield param_key(name), p
    for name, b in module.named_buffers():
        yield buffer_key(name), b
    yield from optim_tensors(params, opt, scalars)


def load_flat(module: nn.Module, opt: torch.optim.Optimizer, state: Mapping[str, torch.Tensor],
              device: torch.device) -> None:
    """Fill an op's module (its tensors allocated on ``device``) and optimizer from a flat state."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(state[param_key(name)])
        for name, b in module.named_buffers():
            b.copy_(state[buffer_key(name)])
    params = list(module.parameters())
    for i, entry in split_optim(state).items():
        opt.state[params[i]] = {k: t.to(device) for k, t in entry.items()}


def weights_only(state: Mapping[str, torch.Tensor]) -> OpState:
    """A flat state's parameters and buffers, its optimizer entries left out: an op adopted from
    it (``load_flat``) has these weights and builds its optimizer state afresh at its first step."""
    return {key: t for key, t in state.items() if key.startswith(("param/", "buffer/"))}


def weight_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The flat keys and shapes of a module's parameters and buffers (a meta build will do):
    what a flat state must hold to be loaded into it."""
    shapes = {param_key(name): tuple(p.shape) for name, p in module.named_parameters()}
    shapes.update((buffer_key(name), tuple(b.shape)) for name, b in module.named_buffers())
    return shapes


def params_digest(states: Mapping[str, Mapping[str, torch.Tensor]]) -> str:
    """sha256 over every parameter and buffer of every op, in canonical name order
    (``<op_id>.<name>`` sorted), covering name, dtype, shape and bytes."""
    h = hashlib.sha256()
    entries = []
    for op_id, state in states.items():
        for key, t in state.items():
            kind, _, name = key.partition("/")
            if kind in ("param", "buffer"):
                entries.append((f"{op_id}.{name}", t))
    for name, t in sorted(entries, key=lambda e: e[0]):
        t = t.detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# -- the byte layout -------------------------------------------------------------------------

def alignment_for(device: torch.device) -> int:
    """Byte alignment of every slot: the CPU allocator's 64 bytes (so kernels see the same
    pointer alignment as for ordinary tensors) or the CUDA caching allocator's 512."""
    return 512 if device.type == "cuda" else 64


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


_TEMPLATES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


@dataclass(frozen=True)
class Slot:
    """One tensor of an op: ``kind`` is ``param``, ``buffer`` or ``optim``; ``index`` the
    parameter's position (``optim``) and ``name`` its name or the optimizer state key."""

    kind: str
    name: str
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    stride: tuple[int, ...] = ()

    @property
    def key(self) -> str:
        """The slot's name in the flat form."""
        if self.kind == "optim":
            return optim_key(self.index, self.name)
        return param_key(self.name) if self.kind == "param" else buffer_key(self.name)

    def view(self, buf: torch.Tensor, base: int = 0) -> torch.Tensor:
        """This slot's tensor over ``buf``'s bytes (a uint8 tensor) from byte ``base``.

        It aliases the memory but is not an autograd view of ``buf``: views share their base's
        version counter, so an in-place update of one op's batch-norm statistics would look
        like a change to every weight saved for the backward."""
        start = buf.storage_offset() + base + self.offset
        key = (self.dtype, buf.device)
        tmpl = _TEMPLATES.get(key)
        if tmpl is None:
            tmpl = _TEMPLATES[key] = torch.empty(0, dtype=self.dtype, device=buf.device)
        # tmpl.new(): a fresh empty tensor (own version counter), 3x cheaper than torch.empty
        return tmpl.new().set_(buf.untyped_storage(), start // self.dtype.itemsize, self.shape, self.stride)


@dataclass(frozen=True)
class OpLayout:
    """Where each of an op's tensors sits in its bytes (host home and arena region alike)."""

    slots: tuple[Slot, ...]
    nbytes: int

    @staticmethod
    def build(entries: Iterable[tuple[str, str, int, torch.dtype, tuple[int, ...]]], align: int) -> OpLayout:
        slots, off = [], 0
        for kind, name, index, dtype, shape in entries:
            n = math.prod(shape) * dtype.itemsize
            stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))  # contiguous
            slots.append(Slot(kind, name, index, dtype, tuple(shape), off, n, stride))
            off = _align(off + max(n, 1), align)
        return OpLayout(tuple(slots), max(off, align))

    @property
    def weights_nbytes(self) -> int:
        """Bytes of the weights and buffers: the prefix before the first optimizer slot."""
        return next((s.offset for s in self.slots if s.kind == "optim"), self.nbytes)


def optim_state_keys(name: str, momentum: float) -> tuple[str, ...]:
    """The per-parameter optimizer state tensors that get a slot (scalars such as AdamW's
    ``step`` stay where torch puts them, a CPU tensor)."""
    if name == "adamw":
        return ("exp_avg", "exp_avg_sq")
    return ("momentum_buffer",) if momentum != 0 else ()


def op_layout(module: nn.Module, state_keys: Sequence[str], align: int) -> OpLayout:
    """An op's layout: its parameters, its buffers, then each parameter's optimizer state."""
    params = list(module.named_parameters())
    entries = [("param", n, i, p.dtype, tuple(p.shape)) for i, (n, p) in enumerate(params)]
    entries += [("buffer", n, -1, b.dtype, tuple(b.shape)) for n, b in module.named_buffers()]
    entries += [("optim", k, i, p.dtype, tuple(p.shape)) for i, (_, p) in enumerate(params) for k in state_keys]
    return OpLayout.build(entries, align) if entries else OpLayout((), 0)
