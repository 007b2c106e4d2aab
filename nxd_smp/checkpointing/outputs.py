"""Writing an output file or directory safely: never over an existing file, directory or link
unasked, never through a link.

An output is written into a staging name made exclusively beside it (``tempfile.mkstemp``,
``O_CREAT | O_EXCL``, for a file; a fresh ``tempfile.mkdtemp`` for a directory), fsynced and
moved into place by ``publish.place_file`` / ``place_directory``: without ``overwrite`` the move
cannot clobber; with it the name itself is replaced (a link is replaced, never followed; an old
directory as a whole). A failure removes the staging and leaves the target as it was.

The parent directory is made if missing and may be reached through links: only the last
component of the target is never followed.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..core.errors import CheckpointError
from .publish import fsync_tree, place_directory, place_file


def check_target(out: str | os.PathLike, *, overwrite: bool, directory: bool) -> Path:
    """``out`` as a ``Path`` if an output may be written there, checked without following
    its last component: absent; for a directory output, an empty directory (not a link to
    one); with ``overwrite=True``, anything but a directory for a file output, anything at
    all for a directory output.

    Raises:
        TypeError: ``out`` is not a path, or ``overwrite`` not a bool.
        CheckpointError: something is at ``out`` (named, with the fix); ``out`` names no new
            entry (``.``, ``..``); a parent of ``out`` is a file.
    """
    if not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"the output path must be a str or os.PathLike, got {type(out).__name__}.")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be True or False, got {overwrite!r}.")
    out = Path(out)
    if out.name in ("", ".", ".."):
        raise CheckpointError(f"{str(out)!r} names no file or directory to write; pass a path ending in a new name.")
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return out
    except NotADirectoryError:
        raise CheckpointError(f"cannot write {out}: a parent of it is not a directory.") from None
    is_dir, is_link = stat.S_ISDIR(mode), stat.S_ISLNK(mode)
    if directory and is_dir and not any(os.scandir(out)):
        return out  # an empty directory is taken
    if not directory and is_dir:
        raise CheckpointError(f"{out} is a directory; pass the path of the file to write.")
    if not overwrite:
        what = "is a symbolic link" if is_link else "exists"
        raise CheckpointError(f"{out} {what}{' and is not an empty directory' if directory else ''}; pass another "
                              f"path, or overwrite=True (--overwrite) to replace it.")
    return out


def write_file(out: str | os.PathLike, write: Callable[[BinaryIO], None], *, overwrite: bool) -> Path:
    """Write a file at ``out``: ``write(f)`` fills ``f``, a binary file open on a fresh
    staging file beside ``out``, which is fsynced and moved into place (``check_target``'s
    rules, checked again when it is moved: nothing that appeared meanwhile is replaced
    unless ``overwrite``). The file gets the default mode (``0o666`` less the umask).

    Returns:
        ``out`` as a ``Path``.
    """
    out = check_target(out, overwrite=overwrite, directory=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial")
    staging = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
        place_file(staging, out, replace=overwrite)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return out


def write_directory(out: str | os.PathLike, fill: Callable[[Path], None], *, overwrite: bool) -> Path:
    """Write a directory at ``out``: ``fill(staging)`` writes into ``staging``, a fresh empty
    directory beside ``out`` that only this user can enter (nothing can be planted there);
    everything in it is fsynced and the directory moved into place (``check_target``'s
    rules, checked again when it is moved). The directory gets the default mode (``0o777``
    less the umask).

    Returns:
        ``out`` as a ``Path``.
    """
    out = check_target(out, overwrite=overwrite, directory=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial"))
    try:
        fill(staging)
        fsync_tree(staging)
        os.chmod(staging, 0o777 & ~_umask())
        place_directory(staging, out, replace=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it (``/proc``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
