"""A process that never compiles skips importing ``torch._dynamo`` (1.5-2 s of CPU at its start).

torch imports ``torch._dynamo`` in an eager process for two things it does not need there:

* functions torch wraps in ``torch._disable_dynamo`` (the optimizers' ``add_param_group``,
  ``zero_grad``, ``state_dict``, the FLOP counter's dispatch, some reference kernels): on its
  first call such a wrapper imports ``torch._dynamo`` only to wrap the function in
  ``torch._dynamo.disable``, and caches that on the function (its ``__dynamo_disable``);
  outside ``torch.compile`` the cached wrapper calls the function as it is. :func:`skip_dynamo`
  caches the function itself on every such wrapper alive: the same calls, without the import.
* ``Optimizer.step``: torch's wrapper turns gradients off and imports ``torch._dynamo`` for a
  graph break on every call. :func:`step` calls the optimizer's own ``step`` under
  ``torch.no_grad()`` instead (the profiler's wrapper goes too: it records a range and runs the
  step hooks, of which this project registers none; with any registered, ``opt.step()`` runs).

The app calls :func:`skip_dynamo` first thing (``search.app.prepare``): ``python -m search`` and
each torchrun rank. A library user's process is left as torch made it unless it calls it too.
Nothing changes where ``torch._dynamo`` is imported already (something compiles: torch's wrappers
stay as they are), with ``PIPENAS_KEEP_DYNAMO=1`` (a space whose ops use ``torch.compile`` and
want torch's own wrappers in place from the start), or with a torch whose wrappers have another
form. Wrappers made after :func:`skip_dynamo` (a module torch imports later) are left alone and
import ``torch._dynamo`` on their first call, as before.
"""
from __future__ import annotations

import gc
import os
import sys
import types
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

__all__ = ["skip_dynamo", "step"]

_state = {"asked": False, "skipping": False}


def skip_dynamo() -> int:
    """Cache each ``torch._disable_dynamo`` wrapper's own function as its disabled form, once per
    process (see the module doc); returns how many wrappers it set (0 on later calls)."""
    if _state["asked"]:
        return 0
    _state["asked"] = True
    if os.environ.get("PIPENAS_KEEP_DYNAMO") == "1" or "torch._dynamo" in sys.modules:
        return 0
    import torch.utils.flop_counter  # noqa: F401  (the search's FLOP count)
    try:
        probe = torch._compile._disable_dynamo(_probe)
    except (AttributeError, TypeError):
        return 0
    code = probe.__code__
    if _inner_fn(probe, code) is not _probe:  # another form of wrapper: leave torch's as they are
        return 0
    count = 0
    for f in gc.get_objects():
        if type(f) is types.FunctionType and f.__code__ is code:
            fn = _inner_fn(f, code)  # (the closure's, not __wrapped__: a later functools.wraps rewrites that)
            if fn is not None and getattr(fn, "__dynamo_disable", None) is None:
                setattr(fn, "__dynamo_disable", fn)
                count += 1
    _state["skipping"] = True
    return count


def step(opt: Any) -> Any:
    """``opt.step()``; where :func:`skip_dynamo` applied, the optimizer's own ``step`` under
    ``torch.no_grad()``, past torch's wrappers (see the module doc): the same arithmetic."""
    hooks = (getattr(opt, "_optimizer_step_pre_hooks", None), getattr(opt, "_optimizer_step_post_hooks", None),
             getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
             getattr(torch_optimizer, "_global_optimizer_post_hooks", None))
    if not _state["skipping"] or opt.defaults.get("differentiable") or any(h is None or h for h in hooks):
        return opt.step()  # (a hook registered, or a torch that keeps them elsewhere: torch's path)
    wrappers = _step_wrappers()
    fn = type(opt).step
    while getattr(fn, "__code__", None) in wrappers:
        fn = fn.__wrapped__
    with torch.no_grad():
        return fn(opt)


def _step_wrappers() -> tuple[types.CodeType, ...]:
    """The code of torch's wrappers around an optimizer's ``step`` (each sets ``__wrapped__``)."""
    if "step_wrappers" not in _state:
        made = (torch_optimizer.Optimizer.profile_hook_step(_probe),
                torch_optimizer._use_grad_for_differentiable(_probe))
        _state["step_wrappers"] = tuple(w.__code__ for w in made if getattr(w, "__wrapped__", None) is _probe)
    return _state["step_wrappers"]


def _inner_fn(wrapper: types.FunctionType, code: types.CodeType) -> Any:
    """The function a ``torch._disable_dynamo`` wrapper calls (its closure's ``fn``)."""
    try:
        return wrapper.__closure__[code.co_freevars.index("fn")].cell_contents
    except (TypeError, IndexError, ValueError):  # (no closure, no ``fn``, an empty cell)
        return None


def _probe(*args: Any, **kwargs: Any) -> None:
    """(A function to wrap: its wrapper's code is the code of every wrapper of that kind.)"""
