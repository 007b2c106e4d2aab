"""The one validation layer every checkpoint reader goes through: a checkpoint is data that
strangers hand you.

Every reader (nxd_smp's formats 1 and 2, NxD's plain and xser tag folders, ``import_torch``,
``import_xla``, the offline tools) asks this module

* **where a file is** (``inside``): a name from an index or a reference resolves inside the
  checkpoint folder (no absolute path, no ``..``, no link out of it), and only regular files
  are opened (``open_regular``: never a FIFO, a device or a socket);
* **what a pickled file holds** (``load_file``, ``load_bytes``): ``torch.load(weights_only=True)``
  on a zip archive whose records are stored uncompressed inside the file and whose pickle calls
  nothing that allocates by a number it names (``bytearray(n)``, the legacy ``torch.FloatTensor(n)``),
  every tensor in it dense, on the CPU and not overlapping itself (no expanded tensor, which
  would grow when copied). What a file allocates is then bounded by its size;
* **whether a value fits the live object** (``check_cast``, ``check_hyperparameters``,
  ``check_state_entry``, ``check_scheduler_state``): the dtype converts exactly, the
  hyperparameters are the group's own keys of the group's own types, the optimizer state has
  the inner optimizer's keys, tensor or scalar as its own, the scheduler state its own keys.

Everything raises ``CheckpointError`` naming the file and the field. The readers check
before they allocate at full size and before they change anything; ``load_objects`` loads
the caller's stateful objects so that a refusal puts them back.
"""

from __future__ import annotations

import copy
import inspect
import io
import math
import os
import pickle
import pickletools
import re
import stat
import warnings
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .param_groups import KERNEL_OPTIONS

__all__ = [
    "CheckpointError",
    "is_size",
    "is_shape",
    "inside",
    "open_regular",
    "load_file",
    "load_bytes",
    "check_tensors",
    "check_cast",
    "check_hyperparameters",
    "check_scheduler_state",
    "is_scheduler",
    "state_kinds",
    "check_state_entry",
    "check_torch_optimizer_state",
    "load_objects",
    "REFERENCE_FOLDER",
    "is_reference",
    "check_reference",
]


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, damaged, refused (it asks to run code, reads outside
    its folder, claims more memory than it holds), or does not fit the model/optimizer; the
    message names the file or the tensors and the fix."""


# ---------------------------------------------------------------------------- files
def is_size(value: Any) -> bool:
    """Whether ``value`` is a size, offset or length: a non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_shape(value: Any) -> bool:
    """Whether ``value`` is a shape: a tuple or list of sizes."""
    return isinstance(value, (tuple, list)) and all(is_size(d) for d in value)


def inside(folder: str | os.PathLike, name: Any, *, source: str = "the checkpoint") -> Path:
    """The file ``name`` (as an index or a reference names it) of the checkpoint ``folder``,
    resolved: a relative path with no ``..`` whose real location (links followed) lies inside
    the folder's.

    Raises:
        CheckpointError: ``name`` is not a string, absolute, climbs with ``..``, or resolves
            outside the folder; checked before the file's existence, so a refusal does not tell
            which files exist.
    """
    if not isinstance(name, (str, os.PathLike)) or not str(name):
        raise CheckpointError(f"{source} names a file {name!r}, which is not a path; refused.")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise CheckpointError(f"{source} names the file {str(name)!r} outside its folder; refused "
                              f"(a checkpoint's files are relative paths inside it).")
    root = Path(folder).resolve()
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise CheckpointError(f"{source} names the file {str(name)!r}, a link to {path} outside the "
                              f"checkpoint folder {root}; refused.")
    return path


