"""The one safe open of a checkpoint's files: a name from an index, a record or a reference
resolves inside the checkpoint folder (no absolute path, no ``..``, no link out of it), and only
regular files are opened (never a FIFO, which would block, a device or a socket); the
small JSON files are read with a bound on their size (``read_small``, ``read_json``).
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..core.errors import CheckpointError
from .typed_json import loads  # (the one JSON parse of a checkpoint's files: no NaN constants)
from .values import is_size


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


#: The most a small JSON file of a checkpoint (a record, a completion record, a DP size) may
#: hold: such files are a few KB; a larger one is crafted, and is refused before it is read.
SMALL_FILE_LIMIT = 64 << 20


def read_small(folder: str | os.PathLike, name: str, *, limit: int = SMALL_FILE_LIMIT,
               source: str | None = None) -> bytes:
    """The bytes of the small file ``name`` of the checkpoint ``folder``: resolved inside it
    (``inside``), opened without blocking as a regular file (``open_regular``), and refused if
    it holds more than ``limit`` bytes, so that a crafted file can neither block the reader,
    lead it outside the folder, nor make it read without bound.

    Raises:
        CheckpointError: any of those, or the file is missing; naming the file.
    """
    path = inside(folder, name, source=source or str(Path(folder) / name))
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CheckpointError(f"{path} holds {size} bytes, more than the {limit} such a file may; refused.")
        data = f.read(limit + 1)
    if len(data) > limit:  # (it grew since)
        raise CheckpointError(f"{path} holds more than the {limit} bytes such a file may; refused.")
    return data


def read_json(folder: str | os.PathLike, name: str, *, limit: int = SMALL_FILE_LIMIT) -> Any:
    """The JSON value of the small file ``name`` of the checkpoint ``folder``, read by
    ``read_small``.

    Raises:
        CheckpointError: as ``read_small``, or the file is not JSON (damaged); naming it.
    """
    return loads(read_small(folder, name, limit=limit), str(Path(folder) / name))


def check_spans(folder: str | os.PathLike, records: Iterable[tuple[str, Any, int, int]], *,
                source: str) -> dict[Any, Path]:
    """Every record ``(key, file name, offset, length)`` of an index (format 3's JSON, a DCP
    ``.metadata``) in a regular file inside ``folder``, within the file's size, and no two records
    of one file overlapping: what a reader of the records allocates and reads is then bounded by the
    folder. Returns each file name resolved (``inside``).

    Raises:
        CheckpointError: naming ``source``, the entry and the file.
    """
    sizes: dict[Any, tuple[Path, int]] = {}
    spans: dict[Path, list[tuple[int, int, str]]] = {}  # by the file itself: "a.bin" and "./a.bin" are one
    for key, name, offset, length in records:
        if not (is_size(offset) and is_size(length)):
            raise CheckpointError(f"{source}: entry {key!r} has the offset {offset!r} and length {length!r}; refused.")
        if not isinstance(name, str):
            raise CheckpointError(f"{source}: entry {key!r} names the file {name!r}, which is not a name; refused.")
        if name not in sizes:
            file = inside(folder, name, source=f"{source}: entry {key!r}")
            try:
                st = os.stat(file)
            except FileNotFoundError:
                raise CheckpointError(f"{source}: entry {key!r} is in {name}, which is missing.") from None
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{source}: entry {key!r} is in {name}, which is not a regular file; refused.")
            sizes[name] = (file, st.st_size)
        file, size = sizes[name]
        if offset + length > size:
            raise CheckpointError(f"{source}: entry {key!r} claims bytes [{offset}, {offset + length}) of {name}, "
                                  f"which holds {size} (truncated, or a crafted index).")
        spans.setdefault(file, []).append((offset, offset + length, key))
    for file, found in spans.items():
        found.sort()
        for (_, end, first), (start, _, second) in zip(found, found[1:]):
            if start < end:
                raise CheckpointError(f"{source}: the entries {first!r} and {second!r} overlap in {file.name}; refused "
                                      f"(each record's bytes are its own).")
    return {name: file for name, (file, _) in sizes.items()}
