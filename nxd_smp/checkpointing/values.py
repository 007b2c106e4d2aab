"""What a value read from a checkpoint must be before it is used: sizes and shapes well formed, a
tensor that converts exactly into the live one's dtype, a scheduler state of the scheduler's own
keys and kinds; and the caller's stateful objects loaded so that a refusal puts them back.

(The optimizer's own state is checked by the one state-fit check, ``nxd_smp.optim.state_fit``.)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..core.errors import CheckpointError
from ..optim.state_fit import describe, misfit


def is_size(value: Any) -> bool:
    """Whether ``value`` is a size, offset or length: a non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_shape(value: Any) -> bool:
    """Whether ``value`` is a shape: a tuple or list of sizes."""
    return isinstance(value, (tuple, list)) and all(is_size(d) for d in value)


def check_cast(value: Any, dtype: torch.dtype, where: str) -> None:
    """``value`` is a tensor that becomes ``dtype`` exactly enough: a float into a float dtype
    (rounded, and a finite value stays finite), an integer or bool into an integer dtype with
    every value kept; complex only into the same complex dtype.

    Raises:
        CheckpointError: naming ``where`` and the dtypes.
    """
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{where} is a {type(value).__name__}, not a tensor.")
    source = value.dtype
    if dtype.is_complex or source.is_complex:
        ok = source == dtype
    elif dtype.is_floating_point:
        ok = source.is_floating_point and not bool((torch.isfinite(value) & torch.isinf(value.to(dtype))).any())
    else:
        ok = not source.is_floating_point and torch.equal(value.to(dtype).to(source), value)
    if not ok:
        raise CheckpointError(f"{where} is {source}, which does not convert exactly to the model's {dtype} "
                              f"(values out of range, or another kind of number); refused.")


def _scheduler_value(saved: Any, live: Any, at: str) -> str | None:
    """Where ``saved`` (of ``live``'s kind, ``misfit`` said) is not a value the scheduler keeps
    there: see ``check_scheduler_state``. ``at``: the path so far."""
    if isinstance(live, Mapping):
        return next((m for k in live if (m := _scheduler_value(saved[k], live[k], f"{at}[{k!r}]"))), None)
    if isinstance(live, (tuple, list)):
        return next((m for i, (s, v) in enumerate(zip(saved, live)) if (m := _scheduler_value(s, v, f"{at}[{i}]"))),
                    None)
    here = f"{at} = {describe(saved)} where the live value is {describe(live)}"
    if isinstance(live, str):
        return None if saved == live else f"{here} (a scheduler's mode or the name of a group's key)"
    if isinstance(live, bool) or not isinstance(live, (int, float, torch.Tensor)):
        return None
    values = saved.detach().double().reshape(-1) if isinstance(saved, torch.Tensor) else torch.tensor([float(saved)],
                                                                                                     dtype=torch.float64)
    lives = live.detach().double().reshape(-1) if isinstance(live, torch.Tensor) else torch.tensor([float(live)],
                                                                                                   dtype=torch.float64)
    if bool(values.isnan().any()):
        return f"{here}: NaN"
    if bool(torch.isfinite(lives).all()):
        if not bool(torch.isfinite(values).all()):
            return f"{here}: not finite"
        if "lr" not in at and bool(((lives > 0) & ~(values > 0)).any()):  # (a decayed lr reaches 0)
            return f"{here}: not > 0 (a period, a factor or a rate, which step() divides by or multiplies with)"
        if bool(((lives >= 0) & ~(values >= 0)).any()):
            return f"{here}: negative"
    if isinstance(live, int) and not isinstance(saved, int) and "lr" not in at and "T_cur" not in at:
        return f"{here}: not a whole number (a count or a period)"
    return None