def open_regular(path: str | os.PathLike) -> io.FileIO:
    """``path`` opened for reading, unbuffered, if it is a regular file: a FIFO (which would
    block), a device or a socket is refused without reading from it.

    Raises:
        CheckpointError: not a regular file, or missing.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing.") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be opened: {e.strerror or e}.") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise CheckpointError(f"{path} is {kind}; a checkpoint's files are regular files. Refused.")
    os.set_blocking(fd, True)
    return io.FileIO(fd, "rb", closefd=True)


# ---------------------------------------------------------------------------- pickled files
def _constructors() -> frozenset[str]:
    """The globals torch's ``weights_only`` unpickler admits whose call allocates by a size given
    as a number (a few bytes of pickle could ask for gigabytes): ``bytearray(n)``,
    ``torch.Tensor(n)``, the legacy ``torch.FloatTensor(n)``. As arguments they are harmless."""
    legacy = {f"{cls.__module__} {cls.__name__}" for cls in torch._tensor_classes}
    return frozenset({"builtins bytearray", "__builtin__ bytearray", "torch Tensor", *legacy})


_REFUSED_CALLS = _constructors()


class _Global(str):
    """A global a pickle names (``"module name"``), as the scan below sees it."""


_MARK, _OPAQUE = object(), object()


def _storage_bytes(pid: Any) -> tuple[str, int] | None:
    """``(record key, bytes)`` that a ``torch.save`` storage reference ``("storage", type, key,
    location, numel)`` makes torch take from the record ``data/<key>``; None if it is no such one."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Global)
            and isinstance(pid[2], str) and isinstance(pid[4], int) and pid[4] >= 0):
        return None
    module, _, name = pid[1].partition(" ")
    if name == "UntypedStorage":
        return pid[2], pid[4]
    cls = getattr(torch, name, None) if module == "torch" else None
    with warnings.catch_warnings():  # (a typed storage class's dtype warns that typed storages are deprecated)
        warnings.simplefilter("ignore", UserWarning)
        dtype = getattr(cls, "dtype", None)
    return (pid[2], pid[4] * dtype.itemsize) if isinstance(dtype, torch.dtype) else None


