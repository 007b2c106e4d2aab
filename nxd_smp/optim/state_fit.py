"""The one state-fit check: whether a saved optimizer state fits the optimizer it is loaded into.

torch's ``Optimizer.load_state_dict`` installs the saved hyperparameters together with the state,
so a state is checked against the hyperparameters *being installed* (the saved ones over the live
group's), never against those the live optimizer happened to be built with: SGD saved with
momentum 0.9 loads into an SGD built with momentum 0 (torch's own ``ZeroRedundancyOptimizer`` test
does that), and its momentum buffers are what the installed group keeps.

* the param groups: as many as the optimizer has, each saved hyperparameter of the kind the live
  group holds (``check_hyperparameters``) and of a value the class itself accepts (a throwaway
  instance is built with them: ``constructor_refusal``); the options in ``LIVE_OPTIONS`` (the
  kernel's, and ``amsgrad``) are never taken from a file, the live ones stay;
* torch's own numbering: a torch.optim state dict's groups list exactly the ids the optimizer
  numbers its parameters with (``torch_group_problems``), so torch's ``load_state_dict`` cannot
  refuse what was checked, and the dict handed to it is built in one place (``torch_state_dict``);
* the state: per parameter (or per flat shard) the keys the optimizer class keeps under the
  installed hyperparameters, tensors shaped like their parameter or 0-dim as the class keeps them
  (``state_kinds`` asks a throwaway instance of the class), ``step`` a finite, non-negative
  whole number (``check_step``); which key is a moment and which a counter, by one rule
  (``is_moment``);
* the loss scaler's state: its three fields, in the box its ``update`` keeps to (``check_scaler_state``).

Every loader asks this module: ``Zero1Optimizer.load_state_dict`` (``rank_state``), nxd_smp's
checkpoints, NxD's folders and state dicts, torch_xla's per-rank dicts and torch's native
checkpoints. It raises nothing: it returns the problems, each naming where, and the caller refuses
with its own words for the file.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..core.errors import CheckpointError
from .param_groups import KERNEL_OPTIONS, index_groups

#: What a file never sets in a param group: the kernel options (they belong to the device that
#: loads), and ``amsgrad``, which decides whether the state holds ``max_exp_avg_sq`` and which the
#: live kernel was chosen for (nxd_smp's compiled update has none). A state that the live
#: ``amsgrad`` cannot hold is refused by the state check, never installed with the file's.
LIVE_OPTIONS = (*KERNEL_OPTIONS, "amsgrad")

#: What a saved value may be where the live value is None or the key unknown to the live group.
PLAIN = (type(None), bool, int, float, str)

#: The inner optimizer's view of one parameter's state: per key, True for a tensor shaped like the
#: parameter (a moment), False for a 0-dim tensor (``step``), None for a Python number.
Kinds = dict[str, "bool | None"]


def is_moment(key: Any, value: Any, kinds: Kinds | None = None, *, saved: bool = False) -> bool:
    """The one rule for what a key of a parameter's optimizer state is: a moment (a tensor shaped like
    the parameter, kept flat per bucket and cut into ranks' ranges) or a counter (Adam's ``step``: a 0-dim
    tensor or a number, whole on every rank).

    As the optimizer's class keeps ``key`` where ``kinds`` says (``state_kinds``: asked of the class, with
    the hyperparameters being installed). Else, for a ``saved`` value (read from a file, to be checked):
    every key but ``step``, torch.optim's one counter, so that a file's 0-dim tensor never passes for a
    counter of a class nothing could be asked of; and for a live value, as it is: a tensor with dimensions
    is a moment (the live optimizer's flat state, which its class made)."""
    if kinds is not None and key in kinds:
        return kinds[key] is True
    if saved:
        return key != "step"
    return isinstance(value, torch.Tensor) and value.dim() > 0


def describe(value: Any) -> str:
    """A short, safe description of a saved value for an error message."""
    text = repr(value) if isinstance(value, PLAIN) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def misfit(saved: Any, live: Any, finite: bool = True, at: str = "") -> str | None:
    """Where and how ``saved`` is not a value of the kind ``live`` is (a hyperparameter, a
    scheduler field), None if it is: a real number for a number or a one-element tensor (finite
    where ``finite``; never a bool), bools for bools, the same length for tuples and lists, the
    same keys for dicts (never ``optimizer``), recursively. ``at``: the path so far."""
    here = f"{at} = {describe(saved)} where the live value is {describe(live)}"
    if isinstance(live, bool):
        return None if isinstance(saved, bool) else here
    if isinstance(live, (int, float, torch.Tensor)):
        if isinstance(saved, torch.Tensor):
            shape_ok = saved.shape == live.shape if isinstance(live, torch.Tensor) else saved.numel() == 1
            ok = (shape_ok and not saved.dtype.is_complex and saved.dtype != torch.bool
                  and (not finite or bool(torch.isfinite(saved).all())))
        else:
            ok = isinstance(saved, (int, float)) and not isinstance(saved, bool) and (not finite or math.isfinite(saved))
        return None if ok else here
    if isinstance(live, (tuple, list)):
        if not isinstance(saved, (tuple, list)) or len(saved) != len(live):
            return here
        return next((m for i, (s, v) in enumerate(zip(saved, live)) if (m := misfit(s, v, finite, f"{at}[{i}]"))),
                    None)
    if live is None:
        plain = isinstance(saved, PLAIN) or (isinstance(saved, (tuple, list)) and all(isinstance(v, PLAIN) for v in saved))
        return None if plain else here
    if isinstance(live, str):
        return None if isinstance(saved, str) else here
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            return here
        if "optimizer" in saved:
            return f"{at}['optimizer'] (a scheduler's state never holds its optimizer)"
        if set(saved) != set(live):
            return f"{at} has the keys {sorted(map(str, saved))}, the live one {sorted(map(str, live))}"
        return next((m for k in live if (m := misfit(saved[k], live[k], finite, f"{at}[{k!r}]"))), None)
    return None if type(saved) is type(live) else here


def check_hyperparameters(saved: Any, group: Mapping[str, Any], where: str) -> None:
    """``saved``, one param group's hyperparameters from a checkpoint, checked against the live
    ``group``: a dict of string keys, never ``params``, each key the group has holding a value
    of the kind the group holds (``lr`` a real number, ``betas`` a pair of them, ...). A key the
    group lacks (an LR scheduler's ``initial_lr``, an option of another torch version) is kept
    when its value is a plain number, bool, string or None.

    Raises:
        CheckpointError: naming ``where`` and every key that does not fit.
    """
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{where}: the param group's hyperparameters are a {type(saved).__name__}, not a dict.")
    problems = []
    for key, value in saved.items():
        if not isinstance(key, str):
            problems.append(f"a key {describe(key)} that is not a string")
        elif key == "params":
            problems.append("'params', which is not a hyperparameter (a group's parameters are the live ones)")
        elif key in KERNEL_OPTIONS:
            if value is not None and not isinstance(value, bool):
                problems.append(f"{key!r} = {describe(value)}, not True, False or None")
        elif key == "param_names":  # torch >= 2.7 writes the names of named parameters
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                problems.append(f"'param_names' = {describe(value)}, not a list of names")
        elif key in group:
            if found := misfit(value, group[key], at=repr(key)):
                problems.append(found)
        elif not isinstance(value, PLAIN) or isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{key!r} = {describe(value)}, unknown to the group and not a plain, finite value")
    if problems:
        raise CheckpointError(f"{where}: hyperparameters that do not fit the param group: " + "; ".join(problems) + ".")


def installed_hyperparameters(live: Mapping[str, Any], saved: Mapping[str, Any]) -> dict[str, Any]:
    """What a param group holds once ``saved`` is installed over the ``live`` group: the saved
    hyperparameters over the live ones; never ``params``, ``param_names`` or one of
    ``LIVE_OPTIONS`` (those stay the live group's). Every install path takes its groups from here
    (``torch_state_dict``), so no file sets a kernel option."""
    keep = {k: v for k, v in live.items() if k not in ("params", "param_names")}
    keep.update({k: v for k, v in saved.items() if k not in ("params", "param_names", *LIVE_OPTIONS)})
    return keep


def torch_state_dict(live_groups: Sequence[Mapping[str, Any]], saved_groups: Sequence[Mapping[str, Any]],
                     state: Mapping[Any, Any]) -> dict[str, Any]:
    """The dict handed to torch's ``Optimizer.load_state_dict`` of an optimizer with param groups
    ``live_groups``: ``state`` (keyed by the ids torch numbers parameters with), and each group's
    ``installed_hyperparameters`` with those ids. The one place an install builds it: the kernel
    options stay the live ones whatever the file said, and the groups cannot fail torch's count and
    length checks."""
    ids = index_groups([len(group["params"]) for group in live_groups])
    return {"state": dict(state),
            "param_groups": [{**installed_hyperparameters(live, saved), "params": i}
                             for live, saved, i in zip(live_groups, saved_groups, ids)]}


def torch_group_problems(saved_groups: Any, live_groups: Sequence[Mapping[str, Any]], where: str) -> list[str]:
    """What in ``saved_groups`` (a torch.optim state dict's ``param_groups``) torch's
    ``load_state_dict`` would refuse or map elsewhere: as many groups as ``live_groups``, each a dict
    whose ``params`` lists exactly the ids the optimizer numbers its parameters with (0..n-1 in
    group order, as its own ``state_dict()`` writes them), so each state entry maps to the parameter
    it was saved for. (Their hyperparameters are ``StateFit``'s to check.)"""
    if not isinstance(saved_groups, list) or len(saved_groups) != len(live_groups):
        count = len(saved_groups) if isinstance(saved_groups, list) else describe(saved_groups)
        return [f"{where}: {count} param groups, the optimizer has {len(live_groups)}"]
    ids = index_groups([len(group["params"]) for group in live_groups])
    problems = []
    for i, (saved, expected) in enumerate(zip(saved_groups, ids)):
        params = saved.get("params") if isinstance(saved, Mapping) else None
        if not isinstance(params, list) or params != expected or any(isinstance(p, bool) for p in params):
            problems.append(f"{where}[{i}]['params'] = {describe(params) if not isinstance(params, list) else params[:8]}"
                            f", the optimizer numbers that group's {len(expected)} parameters {expected[:8]}")
    return problems


def numbered_names(saved_groups: Any, live_names: Sequence[Sequence[str]], where: str) -> dict[int, str]:
    """The live parameter each of torch.optim's parameter numbers names, for a state that numbers them
    (``saved_groups``: its ``param_groups``; ``live_names``: the live parameters' names, group by group):
    the one check of a numbered state's groups against the live optimizer (``torch_group_problems``),
    which NxD's folders, torch_xla's files and a numbered state dict are read through.

    Raises:
        CheckpointError: naming ``where``, each group that does not fit and how to build the groups.
    """
    problems = torch_group_problems(saved_groups, [{"params": names} for names in live_names], "param_groups")
    if problems:
        raise CheckpointError(f"{where} does not fit the optimizer's param groups (torch.optim numbers the parameters "
                              f"0..n-1 in group order, and its groups hold {[len(n) for n in live_names]}): "
                              + "; ".join(problems[:4]) + ". Build the param groups as the run that saved it did.")
    return {number: name for group, names in zip(saved_groups, live_names)
            for number, name in zip(group["params"], names)}


def _kind(value: Any) -> bool | None:
    return (value.dim() > 0) if isinstance(value, torch.Tensor) else None


_probed: dict[tuple[type, str], Kinds | None] = {}


def _throwaway(optimizer_class: type, hyperparameters: Mapping[str, Any]) -> tuple[Any, torch.Tensor]:
    """An instance of ``optimizer_class`` over one two-element CPU parameter, built with
    ``hyperparameters`` (as keyword arguments where its constructor takes them, in the group
    otherwise; kernel options left at its defaults), and that parameter. Raises what the class
    raises."""
    group = _plain_group(hyperparameters)
    accepted = inspect.signature(optimizer_class.__init__).parameters
    param = torch.zeros(2, requires_grad=True)
    return optimizer_class([{**group, "params": [param]}], **{k: v for k, v in group.items() if k in accepted}), param


def _plain_group(hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in hyperparameters.items() if k not in (*KERNEL_OPTIONS, "params", "param_names")}


def _key(optimizer_class: type, hyperparameters: Mapping[str, Any]) -> tuple[type, str]:
    """What the throwaway instances are remembered by: the class and its hyperparameters."""
    return optimizer_class, repr(sorted(_plain_group(hyperparameters).items(), key=lambda item: str(item[0])))


def state_kinds(optimizer_class: type, hyperparameters: Mapping[str, Any]) -> Kinds | None:
    """The state ``optimizer_class`` keeps for a parameter of a group holding ``hyperparameters``:
    from a throwaway instance built with them (``_throwaway``) and stepped once on its two-element
    CPU parameter, which an element-wise optimizer's ``step`` does not reach beyond. None when the
    class cannot be built or stepped so (then ``StateFit`` takes the live optimizer's own state's, where
    it has one; else only ``step`` may be 0-dim, and the keys are not checked). Remembered per class and
    hyperparameters."""
    key = _key(optimizer_class, hyperparameters)
    if key not in _probed:
        try:
            probe, param = _throwaway(optimizer_class, hyperparameters)
            param.grad = torch.zeros(2)
            probe.step()
            _probed[key] = {name: _kind(v) for name, v in probe.state[param].items()}
        except Exception:  # noqa: BLE001 - a class that cannot be probed: the fallback rule applies
            _probed[key] = None
    return _probed[key]


_zero_started: dict[tuple[type, str], "dict[str, torch.dtype] | None"] = {}


def zero_state(optimizer_class: type, hyperparameters: Mapping[str, Any]) -> dict[str, torch.dtype] | None:
    """The state ``optimizer_class`` keeps for a parameter of a group holding ``hyperparameters``, as
    ``{key: dtype of a 0-dim counter, or None for a tensor shaped like the parameter}``, where
    starting from zeros of it steps a parameter exactly as starting from no state does (Adam, AdamW,
    SGD without dampening, ...: what the optimizer may create before its first step). None where it
    does not (SGD's first momentum is the gradient itself under dampening), or the class keeps a
    non-tensor or cannot be probed. Asked of throwaway instances (``_throwaway``), two steps each;
    remembered per class and hyperparameters."""
    key = _key(optimizer_class, hyperparameters)
    if key not in _zero_started:
        _zero_started[key] = _zero_start(optimizer_class, hyperparameters)
    return _zero_started[key]


def _zero_start(optimizer_class: type, hyperparameters: Mapping[str, Any]) -> dict[str, torch.dtype] | None:
    try:
        probe, param = _throwaway(optimizer_class, hyperparameters)
        param.grad = torch.zeros(2)
        probe.step()
        template = dict(probe.state[param])
        if not template or not all(isinstance(v, torch.Tensor) and v.dim() in (0, 1) for v in template.values()):
            return None
        runs = []
        for start_from_zeros in (False, True):
            optimizer, param = _throwaway(optimizer_class, hyperparameters)
            with torch.no_grad():
                param.copy_(torch.tensor([1.0, -2.0]))
            if start_from_zeros:
                optimizer.state[param] = {k: torch.zeros_like(v) for k, v in template.items()}
            for grad in ((0.5, -0.25), (-0.125, 0.75)):
                param.grad = torch.tensor(grad)
                optimizer.step()
            runs.append((param.detach().clone(), dict(optimizer.state[param])))
        (a, state_a), (b, state_b) = runs
        if not torch.equal(a, b) or set(state_a) != set(template) or set(state_b) != set(template) or not all(
                torch.equal(state_a[k], state_b[k]) for k in template):
            return None
        return {k: v.dtype if v.dim() == 0 else None for k, v in template.items()}
    except Exception:  # noqa: BLE001 - a class that cannot be probed keeps its own lazy state
        return None


_constructed: dict[tuple[type, str], str | None] = {}


def _construct(optimizer_class: type, group: Mapping[str, Any]) -> str | None:
    """What ``optimizer_class`` says when built with the hyperparameters ``group`` (``_throwaway``):
    None if it accepts them, else its error. Remembered per class and group."""
    key = _key(optimizer_class, group)
    if key not in _constructed:
        try:
            _throwaway(optimizer_class, group)
            _constructed[key] = None
        except Exception as e:  # noqa: BLE001 - the class's own refusal, whatever its type
            _constructed[key] = f"{type(e).__name__}: {e}"
    return _constructed[key]


def constructor_refusal(optimizer_class: type, live: Mapping[str, Any], installed: Mapping[str, Any]) -> str | None:
    """The class's own refusal of the hyperparameters ``installed`` (``betas=(1.0, 0.999)``, a
    negative ``lr``), asked of a throwaway instance: the keys it refuses (each alone over the live
    group, else all that differ) and its message, where it refuses them while it accepts the
    ``live`` group's own; None where it accepts them, or where it refuses the live group too (a
    class that cannot be built so: nothing is learnt)."""
    refusal = _construct(optimizer_class, installed)
    if refusal is None or _construct(optimizer_class, live) is not None:
        return None
    changed = [k for k, v in installed.items() if k not in live or repr(live[k]) != repr(v)]
    named = [k for k in changed if _construct(optimizer_class, {**live, k: installed[k]}) is not None] or changed
    values = ", ".join(f"{k!r} = {_short(installed[k])}" for k in named)
    return f"{values}: {optimizer_class.__name__} refuses {'it' if len(named) == 1 else 'them'} ({refusal.rstrip('.')})"


def _short(value: Any) -> str:
    """``describe``, and short tuples and lists of plain values written out (``betas``)."""
    if isinstance(value, (tuple, list)) and len(value) <= 4 and all(isinstance(v, PLAIN) for v in value):
        return repr(value)
    return describe(value)


def check_step(value: Any, where: str) -> str | None:
    """The problem of a saved ``step`` (a 0-dim tensor or a number), None if it is a finite,
    non-negative whole number: a NaN, negative or fractional step turns the bias corrections, and
    every weight, NaN."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_complex or value.dtype == torch.bool:
            return f"{where} is not a number"
        number = float(value.detach().reshape(()).to("cpu", torch.float64))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        return f"{where} is a {type(value).__name__}, not a number"
    if not math.isfinite(number) or number < 0 or number != int(number):
        return f"{where} = {number!r}, not a finite, non-negative whole number of steps"
    return None


def check_state_entry(entry: Any, kinds: Kinds | None, shape: tuple[int, ...], where: str) -> list[str]:
    """The problems of one parameter's saved optimizer state ``entry`` (``{key: tensor}``)
    against ``kinds`` (``state_kinds``): the same keys (or none: a parameter without state
    yet), tensors of real dtype, shaped like the parameter (``shape``) or 0-dim where the class
    keeps them so (``is_moment``: with ``kinds`` None, only ``step`` may be 0-dim)."""
    if not isinstance(entry, Mapping):
        return [f"{where}: the state is a {type(entry).__name__}, not a dict"]
    if not entry:
        return []
    problems = []
    if kinds is not None and set(entry) != set(kinds):
        lacking, surplus = sorted(set(kinds) - set(entry), key=str), sorted(set(entry) - set(kinds), key=str)
        problems.append(f"{where}: state keys {sorted(map(str, entry))}, the optimizer's are {sorted(kinds)}"
                        + (f" (missing {lacking})" if lacking else "") + (f" (unknown {surplus})" if surplus else ""))
    for key, value in entry.items():
        if key == "step" and (found := check_step(value, f"{where}/step")):
            problems.append(found)
            continue
        if kinds is not None and kinds.get(key, False) is None:  # the optimizer's own is a number
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                problems.append(f"{where}/{key} is a {type(value).__name__}, not a number")
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"{where}/{key} is a {type(value).__name__}, not a tensor")
            continue
        if value.dtype.is_complex or value.dtype == torch.bool:
            problems.append(f"{where}/{key} is {value.dtype}, not a real number")
            continue
        moment = is_moment(key, value, kinds, saved=True)
        if moment and (tuple(value.shape) != tuple(shape) or not value.dtype.is_floating_point):
            problems.append(f"{where}/{key}: {value.dtype} of shape {tuple(value.shape)}, the optimizer keeps a "
                            f"floating tensor shaped like the parameter {tuple(shape)}")
        elif not moment and value.dim() != 0:
            problems.append(f"{where}/{key}: shape {tuple(value.shape)}, the optimizer keeps it 0-dim")
    return problems


class StateFit:
    """The check of one saved state against one optimizer: ``optimizer_class`` with param groups
    ``live_groups``, receiving the saved groups' hyperparameters ``saved_groups`` (dicts without
    ``params``, which the caller takes out where its format numbers them there; kernel options are
    checked for their kind and never installed).

    ``problems`` says everything that does not fit: the group count, each group's hyperparameters
    (their kinds, and their values as the class's constructor accepts them), and each state entry
    handed to it. ``live_states``: per param group, one parameter's (or shard's) state as the live
    optimizer keeps it, None where it has none yet: its kinds stand in for a class that cannot be
    probed (``kinds``).
    """

    def __init__(self, optimizer_class: type, live_groups: Sequence[Mapping[str, Any]], saved_groups: Sequence[Any],
                 live_states: Sequence[Mapping[str, Any] | None] = ()):
        self.optimizer_class = optimizer_class
        self.live_groups = list(live_groups)
        self.saved_groups = list(saved_groups)
        self.live_kinds: list[Kinds | None] = [{k: _kind(v) for k, v in state.items()} if state else None
                                               for state in live_states]

    def group_problems(self) -> list[str]:
        """The group count and each group's hyperparameters: of the kinds the live group holds,
        then of values the class accepts (``constructor_refusal``)."""
        if len(self.saved_groups) != len(self.live_groups):
            return [f"{len(self.saved_groups)} param groups, the optimizer has {len(self.live_groups)}"]
        problems = []
        for i, (saved, group) in enumerate(zip(self.saved_groups, self.live_groups)):
            try:
                check_hyperparameters(saved, group, f"param group {i}")
            except CheckpointError as e:
                problems.append(str(e).rstrip("."))
                continue
            refusal = constructor_refusal(self.optimizer_class, group, installed_hyperparameters(group, saved))
            if refusal:
                problems.append(f"param group {i}: {refusal}")
        return problems

    def kinds(self, group: int) -> Kinds | None:
        """The state kinds of param group ``group`` once its saved hyperparameters are installed (call after
        ``group_problems`` found none); where the class cannot be probed, the live optimizer's own state's,
        else None."""
        probed = state_kinds(self.optimizer_class, installed_hyperparameters(self.live_groups[group],
                                                                            self.saved_groups[group]))
        if probed is None and group < len(self.live_kinds):
            return self.live_kinds[group]
        return probed

    def problems(self, entries: Iterable[tuple[int, str, Any, tuple[int, ...]]] = ()) -> list[str]:
        """Everything that does not fit: ``group_problems``, then each entry ``(group, where,
        state, shape)`` against the state its installed group keeps."""
        problems = self.group_problems()
        if problems:
            return problems
        for group, where, entry, shape in entries:
            problems += check_state_entry(entry, self.kinds(group), shape, where)
        return problems


# ---------------------------------------------------------------------------- the loss scaler
#: The keys of a ``DynamicLossScaler`` state.
SCALER_KEYS = ("scale", "growth_tracker", "hysteresis_tracker")
INT32 = (-(2**31), 2**31 - 1)


def _number(value: Any) -> float | None:
    """A 0-dim real tensor's or a Python number's value (never a bool), else None."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_complex or value.dtype == torch.bool:
            return None
        return float(value.detach().to("cpu", torch.float64))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def as_fp32(value: float) -> float:
    """``value`` rounded to float32 (what the scale tensor holds, and what ``clamp`` compares with)."""
    return float(torch.tensor(value, dtype=torch.float64).to(torch.float32))


