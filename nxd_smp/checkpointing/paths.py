"""The one safe open of a checkpoint's files: a name from an index, a record or a reference
resolves inside the checkpoint folder (no absolute path, no ``..``, no link out of it), and only
regular files are opened (never a FIFO, which would block, a device or a socket).
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path
from typing import Any

from ..core.errors import CheckpointError


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