def _scan_pickle(stream: Any, source: str) -> list[tuple[str, int]]:
    """Walk a ``torch.save`` pickle as torch's ``weights_only`` unpickler would, keeping only
    the names, strings and numbers on its stack: refuse a call of a constructor that allocates
    by a number (``_REFUSED_CALLS``), and return every storage reference's ``(key, bytes)``.
    Opcodes that loader does not accept are refused here too."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    storages = []

    def to_mark() -> list[Any]:
        i = len(stack) - 1 - stack[::-1].index(_MARK)
        items = stack[i + 1:]
        del stack[i:]
        return items

    for opcode, arg, _ in pickletools.genops(stream):
        op = opcode.name
        if op in ("PROTO", "STOP", "FRAME"):
            continue
        if op == "GLOBAL":
            stack.append(_Global(arg))
        elif op in ("BINUNICODE", "SHORT_BINUNICODE", "SHORT_BINSTRING", "BININT", "BININT1", "BININT2", "LONG1",
                    "BINFLOAT"):
            stack.append(arg)
        elif op in ("NONE", "NEWTRUE", "NEWFALSE"):
            stack.append({"NONE": None, "NEWTRUE": True, "NEWFALSE": False}[op])
        elif op in ("EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"):
            stack.append(_OPAQUE)
        elif op == "MARK":
            stack.append(_MARK)
        elif op == "TUPLE":
            stack.append(tuple(to_mark()))
        elif op in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(op[-1])
            items = tuple(stack[len(stack) - n:]) if len(stack) >= n else None
            if items is None:
                raise IndexError(op)
            del stack[len(stack) - n:]
            stack.append(items)
        elif op in ("BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1]
        elif op == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif op in ("BINGET", "LONG_BINGET"):
            stack.append(memo.get(arg, _OPAQUE))
        elif op in ("APPEND", "BUILD"):
            stack.pop()
        elif op == "SETITEM":
            del stack[-2:]
        elif op in ("APPENDS", "SETITEMS"):
            to_mark()
        elif op in ("REDUCE", "NEWOBJ"):
            stack.pop()
            func = stack.pop()
            if op == "REDUCE" and func in _REFUSED_CALLS:
                raise CheckpointError(f"{source} asks to call {func.replace(' ', '.')}(...), which allocates by a "
                                      f"number it is given: a few bytes could claim any amount of memory. Refused "
                                      f"(save bytes or tensors instead).")
            stack.append(_OPAQUE)
        elif op == "BINPERSID":
            reference = _storage_bytes(stack.pop())
            if reference is None:
                raise CheckpointError(f"{source} holds a persistent reference that is not a torch.save storage.")
            storages.append(reference)
            stack.append(_OPAQUE)
        else:
            raise CheckpointError(f"{source} uses the pickle opcode {op}, which torch.load(weights_only=True) does "
                                  f"not accept; refused.")
    return storages


def _check_archive(file: Any, size: int, source: str) -> None:
    """``file`` (``size`` bytes) is a ``torch.save`` zip archive that allocates no more than its
    size: every record stored (not compressed) inside the file, a pickle that calls no
    constructor taking a size (``bytearray(n)``), and every storage it refers to no larger than
    the record that holds its bytes (torch would take the size from the pickle and read past the
    record). Torch's own loader then enforces the rest."""
    try:
        with zipfile.ZipFile(file) as archive:
            records = archive.infolist()
            pickles = [r for r in records if r.filename.endswith("/data.pkl") and r.filename.count("/") == 1]
            for record in records:
                if record.compress_type != zipfile.ZIP_STORED or record.header_offset + record.file_size > size:
                    raise CheckpointError(f"{source}: the record {record.filename!r} is compressed or claims more "
                                          f"bytes than the file holds; torch.save writes neither. Refused.")
            if len(pickles) != 1:
                raise CheckpointError(f"{source} is not a torch.save archive (no data.pkl record).")
            with archive.open(pickles[0]) as stream:
                storages = _scan_pickle(stream, source)
            sizes = {r.filename: r.file_size for r in records}
            prefix = pickles[0].filename.rsplit("/", 1)[0]
            for key, nbytes in storages:
                held = sizes.get(f"{prefix}/data/{key}")
                if held is None or held < nbytes:
                    raise CheckpointError(f"{source}: a storage claims {nbytes} bytes from the record data/{key}, "
                                          f"which holds {held or 0}; refused (a crafted file).")
    except zipfile.BadZipFile:
        raise CheckpointError(f"{source} is not a torch.save zip archive (the format torch has written since 1.6); "
                              f"nxd_smp reads no other.") from None
    except (ValueError, EOFError, IndexError, KeyError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{source} holds a damaged pickle: {type(e).__name__}: {e}") from None
    finally:
        file.seek(0)


def _torch_load(file: Any, source: str) -> Any:
    try:
        value = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{source} was refused by torch.load(weights_only=True): {_first_line(e)} Loading it as it is could "
            f"run code from the file. If it holds a class of your own that you trust, allow it with "
            f"torch.serialization.add_safe_globals([TheClass]) and load again."
        ) from None
    except (RuntimeError, ValueError, TypeError, EOFError, OverflowError, MemoryError) as e:
        raise CheckpointError(f"{source} cannot be loaded: {type(e).__name__}: {_first_line(e)}") from None
    check_tensors(value, source)
    return value


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    for line in text.splitlines():
        if "Unsupported global" in line or "GLOBAL" in line:
            return line.strip()
    return text.splitlines()[0] if text else type(error).__name__


def load_file(path: str | os.PathLike, *, folder: str | os.PathLike | None = None, name: Any = None) -> Any:
    """A ``torch.save`` file loaded on the CPU without running code from it and without
    allocating more than the file holds. With ``folder`` and ``name``: the file ``name`` inside
    the checkpoint ``folder`` (``inside``); else ``path`` itself, which must be a regular file.
    A class of the caller's own loads once allowed with ``torch.serialization.add_safe_globals``
    (torch's rule since 2.6).

    Raises:
        CheckpointError: the file is outside the folder, not a regular file, not a torch.save
            archive, asks for a class ``weights_only`` refuses, or holds a tensor that is not a
            dense CPU tensor; naming the file and what it asked for.
    """
    if folder is not None:
        path = inside(folder, name, source=str(path))
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        _check_archive(f, size, str(path))
        proc = f"/proc/self/fd/{f.fileno()}"  # the file checked above, even if the name moved since
        return _torch_load(proc if os.path.exists(proc) else f, str(path))