def _scale_problem(value: float, scaler: Any) -> str | None:
    rounded = as_fp32(value)
    if not (math.isfinite(rounded) and rounded > 0):
        return (f"['scale'] = {value!r}, not a positive number finite in float32: a NaN, inf or zero scale "
                f"makes every step overflow, so every later step is skipped")
    if scaler is None:
        return None
    low, high = as_fp32(scaler.min_scale), as_fp32(scaler.max_scale)
    if low <= rounded <= high:
        return None
    if rounded > high:
        why = ("update() only backs it off on an overflow, by backoff_factor each time, so every step until it "
               "is back in range is likely skipped (near the float32 maximum every step overflows)")
    else:
        why = ("update() grows it only by growth_factor each growth_interval clean steps, while small gradients "
               "underflow to zero in fp16, and the next back-off would jump it up to min_scale")
    return (f"['scale'] = {value!r}, not in this scaler's [min_scale, max_scale] = [{low!r}, {high!r}], the "
            f"range update() keeps it in: {why}; build the DynamicLossScaler with bounds that hold it")


def _tracker_problem(key: str, value: float, scaler: Any) -> str | None:
    if not math.isfinite(value) or value != math.floor(value):
        return f"[{key!r}] = {value!r}, not a whole number: the tracker is an int32 count"
    if scaler is None:
        if 0 <= value <= INT32[1]:
            return None
        return (f"[{key!r}] = {value!r}, not in [0, {INT32[1]}]: the tracker is an int32 count that update() "
                f"never takes below 0")
    if key == "growth_tracker":
        high = scaler.growth_interval - 1
        if 0 <= value <= high:
            return None
        return (f"['growth_tracker'] = {value!r}, not in [0, growth_interval - 1] = [0, {high}]: update() resets "
                f"it to 0 on an overflow and on reaching growth_interval, so it never saves one at or above it; it "
                f"would grow the scale on the next clean step, sooner than the saving run would have (and one "
                f"near the int32 maximum wrapped the pre-clamp count negative, so the scale never grew again); "
                f"build the DynamicLossScaler with a growth_interval above it")
    high = scaler.hysteresis
    if value > high:
        return (f"['hysteresis_tracker'] = {value!r}, not in [0, hysteresis] = [0, {high}]: update() resets it to "
                f"hysteresis on each growth and counts it down on each overflow; with more, the scaler skips that "
                f"many overflowing steps before it backs off (near the int32 maximum, practically never); build "
                f"the DynamicLossScaler with a hysteresis of at least {value:.0f}")
    if value < 0:
        return (f"['hysteresis_tracker'] = {value!r}, not in [0, hysteresis] = [0, {high}]: update() stops "
                f"counting it down at 0, where every overflow backs off (only the pre-release update went below "
                f"0, and from the int32 minimum its next overflow wrapped the count to the maximum, after which "
                f"the scaler never backed off and skipped every step); set it to 0, which behaves the same")
    return None


