"""The strict reader of pickled files: every ``torch.save`` file nxd_smp must still read (NxD's plain
and xser folders, torch_xla's per-rank dicts, the training loops' optimizer files, nxd_smp's formats
1 and 2) is loaded here and nowhere else.

``load_file`` / ``load_bytes``: ``torch.load(weights_only=True)`` on a zip archive whose records
are stored uncompressed inside the file and whose pickle calls nothing that allocates by a number it
names (``bytearray(n)``, ``torch.Tensor(n)``, the legacy ``torch.FloatTensor(n)``), every storage no
larger than the record holding its bytes, every tensor in it dense, on the CPU and not overlapping
itself (no expanded tensor, which would grow when copied). What a file allocates is then bounded by
its size. Everything raises ``CheckpointError`` naming the file and what it asked for.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import warnings
import zipfile
from collections.abc import Mapping
from typing import Any

import torch

from ..core.errors import CheckpointError
from .paths import inside, open_regular


class UnsafeFileError(CheckpointError):
    """A file asks to build an object that loading must not build (it could run code)."""


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