def load_bytes(data: bytes | bytearray | memoryview, source: str) -> Any:
    """``load_file`` for a ``torch.save`` record already read into memory (DCP's records)."""
    buffer = io.BytesIO(data)
    _check_archive(buffer, len(data), source)
    return _torch_load(buffer, source)


# ---------------------------------------------------------------------------- tensors
def _overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether two indices of ``tensor`` share an element (an expanded, stride-0 tensor does):
    copying it then allocates more than its storage holds."""
    reach = 0
    for stride, size in sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.shape) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def check_tensors(value: Any, source: str, *, at: tuple = (), seen: set[int] | None = None) -> None:
    """Every tensor inside ``value`` (dicts, lists, tuples, sets) is a dense strided CPU tensor
    that does not overlap itself: no sparse, quantized, nested or meta tensor, no expanded one.

    Raises:
        CheckpointError: naming ``source``, where in ``value`` the tensor is, and what it is.
    """
    if len(at) > 64:
        raise CheckpointError(f"{source} nests containers more than 64 deep; refused.")
    seen = set() if seen is None else seen
    if id(value) in seen:  # a container or tensor the file refers to twice is checked once
        return
    if isinstance(value, (torch.Tensor, Mapping, list, tuple, set, frozenset)):
        seen.add(id(value))
    if isinstance(value, torch.Tensor):
        where = "/".join(map(str, at)) or "the top level"
        if value.layout != torch.strided or value.is_quantized or value.is_nested or value.device.type != "cpu":
            kind = (f"a {value.layout} tensor" if value.layout != torch.strided else "a quantized tensor"
                    if value.is_quantized else f"a tensor on {value.device}")
            raise CheckpointError(f"{source} holds {kind} of shape {tuple(value.shape)} at {where}; checkpoints hold "
                                  f"dense CPU tensors. Refused.")
        if _overlaps_itself(value):
            raise CheckpointError(f"{source} holds an expanded tensor of shape {tuple(value.shape)} at {where} "
                                  f"(strides {value.stride()}: elements shared, more than its storage holds). Refused.")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            check_tensors(key, source, at=(*at, "<key>"), seen=seen)
            check_tensors(item, source, at=(*at, key), seen=seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, item in enumerate(value):
            check_tensors(item, source, at=(*at, i), seen=seen)


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


# ---------------------------------------------------------------------------- fields
_PLAIN = (type(None), bool, int, float, str)


def _misfit(saved: Any, live: Any, finite: bool = True, at: str = "") -> str | None:
    """Where and how ``saved`` is not a value of the kind ``live`` is (a hyperparameter, a
    scheduler field), None if it is: a real number for a number or a one-element tensor (finite
    where ``finite``; never a bool), bools for bools, the same length for tuples and lists, the
    same keys for dicts (never ``optimizer``), recursively. ``at``: the path so far."""
    here = f"{at} = {_describe(saved)} where the live value is {_describe(live)}"
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
        return next((m for i, (s, v) in enumerate(zip(saved, live)) if (m := _misfit(s, v, finite, f"{at}[{i}]"))),
                    None)
    if live is None:
        plain = isinstance(saved, _PLAIN) or (isinstance(saved, (tuple, list)) and all(isinstance(v, _PLAIN) for v in saved))
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
        return next((m for k in live if (m := _misfit(saved[k], live[k], finite, f"{at}[{k!r}]"))), None)
    return None if type(saved) is type(live) else here


def _describe(value: Any) -> str:
    text = repr(value) if isinstance(value, _PLAIN) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


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
            problems.append(f"a key {_describe(key)} that is not a string")
        elif key == "params":
            problems.append("'params', which is not a hyperparameter (a group's parameters are the live ones)")
        elif key in KERNEL_OPTIONS:
            if value is not None and not isinstance(value, bool):
                problems.append(f"{key!r} = {_describe(value)}, not True, False or None")
        elif key == "param_names":  # torch >= 2.7 writes the names of named parameters
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                problems.append(f"'param_names' = {_describe(value)}, not a list of names")
        elif key in group:
            if misfit := _misfit(value, group[key], at=repr(key)):
                problems.append(misfit)
        elif not isinstance(value, _PLAIN):
            problems.append(f"{key!r} = {_describe(value)}, unknown to the group and not a plain value")
    if problems:
        raise CheckpointError(f"{where}: hyperparameters that do not fit the param group: " + "; ".join(problems) + ".")


def check_scheduler_state(saved: Any, scheduler: Any, where: str) -> None:
    """``saved`` has exactly the keys the scheduler's own ``state_dict()`` has, each of the kind
    it holds there (nested states too: ``SequentialLR``'s), and no ``optimizer`` (which would
    replace the scheduler's optimizer). Non-finite numbers are kept (``ReduceLROnPlateau``'s
    ``best`` starts at infinity).

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
                 if (m := _misfit(saved[key], live[key], finite=False, at=repr(key)))]
    if problems:
        raise CheckpointError(f"{where}: the scheduler state does not fit {type(scheduler).__name__}: "
                              + "; ".join(problems) + ".")