def check_scaler_state(saved: Any, scaler: Any = None) -> list[str]:
    """The problems of ``saved`` as a ``DynamicLossScaler`` state, each starting with the field
    (``['scale'] = nan, ...``) and saying the value, the range and what ``update`` would do with it;
    empty if ``load_state_dict`` takes it. Changes nothing.

    ``saved`` must hold exactly ``SCALER_KEYS``, each a 0-dim real tensor or a Python number (not a
    bool), with ``scale`` positive and finite once rounded to float32 and both trackers whole numbers.
    With ``scaler`` (the live one) the values must also lie in the box its ``update`` keeps to and can
    count from without its int32 counters wrapping:

    * ``scale`` (rounded to float32) in ``[min_scale, max_scale]`` (each rounded to float32);
    * ``growth_tracker`` in ``[0, growth_interval - 1]``;
    * ``hysteresis_tracker`` in ``[0, hysteresis]``. Negative values, which the update before the
      clamp at 0 saved after overflows in a row, are refused, not read as 0: nxd_smp has had no
      release that saved them, and the message says to set them to 0 (the same behaviour).

    Without ``scaler``: the kinds above, and both trackers in ``[0, 2**31 - 1]`` (int32, and no
    scaler counts below 0).
    """
    if not isinstance(saved, Mapping):
        return [f" is a {type(saved).__name__}, not a dict of {list(SCALER_KEYS)}"]
    if set(saved) != set(SCALER_KEYS):
        return [f" has the keys {sorted(map(str, saved))}, a loss scaler's are {sorted(SCALER_KEYS)}"]
    problems = []
    for key in SCALER_KEYS:
        value = _number(saved[key])
        if value is None:
            problem = f"[{key!r}] is a {type(saved[key]).__name__}, not a 0-dim real number"
        elif key == "scale":
            problem = _scale_problem(value, scaler)
        else:
            problem = _tracker_problem(key, value, scaler)
        if problem:
            problems.append(problem)
    return problems
