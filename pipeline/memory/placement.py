"""Where one op lives: its host home, its arena region when resident, and its tensors' views.

Every op a store owns has a home in host memory (:func:`~pipeline.memory.arena.host_buffer`)
holding its weights, buffers and optimizer state in one :class:`~pipeline.memory.state.OpLayout`.
An op is *resident* when the same bytes sit in a region of the device arena and the module's
parameters, buffers and optimizer state are views of that region; otherwise they are views of
the host home (so an op in host memory can be exported, or migrated, without touching the
device). An op whose optimizer state is updated on the host keeps that state in its home and
sends only the weights and buffers (the layout's prefix) to the arena.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .copies import Handle
from .state import OpLayout, OpState, optim_tensors, split_optim

__all__ = ["OpPlacement", "HOST", "FETCHING", "RESIDENT"]

HOST, FETCHING, RESIDENT = "host", "fetching", "resident"


class OpPlacement:
    """Where one owned op lives: its module, optimizer, layout, host home and arena offset."""

    def __init__(self, op_id: str, module: nn.Module, opt: torch.optim.Optimizer, layout: OpLayout,
                 host: torch.Tensor, optim_on_host: bool = False) -> None:
        self.op_id, self.module, self.opt, self.layout, self.host = op_id, module, opt, layout, host
        self.optim_on_host = optim_on_host
        self.nbytes = layout.weights_nbytes if optim_on_host else layout.nbytes  # bytes it takes in the arena
        self._host_views: list[torch.Tensor] | None = None
        self.params = list(module.parameters())
        self.buffer_owner = {}
        for name, _ in module.named_buffers():
            prefix, _, leaf = name.rpartition(".")
            self.buffer_owner[name] = (module.get_submodule(prefix) if prefix else module, leaf)
        self.state = HOST
        self.offset = -1
        self.fetch: Handle | None = None  # the host -> arena copy in flight
        self.host_pending: Handle | None = None  # the arena -> host write-back in flight
        self.dirty = False
        self.settled = False  # every optimizer state slot is a view of where the op lives
        self._optim_home = False  # every optimizer state slot is a view of the host home
        self.last_use = -1

    def set_host_update(self, on_host: bool) -> None:
        """Where the op's next update runs (only while it is at home): on the host, its state
        stays there and only the weights and buffers go to the arena; on the device, all of it."""
        if self.state != HOST:
            raise RuntimeError(f"op {self.op_id!r}: its optimizer placement changes only at home, not {self.state}")
        self.optim_on_host = on_host
        self.nbytes = self.layout.weights_nbytes if on_host else self.layout.nbytes

    def host_views(self) -> list[torch.Tensor]:
        """The slots' tensors over the host home (made once: the home never moves)."""
        if self._host_views is None:
            self._host_views = [slot.view(self.host) for slot in self.layout.slots]
        return self._host_views

    def _at_home(self, slot, buf: torch.Tensor) -> bool:
        """Whether ``slot``'s bytes are in the host home while the op lives in ``buf``: all of
        them when ``buf`` is the home; the optimizer state of an op updated on the host always."""
        return buf is self.host or (slot.kind == "optim" and self.optim_on_host)

    def point(self, buf: torch.Tensor, base: int) -> None:
        """Make the module's tensors and its optimizer state views of ``buf`` from ``base``
        (the optimizer state of an op updated on the host stays in its host home: once every
        slot of it is a view of the home, it is left as it is)."""
        settled = True
        on_host = buf is self.host
        skip_optim = self.optim_on_host and self._optim_home
        host = self.host_views() if on_host or self.optim_on_host else None
        for i, slot in enumerate(self.layout.slots):
            if slot.kind == "optim" and skip_optim:
                continue
            view = host[i] if self._at_home(slot, buf) else slot.view(buf, base)
            if slot.kind == "param":
                self.params[slot.index].data = view
            elif slot.kind == "buffer":
                owner, leaf = self.buffer_owner[slot.name]
                owner._buffers[leaf] = view
            else:
                st = self.opt.state.get(self.params[slot.index])
                if st is not None and st.get(slot.name) is not None:
                    st[slot.name] = view
                else:
                    settled = False
        if not skip_optim:
            self.settled = settled
            self._optim_home = settled and (on_host or self.optim_on_host)

    def settle(self, buf: torch.Tensor, base: int) -> None:
        """Move optimizer state that torch created lazily (first step) into its slots."""
        settled = True
        at_home = self.optim_on_host or buf is self.host
        for i, slot in enumerate(self.layout.slots):
            if slot.kind != "optim":
                continue
            st = self.opt.state.get(self.params[slot.index])
            t = None if st is None else st.get(slot.name)
            if t is None:
                settled = False
                continue
            view = self.host_views()[i] if at_home else slot.view(buf, base)
            if t.data_ptr() != view.data_ptr():
                view.copy_(t)
                st[slot.name] = view
        self.settled = settled
        self._optim_home = settled and at_home

    def fill_home(self, state: Mapping[str, torch.Tensor] | None, state_keys: Sequence[str]) -> None:
        """Write the op's tensors into its host home and point the module there: from the module
        and optimizer as built, or from a flat ``state`` (as exported), which overrides them."""
        self.fill(state, state_keys, self.host, 0)

    def fill(self, state: Mapping[str, torch.Tensor] | None, state_keys: Sequence[str], buf: torch.Tensor,
             base: int) -> None:
        """Write the op's tensors into ``buf`` from byte ``base`` (its host home, or its arena
        region: an op that arrives from another stage straight into the arena, where the
        optimizer state of an op updated on the host still goes to its home) and point the module
        there: from the module and optimizer as built, or from a flat ``state`` (as exported),
        which overrides them."""
        params = self.params
        homes = self.host_views()

        def target(i: int, slot) -> torch.Tensor:
            return homes[i] if self._at_home(slot, buf) else slot.view(buf, base)

        if self.layout.nbytes and buf is self.host:
            self.host.zero_()  # (an arena region's padding is never read)
        with torch.no_grad():
            for i, slot in enumerate(self.layout.slots):
                if slot.kind == "param":
                    target(i, slot).copy_(state[slot.key] if state is not None else params[slot.index])
                elif slot.kind == "buffer":
                    target(i, slot).copy_(state[slot.key] if state is not None else self.module.get_buffer(slot.name))
        if state is not None:
            for i, entry in split_optim(state).items():
                # slotted state is copied into its slot below; scalars (AdamW's step) stay on the host
                self.opt.state[params[i]] = {k: t if k in state_keys else t.detach().clone().cpu()
                                             for k, t in entry.items()}
            for i, slot in enumerate(self.layout.slots):
                if slot.kind == "optim":
                    t = self.opt.state.get(params[slot.index], {}).get(slot.name)
                    if t is not None:
                        target(i, slot).copy_(t)
        self._optim_home = False  # new state objects: point them all
        self.point(buf, base)

    def home_state(self, copy: bool) -> OpState:
        """The op's flat state read from its host home (the caller brought it up to date):
        copies (a snapshot) or views of the home."""
        return self.state_in(self.host, 0, copy)

    def state_in(self, buf: torch.Tensor, base: int, copy: bool) -> OpState:
        """The op's flat state read from where it lives in ``buf`` from byte ``base`` (its host
        home, or its arena region while resident: the optimizer state of an op updated on the
        host is read from its home): copies or views."""
        def view(slot) -> torch.Tensor:
            return slot.view(self.host) if self._at_home(slot, buf) else slot.view(buf, base)

        state: OpState = {}
        by_key = {slot.key: slot for slot in self.layout.slots}
        for slot in self.layout.slots:
            if slot.kind != "optim":
                state[slot.key] = view(slot)
        for key, t in optim_tensors(self.params, self.opt):
            slot = by_key.get(key)  # slotted state lives in its slot; scalars where torch keeps them
            state[key] = (view(slot) if slot is not None else t).detach()
        return {k: t.clone() for k, t in state.items()} if copy else state