def _kind(value: Any) -> bool | None:
    """A state value's kind: True a tensor shaped like its parameter, False a 0-dim tensor, None
    a Python number (transformers' Adafactor keeps ``step`` so)."""
    return (value.dim() > 0) if isinstance(value, torch.Tensor) else None


def is_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is one of torch's LR schedulers (its state is checked as a scheduler's)."""
    lr = torch.optim.lr_scheduler
    return isinstance(obj, (lr.LRScheduler, lr.ReduceLROnPlateau))


def state_kinds(optimizer: Any) -> dict[str, bool | None] | None:
    """The inner optimizer's (or a torch optimizer's) own state keys, each True for a tensor shaped like its parameter
    (a moment), False for a 0-dim one (``step``), None for a Python number: from its live state, or, before its first
    step, from a throwaway instance of its class stepped once on a two-element parameter. None
    when the class cannot be built that way (then only ``step`` may be 0-dim). The probe runs
    the class's ``__init__`` and ``step`` on a CPU tensor: an element-wise optimizer's, as
    ``Zero1Optimizer`` requires, touches nothing else."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    for entry in inner.state.values():
        if entry:
            return {key: _kind(v) for key, v in entry.items()}
    cls = type(inner)
    try:
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in inner.defaults.items() if k in accepted and k not in KERNEL_OPTIONS}
        group = {k: v for k, v in inner.param_groups[0].items() if k not in ("params", *KERNEL_OPTIONS)}
        param = torch.zeros(2, requires_grad=True)
        probe = cls([{**group, "params": [param]}], **kwargs)
        param.grad = torch.zeros(2)
        probe.step()
        return {key: _kind(v) for key, v in probe.state[param].items()}
    except Exception:  # noqa: BLE001 - a class that cannot be probed; the fallback rule applies
        return None


def check_state_entry(entry: Any, kinds: Mapping[str, bool | None] | None, shape: tuple[int, ...], where: str) -> list[str]:
    """The problems of one parameter's saved optimizer state ``entry`` (``{key: tensor}``)
    against the inner optimizer's ``kinds`` (``state_kinds``): the same keys (or none: a
    parameter without state yet), tensors of real dtype, shaped like the parameter (``shape``)
    or 0-dim where the optimizer's own are; with ``kinds`` None only ``step`` may be 0-dim."""
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
        moment = kinds.get(key, True) if kinds is not None else key != "step"
        if moment and (tuple(value.shape) != tuple(shape) or not value.dtype.is_floating_point):
            problems.append(f"{where}/{key}: {value.dtype} of shape {tuple(value.shape)}, the optimizer keeps a "
                            f"floating tensor shaped like the parameter {tuple(shape)}")
        elif not moment and value.dim() != 0:
            problems.append(f"{where}/{key}: shape {tuple(value.shape)}, the optimizer keeps it 0-dim")
    return problems