def check_scheduler_state(saved: Any, scheduler: Any, where: str) -> None:
    """``saved`` has exactly the keys the scheduler's own ``state_dict()`` has, each of the kind
    it holds there (nested states too: ``SequentialLR``'s), and no ``optimizer`` (which would
    replace the scheduler's optimizer); and each of a value the scheduler could keep there, so that
    ``step()`` neither divides by zero nor makes a NaN learning rate:

    * numbers never NaN; finite where the live value is (``ReduceLROnPlateau``'s ``best`` starts at
      infinity, and is any number after); of the live value's sign class where it is finite (live
      > 0: saved > 0, as a ``step_size``, ``T_max``, ``gamma`` or ``total_iters``; live >= 0: saved
      >= 0, as ``last_epoch`` or ``eta_min``; a learning rate >= 0, since a schedule decays it to 0);
    * ints stay ints (counts and periods; a learning rate given as an int, and
      ``CosineAnnealingWarmRestarts``' ``T_cur``, which a fractional epoch makes a float, may be
      floats);
    * strings equal the live ones (a mode, or the name of a param group's key that ``OneCycleLR``'s
      phases read: another would read ``params``).

    Raises:
        CheckpointError: naming ``where`` and the keys.
    """
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{where}: the scheduler state is a {type(saved).__name__}, not a dict.")
    live = scheduler.state_dict()
    problems = []
    if "optimizer" in saved:
        problems.append("'optimizer' (a scheduler's state never holds its optimizer)")
    lacking, surplus = sorted(set(live) - set(saved), key=str), sorted(set(saved) - set(live) - {"optimizer"}, key=str)
    if lacking:
        problems.append(f"missing {lacking}")
    if surplus:
        problems.append(f"keys the scheduler does not have {surplus[:8]}")
    problems += [m for key in sorted(set(saved) & set(live), key=str)
                 if (m := misfit(saved[key], live[key], finite=False, at=repr(key))
                     or _scheduler_value(saved[key], live[key], repr(key)))]
    if problems:
        raise CheckpointError(f"{where}: the scheduler state does not fit {type(scheduler).__name__}: "
                              + "; ".join(problems) + ".")


def is_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is one of torch's LR schedulers (its state is checked as a scheduler's)."""
    lr = torch.optim.lr_scheduler
    return isinstance(obj, (lr.LRScheduler, lr.ReduceLROnPlateau))


def load_objects(objects: Mapping[str, Any], states: Mapping[str, Any], source: str) -> Callable[[], None]:
    """Load ``states[name]`` into each of ``objects`` (a scheduler, a sampler, ...), keeping a
    copy of each one's state before; if one refuses, those loaded are put back and a
    ``CheckpointError`` names it. Returns the undo (put every object back), for a load that
    another rank refused."""
    done: list[tuple[Any, Any]] = []

    def undo() -> None:
        for obj, before in reversed(done):
            obj.load_state_dict(before)

    for name, obj in objects.items():
        try:
            before = copy.deepcopy(obj.state_dict())
            obj.load_state_dict(states[name])
        except Exception as e:  # noqa: BLE001 - any refusal of the object's own
            undo()
            raise CheckpointError(f"{source}: {name} refused its saved state: {type(e).__name__}: {e}") from e
        done.append((obj, before))
    return undo


def check_tree(value: Any, source: str, bound: int, max_depth: int) -> None:
    """``value``'s size as a tree (a container reached twice counts each time; strings and bytes
    by their length too) is at most ``bound`` nodes, it nests no deeper than ``max_depth`` and holds
    no cycle (a pickle can make a few bytes stand for 2**30 values, which a deep copy or a JSON dump
    of the value would then write out). Each object is measured once (its size and height kept), so this is linear in the
    objects, not in the tree."""
    measured: dict[int, tuple[int, int]] = {}
    open_: set[int] = set()

    def measure(x: Any, depth: int) -> tuple[int, int]:
        if isinstance(x, (str, bytes)):
            return 1 + len(x) // 16, 0
        if isinstance(x, Mapping):
            children = [item for pair in x.items() for item in pair] + list(getattr(x, "__dict__", {}).values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            children = list(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            children = [getattr(x, f.name, None) for f in dataclasses.fields(x)]
        else:
            return 1, 0
        if id(x) in measured:
            size, height = measured[id(x)]
        else:
            if id(x) in open_:
                raise CheckpointError(f"{source} holds a container that contains itself; refused.")
            open_.add(id(x))
            size, height = 1, 0
            for child in children:
                if depth >= max_depth:
                    raise CheckpointError(f"{source} nests containers more than {max_depth} deep; refused.")
                child_size, child_height = measure(child, depth + 1)
                size, height = size + child_size, max(height, child_height + 1)
                if size > bound:
                    break
            open_.discard(id(x))
            measured[id(x)] = size, height
        if depth + height > max_depth:
            raise CheckpointError(f"{source} nests containers more than {max_depth} deep; refused.")
        if size > bound:
            raise CheckpointError(f"{source} refers to its containers so often that, written out, it holds more "
                                  f"than {bound} values (the bound its file's size gives); refused (a few "
                                  f"bytes of shared references can stand for 2**30 values).")
        return size, height

    measure(value, 0)
