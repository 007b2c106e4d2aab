"""How something complete is put in place: the ranks' write-and-publish protocol, and the atomic
moves it (and every output nxd_smp writes) ends with.

* ``write_and_publish``: every rank writes its own files, all learn every rank's outcome, then rank
  0 completes and publishes (or discards) what they wrote; every rank ends with the same outcome.
  nxd_smp's format and NxD's state-dict tags are both saved through it.
* ``swap_link``: a checkpoint name is a symbolic link to a version directory, swapped in one
  ``rename(2)`` (nxd_smp's format, ``links``).
* ``place_directory`` / ``place_file``: a complete staging directory or file beside the target
  renamed into place, without clobbering anything unasked, or replacing what is there as a whole
  (NxD's tags, the exports, ``consolidate``); ``replace_file``: a small file's bytes put in place
  whole (the record of a directory's saves, ``links``).

Each move fsyncs what it wrote and the directory that holds it.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..backend.agreement import error_text
from ..backend.coordination import Coordinator
from ..core.errors import CheckpointError

#: What ``link(2)`` answers on a filesystem without hard links.
_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK)
#: What ``rename(2)`` or ``link(2)`` answer when something is already at the target.
_TAKEN = (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR)


# ---------------------------------------------------------------------------- the ranks
def write_and_publish(
    coordinator: Coordinator,
    write: Callable[[], Any],
    publish: Callable[[list[Any]], None],
    *,
    what: str,
    discard: Callable[[], None] | None = None,
    advance: Callable[[str], None] = lambda phase: None,
) -> None:
    """Every rank of ``coordinator``'s group runs ``write()`` (its own files; a JSON value back), and
    all learn every rank's outcome; then rank 0 runs ``publish(results)`` (in rank order: what
    completes the checkpoint and puts it in place), or ``discard()`` if a rank failed. Every rank
    ends with the same outcome: a failure anywhere, of any kind, is a ``CheckpointError`` naming
    ``what`` on every rank. ``advance``: told ``"write"`` and ``"publish"`` as they end."""
    mine: dict[str, Any] = {"result": None, "error": None}
    try:
        mine["result"] = write()
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        mine["error"] = f"rank {coordinator.rank}: {error_text(e)}"
    gathered = coordinator.all_gather(mine)
    failures = [part["error"] for part in gathered if part["error"]]
    if not failures:
        advance("write")
    outcome = None
    if coordinator.rank == 0:
        try:
            if failures:
                if discard is not None:
                    discard()
                raise CheckpointError("; ".join(failures))
            publish([part["result"] for part in gathered])
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            outcome = error_text(e)
    outcome = coordinator.broadcast(outcome)
    if outcome is not None:
        raise CheckpointError(f"the save of {what} failed: {outcome}")
    advance("publish")


# ---------------------------------------------------------------------------- moves
def _fsync(path: str | Path, flags: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    _fsync(path)


def fsync_tree(path: Path) -> None:
    """fsync every regular file and directory under ``path`` (links are not followed), then ``path``."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                fsync_tree(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                _fsync(entry.path, os.O_NOFOLLOW)
    _fsync(path)


def swap_link(path: Path, version: str, adopt: Callable[[Path, Path], None]) -> None:
    """Point the link ``path`` at its sibling ``version`` in one ``rename(2)``. A folder made at
    ``path`` meanwhile (optimum-neuron writes into the tag folder while its save is in flight) is
    handed to ``adopt(folder, version directory)`` first, which empties and removes it; it may
    appear, or gain a file, between the adoption and the swap: then both are tried again."""
    link = path.parent / f".{path.name}.link-{uuid.uuid4().hex[:12]}"
    os.symlink(version, link)
    try:
        for attempt in range(100):
            if path.is_dir() and not path.is_symlink():
                try:
                    adopt(path, link.parent / version)
                except OSError:  # (it gained a file after the listing: again)
                    continue
            try:
                os.replace(link, path)
                break
            except OSError:  # (a folder was made at ``path`` after the adoption: again)
                if attempt == 99 or not (path.is_dir() and not path.is_symlink()):
                    raise
    except BaseException:
        link.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def place_file(staging: Path, target: Path, *, replace: bool) -> None:
    """Move the complete, fsynced file ``staging`` (beside ``target``) to ``target``. ``replace``:
    whatever file or link is there is replaced itself (``rename(2)``; a link is never followed).
    Else nothing is clobbered, a dangling link included (``link(2)``; where the filesystem has no
    hard links, checked and renamed).

    Raises:
        CheckpointError: without ``replace``, something took the name ``target``.
    """
    if replace:
        os.replace(staging, target)
    else:
        try:
            os.link(staging, target)
            staging.unlink()
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                _refuse_if_taken(e, target)
            if os.path.lexists(target):
                _refuse_if_taken(OSError(errno.EEXIST, "exists"), target)
            os.rename(staging, target)
    fsync_dir(target.parent)


def replace_file(target: Path, data: bytes) -> None:
    """``data`` as the file ``target``, whole or not at all: written to a fresh file beside it
    (created exclusively, never through something planted at its name), fsynced, and renamed over
    whatever is at ``target`` (a link there is replaced itself, never followed)."""
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.partial"
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        place_file(staging, target, replace=True)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def place_directory(staging: Path, target: Path, *, replace: bool, retire: Callable[[Path], None] | None = None
                    ) -> None:
    """Move the complete, fsynced directory ``staging`` (beside ``target``) to ``target``.

    Without ``replace`` only an absent name or an empty directory is taken (``rename(2)``). With it,
    what is at ``target`` (a directory, a file or a link, itself) is first made to look incomplete by
    ``retire(it)`` where given (NxD's tags lose their ``done``), moved aside, the new directory
    renamed in, and the old one removed; if the rename fails, the old one goes back (or, if
    something took ``target`` meanwhile, stays where it was put, named in the error).

    Raises:
        CheckpointError: something took ``target`` (without ``replace``, or meanwhile).
    """
    if not (replace and os.path.lexists(target)):
        try:
            os.rename(staging, target)
        except OSError as e:
            _refuse_if_taken(e, target)
        fsync_dir(target.parent)
        return
    if retire is not None:
        retire(target)
    aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".old"))
    old = aside / target.name
    try:
        os.rename(target, old)
    except BaseException:
        aside.rmdir()
        raise
    try:
        os.rename(staging, target)
    except BaseException as e:
        try:
            os.rename(old, target)
        except OSError:
            raise CheckpointError(f"{target} was taken while the output was being written; what was there "
                                  f"before is kept at {old}.") from e
        aside.rmdir()
        if isinstance(e, OSError):
            _refuse_if_taken(e, target)
        raise
    fsync_dir(target.parent)
    shutil.rmtree(aside, ignore_errors=True)


def _refuse_if_taken(error: OSError, target: Path) -> None:
    """Re-raise ``error``; as a ``CheckpointError`` if something took the name ``target``."""
    if error.errno in _TAKEN:
        raise CheckpointError(f"{target} appeared while the output was being written and was left as it is; pass "
                              f"another path, or overwrite=True (--overwrite) to replace it.") from error
    raise error