def check_torch_optimizer_state(saved: Any, optimizer: torch.optim.Optimizer, source: str) -> None:
    """``saved`` is a ``state_dict()`` of ``optimizer`` (a plain torch optimizer: NxD's with
    ZeRO-1 off): as many groups of as many parameters, hyperparameters of the groups' kinds,
    per parameter id the optimizer's own state keys, moments shaped like the parameter.

    Raises:
        CheckpointError: naming ``source`` and every field that does not fit.
    """
    groups, state = (saved.get("param_groups"), saved.get("state")) if isinstance(saved, Mapping) else (None, None)
    if not isinstance(groups, list) or not isinstance(state, Mapping) or not all(
            isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        raise CheckpointError(f"{source} is not a torch optimizer state dict ('state' and 'param_groups').")
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointError(f"{source} holds param groups of {[len(g['params']) for g in groups]} parameters, the "
                              f"optimizer {[len(g['params']) for g in optimizer.param_groups]}.")
    shapes = {i: tuple(p.shape) for saved_group, group in zip(groups, optimizer.param_groups)
              for i, p in zip(saved_group["params"], group["params"])}
    problems = []
    for i, (saved_group, group) in enumerate(zip(groups, optimizer.param_groups)):
        try:
            check_hyperparameters({k: v for k, v in saved_group.items() if k != "params"}, group, f"param group {i}")
        except CheckpointError as e:
            problems.append(str(e).rstrip("."))
    kinds = state_kinds(optimizer)
    for i, entry in state.items():
        if i not in shapes:
            problems.append(f"state for parameter {i!r}, which the param groups do not list")
        else:
            problems += check_state_entry(entry, kinds, shapes[i], f"parameter {i}")
    if problems:
        raise CheckpointError(f"{source}: the optimizer state does not fit: " + "; ".join(problems) + ".")


# ---------------------------------------------------------------------------- objects
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


# ---------------------------------------------------------------------------- references
#: What a ``Zero1Optimizer`` hands a training loop that keeps one rank's optimizer file (the
#: Hugging Face Trainer's ``optimizer.pt``, accelerate's ``optimizer.bin``) once every rank's
#: state is in the nxd_smp checkpoint ``REFERENCE_FOLDER`` beside that file
#: (``nxd_smp.loop_checkpoints``): a small dict naming that checkpoint by the id of its save.
REFERENCE_FORMAT = "nxd_smp.checkpoint_reference/1"
REFERENCE_FOLDER = "nxd_smp"
_REFERENCE_KEYS = {"format", "checkpoint", "id", "dp_size", "note"}


def is_reference(value: Any) -> bool:
    """Whether ``value`` claims to be a checkpoint reference (``check_reference`` says if it is one)."""
    return isinstance(value, Mapping) and value.get("format") == REFERENCE_FORMAT


def check_reference(value: Any, source: str) -> dict[str, Any]:
    """``value`` (read from ``source``) as a checkpoint reference, checked: its own keys, the
    folder name nxd_smp writes (never a path), a 32-digit hex id and a positive DP size.

    Raises:
        CheckpointError: naming what does not fit.
    """
    if not isinstance(value, Mapping) or set(value) != _REFERENCE_KEYS or value["format"] != REFERENCE_FORMAT:
        raise CheckpointError(f"{source}: not an nxd_smp checkpoint reference (keys {sorted(_REFERENCE_KEYS)}).")
    problems = []
    if value["checkpoint"] != REFERENCE_FOLDER:
        problems.append(f"checkpoint {value['checkpoint']!r} (nxd_smp writes {REFERENCE_FOLDER!r})")
    if not isinstance(value["id"], str) or not re.fullmatch(r"[0-9a-f]{32}", value["id"]):
        problems.append(f"id {_describe(value['id'])} (32 hex digits)")
    if not is_size(value["dp_size"]) or value["dp_size"] < 1:
        problems.append(f"dp_size {_describe(value['dp_size'])}")
    if not isinstance(value["note"], str) or len(value["note"]) > 1000:
        problems.append("note (text)")
    if problems:
        raise CheckpointError(f"{source}: the nxd_smp checkpoint reference is damaged or crafted: "
                              + "; ".join(problems) + ".")
    return dict(value)
