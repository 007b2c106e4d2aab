"""A warning when torch's ``clip_grad_norm_`` cannot see the gradients an optimizer holds.

With fp32 gradient accumulation (``use_fp32_grad_acc``) backward hooks move every gradient into the
optimizer's fp32 ``main_grad`` buffers and set ``.grad`` to None, so a training loop's own
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` measures nothing of them and clips
nothing: it returns 0, silently. The optimizer clips inside ``step()`` instead (``max_norm``,
``grad_clipping``) and reports its norm as ``optimizer.grad_norm``; this module says so, once per
optimizer, when such a call happens.

How: the first optimizer with hook accumulation wraps ``torch.nn.utils.clip_grad_norm_`` and
``torch.nn.utils.clip_grad.clip_grad_norm_`` once (``functools.wraps``; the wrapper calls the
original with the same arguments and returns its result). It warns only when a parameter given to
the call is managed by a live optimizer with hook accumulation (``ClipWatch``), has no ``.grad``,
and that optimizer holds an accumulated gradient. accelerate's ``Accelerator.clip_grad_norm_`` and
the Hugging Face Trainer call through ``torch.nn.utils.clip_grad_norm_``, so they are covered; the
Trainer's ``Zero1TrainerCallback``, which routes the Trainer's clipping to the optimizer, silences
it (``silence``). Chosen over a check inside the optimizer, which never sees the call, and over
warning at every step, which would blame loops that do not clip at all. torch_xla puts its own
function at ``torch.nn.utils.clip_grad_norm_`` when it is imported; an optimizer built after that (on
an XLA device, always) wraps that one. Not covered: a name bound before the wrapper was installed
(``from torch.nn.utils import clip_grad_norm_`` at import time), and calls while torch.compile traces
(the wrapper steps aside then).
"""

from __future__ import annotations

import functools
import types
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
from torch.utils.weak import WeakIdKeyDictionary

# Each parameter's watch (a weak reference: the optimizer owns it); the newest optimizer over a
# parameter takes it over, as it takes over the parameter's backward hook.
_WATCHED = WeakIdKeyDictionary()

MESSAGE = (
    "nxd_smp: clip_grad_norm_ found no .grad on parameters a Zero1Optimizer manages: with fp32 gradient "
    "accumulation (use_fp32_grad_acc) their gradients are in the optimizer's fp32 main_grad buffers, so this "
    "call measured and clipped nothing of them. The optimizer clips inside step(): set its max_norm (and "
    "grad_clipping), and read the global norm before clipping from optimizer.grad_norm (the Hugging Face "
    "Trainer: add Zero1TrainerCallback, which does both)."
)


class ClipWatch:
    """Watches ``params`` for a ``clip_grad_norm_`` that misses their gradients.

    Args:
        params: the parameters whose gradients backward hooks move out of ``.grad``.
        holds_gradient: whether the optimizer holds an accumulated gradient now (host-side).

    The optimizer keeps it alive; ``silenced`` once it warned, or once a training loop routes its
    clipping to the optimizer.
    """

    def __init__(self, params: Iterable[torch.Tensor], holds_gradient: Callable[[], bool]):
        self.holds_gradient = holds_gradient
        self.silenced = False
        install()
        me = weakref.ref(self)
        for p in params:
            _WATCHED[p] = me


def silence(params: Iterable[torch.Tensor]) -> None:
    """No warning for the optimizers watching ``params``: the caller routes its clipping to them."""
    for p in params:
        watch = _watch_of(p)
        if watch is not None:
            watch.silenced = True


def _watch_of(p: torch.Tensor) -> ClipWatch | None:
    ref = _WATCHED.get(p)
    return None if ref is None else ref()


def _check(parameters: Any) -> Any:
    """Warn (once per optimizer) if a watched parameter among ``parameters`` has no ``.grad`` while its
    optimizer holds a gradient; returns ``parameters`` as torch's function may still iterate them."""
    if isinstance(parameters, torch.Tensor):
        items = [parameters]
    else:
        items = list(parameters)
        # (torch reads an iterable once; a generator stays one, so torch's own warning on an empty
        # generator still comes)
        parameters = (p for p in items) if isinstance(parameters, types.GeneratorType) else items
    seen: set[int] = set()
    for p in items:
        if not isinstance(p, torch.Tensor) or p.grad is not None:
            continue
        watch = _watch_of(p)
        if watch is None or watch.silenced or id(watch) in seen:
            continue
        seen.add(id(watch))
        if watch.holds_gradient():
            watch.silenced = True
            warnings.warn(MESSAGE, UserWarning, stacklevel=3)
    return parameters


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(original, "_nxd_smp_clip_watch", False):
        return original

    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling() and len(_WATCHED):
            parameters = _check(parameters)
        return original(parameters, *args, **kwargs)

    clip_grad_norm_._nxd_smp_clip_watch = True  # type: ignore[attr-defined]
    return clip_grad_norm_


def install() -> None:
    """Wrap torch's ``clip_grad_norm_`` where torch and its callers look it up (once)."""
    module, package = torch.nn.utils.clip_grad, torch.nn.utils
    same = package.clip_grad_norm_ is module.clip_grad_norm_
    module.clip_grad_norm_ = _wrap(module.clip_grad_norm_)
    package.clip_grad_norm_ = module.clip_grad_norm_ if same else _wrap(package.clip_grad_norm_)
