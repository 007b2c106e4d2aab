"""Writing an output file or directory safely: never over an existing file, directory or link
unasked, never through a link.

An output is written into a staging name made exclusively beside it (``tempfile.mkstemp``,
``O_CREAT | O_EXCL``, for a file; a fresh ``tempfile.mkdtemp`` for a directory), fsynced and
moved into place. Without ``overwrite`` the move cannot clobber: ``link(2)`` for a file fails
on any existing name, a dangling link included; ``rename(2)`` for a directory fails over
anything but an empty directory. With ``overwrite`` the name itself is replaced (a link is
replaced, never followed); an old directory is moved aside, the new one renamed in, then the
old one removed. A failure removes the staging and leaves the target as it was.

The parent directory is made if missing and may be reached through links: only the last
component of the target is never followed.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .checkpoint_format import CheckpointError
from .checkpoint_links import fsync_dir

__all__ = ["check_target", "write_file", "write_directory"]

#: What ``link(2)`` answers on a filesystem without hard links.
_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK)
#: What ``rename(2)`` or ``link(2)`` answer when something is already at the target.
_TAKEN = (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR)


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
        if overwrite:
            os.replace(staging, out)  # rename(2): a file or a link is replaced itself
        else:
            try:
                os.link(staging, out)  # never over anything, a dangling link included
                staging.unlink()
            except OSError as e:
                if e.errno not in _NO_HARD_LINKS:
                    _refuse_if_taken(e, out)
                if os.path.lexists(out):  # a filesystem without hard links (vfat): check, then rename
                    _refuse_if_taken(OSError(errno.EEXIST, "exists"), out)
                os.rename(staging, out)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    fsync_dir(out.parent)
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
        _fsync_tree(staging)
        os.chmod(staging, 0o777 & ~_umask())
        if overwrite and os.path.lexists(out):
            _replace_directory(staging, out)
        else:
            try:
                os.rename(staging, out)  # rename(2): only an empty directory is replaced
            except OSError as e:
                _refuse_if_taken(e, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    return out


def _replace_directory(staging: Path, out: Path) -> None:
    """Move whatever is at ``out`` (a directory, a file or a link, itself) aside into a fresh
    directory, rename ``staging`` to ``out``, then remove the old one. If the rename fails,
    the old one goes back (or, if something took ``out`` meanwhile, stays where it was put,
    named in the error)."""
    aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
    old = aside / out.name
    try:
        os.rename(out, old)
    except BaseException:
        aside.rmdir()
        raise
    try:
        os.rename(staging, out)
    except BaseException as e:
        try:
            os.rename(old, out)
        except OSError:
            raise CheckpointError(f"{out} was taken while the output was being written; what was there "
                                  f"before is kept at {old}.") from e
        aside.rmdir()
        if isinstance(e, OSError):
            _refuse_if_taken(e, out)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _refuse_if_taken(error: OSError, out: Path) -> None:
    """Re-raise ``error``; as a ``CheckpointError`` if something took the name ``out``."""
    if error.errno in _TAKEN:
        raise CheckpointError(f"{out} appeared while the output was being written and was left as it is; pass "
                              f"another path, or overwrite=True (--overwrite) to replace it.") from error
    raise error


def _fsync_tree(path: Path) -> None:
    """fsync every regular file and directory under ``path`` (links are not followed), then ``path``."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                _fsync_tree(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    fsync_dir(path)


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
