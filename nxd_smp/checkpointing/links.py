"""Version directories and the links that name them: the atomic swap, the record of a directory's
saves, retention, and which complete checkpoint a path means.

``path`` is a symbolic link to a sibling directory ``.<name>.v-<id>``. A save writes a new
sibling, fsyncs it, then swaps the link with ``os.replace`` and removes the old sibling, so
``path`` always resolves to a complete checkpoint (one with ``COMPLETE.json``). A save cut off
before the swap leaves a sibling without it, which loading reports and the next save of that
path removes.

A link is followed only to its own version beside it: its target a plain name
``.<name>.v-<id>`` (no ``/``) that is a real directory, not a link, in the same parent. A link
anywhere else (another run's version, ``..``, an absolute path) is never loaded and nothing behind
it is ever removed; removing such a checkpoint name removes the link only.

Which checkpoint of a directory is the newest, and which ones retention may remove, comes from the
writer's own record, ``.nxd_smp_saves.json`` in the directory (``SAVES_FILE``), never from a time,
step or name that a checkpoint's files claim: a planted folder dated in the far future neither
becomes the newest nor makes retention remove the run's own saves. Before each swap rank 0 rewrites
the record atomically (``{"format", "sequence", "saves": [[link name, version name], ...]}``, oldest
first): the saves still in place, then the new one. A save counts while its link names the recorded
version. A directory written by a release before the record has none: it loads its only complete
checkpoint, and one holding several is refused with their names (load one by name); retention there
removes nothing it has not recorded.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

from ..core.errors import CheckpointError
from .format import COMPLETE_FILE
from .paths import read_json
from .publish import fsync_dir, replace_file, swap_link

#: The record of a directory's saves, written by the saving run itself (the module's docstring).
SAVES_FILE = ".nxd_smp_saves.json"
SAVES_FORMAT = "nxd_smp.saves/1"
_SAVES_LIMIT = 16 << 20  # a save is ~60 bytes of the record; removed saves leave it at the next save
_VERSION_ID = r"[A-Za-z0-9_]+"  # (nxd_smp writes 12 hex digits)


def version_prefix(path: Path) -> str:
    """The prefix of ``path``'s version directories (siblings of the link)."""
    return f".{path.name}.v-"


def _is_version_name(link_name: str, version: Any) -> bool:
    """Whether ``version`` is the plain name of a version directory of the link ``link_name``."""
    return isinstance(version, str) and re.fullmatch(re.escape(f".{link_name}.v-") + _VERSION_ID, version) is not None


def _real_directory(path: Path) -> bool:
    """Whether ``path`` is a directory itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def version_of(link: Path) -> Path | None:
    """The version directory the checkpoint link ``link`` names, if it is one of its own: a plain
    name ``.<name>.v-<id>`` beside the link, a real directory. None for anything else (not a link,
    a link elsewhere, to a link, to nothing)."""
    try:
        target = os.readlink(link)
    except (OSError, ValueError):
        return None
    version = link.parent / target
    return version if _is_version_name(link.name, target) and _real_directory(version) else None


def _complete(version: Path) -> bool:
    return os.path.lexists(version / COMPLETE_FILE)


#: NxD's marker files: ``checkpoint`` when a tag folder's save begins, ``done`` when it is
#: complete. A folder holding only these, empty (optimum-neuron touches ``done`` in the tag folder
#: before each asynchronous save), holds nothing a save may not replace.
MARKER_FILE, DONE_FILE = "checkpoint", "done"
NXD_MARKERS = (MARKER_FILE, DONE_FILE)


def replaceable_folder(path: Path) -> bool:
    """Whether ``path`` is a folder a new checkpoint link may take the place of: empty, or
    holding nothing but NxD's empty marker files."""
    if not path.is_dir() or path.is_symlink():
        return False
    return all(entry.name in NXD_MARKERS and entry.is_file() and not entry.is_symlink() and entry.stat().st_size <= 2
               for entry in path.iterdir())


def clear_folder(path: Path) -> None:
    """Remove the ``replaceable_folder`` at ``path`` (its markers, then itself)."""
    for entry in path.iterdir():
        entry.unlink()
    path.rmdir()


def _adopt_folder(path: Path, target: Path) -> None:
    """A folder made at ``path`` while its save was in flight (optimum-neuron writes its
    consolidation metadata into the tag folder as soon as ``save_checkpoint`` returns) joins the
    new version ``target``: its files move there, so the link can take its place. A name the
    checkpoint holds itself is refused, never overwritten."""
    clashes = sorted(entry.name for entry in path.iterdir() if os.path.lexists(target / entry.name))
    if clashes:
        raise CheckpointError(f"{path} was made while the checkpoint was being written, holding {clashes}, which "
                              f"the checkpoint writes too; move them away and save again.")
    for entry in path.iterdir():
        os.rename(entry, target / entry.name)
    path.rmdir()


# ---------------------------------------------------------------------------- the record of saves
def read_record(directory: Path) -> tuple[int, list[tuple[str, str]]] | None:
    """The record of ``directory``'s saves: its sequence counter (saves recorded so far) and the
    saves it lists, oldest first, as (link name, version name); None if it has none (a directory
    of a release before the record, or never saved into).

    Raises:
        CheckpointError: the record is unsafe (a link out, a FIFO, too large) or damaged, naming it.
    """
    if not os.path.lexists(directory / SAVES_FILE):
        return None
    value = read_json(directory, SAVES_FILE, limit=_SAVES_LIMIT)
    if not _is_record(value):
        raise CheckpointError(
            f"{directory / SAVES_FILE}, the record of the saves in {directory}, is damaged or crafted (nxd_smp "
            f"writes {{'format': {SAVES_FORMAT!r}, 'sequence': n, 'saves': [[link name, '.<name>.v-<id>'], ...]}}); "
            f"it is not trusted. Load a checkpoint by name, or remove the record (retention then removes nothing "
            f"saved before the next save).")
    return value["sequence"], [(name, version) for name, version in value["saves"]]


def _is_record(value: Any) -> bool:
    """Whether ``value`` is a record of saves as nxd_smp writes it: its three fields, a sequence
    counter no smaller than the saves listed, each save a plain link name (no ``/``, not hidden)
    and that link's version name."""
    if not isinstance(value, dict) or set(value) != {"format", "sequence", "saves"} or value["format"] != SAVES_FORMAT:
        return False
    sequence, saves = value["sequence"], value["saves"]
    if isinstance(sequence, bool) or not isinstance(sequence, int) or not isinstance(saves, list) \
            or len(saves) > sequence:
        return False
    return all(isinstance(s, list) and len(s) == 2 and is_link_name(s[0]) and _is_version_name(s[0], s[1])
               for s in saves)


def is_link_name(name: Any) -> bool:
    """Whether ``name`` may name a checkpoint in a directory: a plain name (no ``/`` or NUL), not
    hidden (hidden names are its versions' and its record's)."""
    return isinstance(name, str) and bool(name) and "/" not in name and "\0" not in name and not name.startswith(".")


def _in_place(directory: Path, saves: list[tuple[str, str]]) -> list[Path]:
    """The links of ``saves`` that still name the recorded version, oldest first."""
    links: list[Path] = []
    for name, version in saves:
        link = directory / name
        if version_of(link) == directory / version and link not in links:
            links.append(link)
    return links


def recorded_checkpoints(directory: Path) -> list[Path] | None:
    """The links of ``directory`` that its record holds and that still name the recorded
    version, oldest first; None without a record.

    Raises:
        CheckpointError: the record is unsafe or damaged.
    """
    record = read_record(directory)
    return None if record is None else _in_place(directory, record[1])


def _record_save(path: Path, version: str) -> None:
    """Rewrite the record of ``path``'s directory before ``path`` is swapped to ``version``: the
    saves still in place (the one ``path`` names now included), then this one. Cut off before the
    swap, the new entry names a version its link does not, which counts for nothing."""
    directory = path.parent
    sequence, saves = read_record(directory) or (0, [])
    kept = [[link.name, version_of(link).name] for link in _in_place(directory, saves)]
    record = {"format": SAVES_FORMAT, "sequence": sequence + 1, "saves": kept + [[path.name, version]]}
    replace_file(directory / SAVES_FILE, json.dumps(record).encode())


# ---------------------------------------------------------------------------- publish, remove, retain
def publish_version(path: Path, version: str) -> None:
    """Record the save, point ``path`` at ``version`` atomically, and remove the version it
    replaced (its own version beside it only) and versions of ``path`` left by saves cut off
    before their swap.

    Raises:
        CheckpointError: the directory's record is damaged (before anything is swapped).
    """
    old = version_of(path)
    _record_save(path, version)
    swap_link(path, version, adopt=_adopt_folder)
    if old is not None and old.name != version:
        shutil.rmtree(old, ignore_errors=True)
    for stale in path.parent.glob(f"{glob.escape(version_prefix(path))}*"):
        if stale.name != version and _real_directory(stale) and not _complete(stale):
            shutil.rmtree(stale, ignore_errors=True)


def checkpoint_links(directory: Path) -> list[Path]:
    """The complete checkpoints in ``directory``: links to a version of their own beside them
    (``version_of``) that has a completion record; by name (recorded or not)."""
    found = []
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith(".") or not entry.is_symlink():
            continue
        version = version_of(entry)
        if version is not None and _complete(version):
            found.append(entry)
    return found


def unpublish(link: Path) -> None:
    """Remove the checkpoint ``link`` names: the link first (the name then means no checkpoint,
    never a half-removed one), then its version directory if it is the link's own beside it; a
    link elsewhere goes alone, what it points to is left as it is."""
    version = version_of(link)
    link.unlink()
    fsync_dir(link.parent)
    if version is not None:
        shutil.rmtree(version, ignore_errors=True)


def retain(directory: Path, keep: int, newest: Path) -> None:
    """Remove all but the newest ``keep`` checkpoints the record of ``directory`` holds, oldest
    first by the record (never ``newest``, the one just written), then every version directory
    no link points to: those of saves killed before their swap, or after an unlink here. A
    checkpoint the record does not hold (one saved by a release before it, one copied in) is never
    removed. Only this save is in flight."""
    recorded = recorded_checkpoints(directory) or []
    for link in recorded[:max(0, len(recorded) - keep)]:
        if link != newest:
            unpublish(link)
    pointed = {os.readlink(entry) for entry in directory.iterdir() if entry.is_symlink()}
    for entry in directory.iterdir():
        if entry.name.startswith(".") and ".v-" in entry.name and _real_directory(entry) and entry.name not in pointed:
            shutil.rmtree(entry, ignore_errors=True)
    fsync_dir(directory)


# ---------------------------------------------------------------------------- which checkpoint
def newest_checkpoint(directory: Path) -> Path:
    """The link of the newest complete checkpoint of ``directory``: the last its record holds; in
    a directory without a record (a release before it), its only complete checkpoint.

    Raises:
        CheckpointError: none; or, without a record (or with one that holds none of them),
            several, which it names: load one by name.
    """
    recorded = recorded_checkpoints(directory)
    for link in reversed(recorded or []):
        if _complete(version_of(link)):
            return link
    found = checkpoint_links(directory)
    if not found:
        raise CheckpointError(f"{directory} is a directory without a complete checkpoint in it.")
    if recorded is None and len(found) == 1:
        return found[0]
    names = ", ".join(link.name for link in found)
    why = (f"no record of which was saved last ({SAVES_FILE}: a directory saved by an earlier release)"
           if recorded is None else f"none of them is a save its record {SAVES_FILE} holds (copied in?)")
    raise CheckpointError(f"{directory} holds the checkpoints {names} and {why}; nxd_smp does not guess the newest "
                          f"from what their files claim. Load one by name: {directory / found[-1].name}.")


def resolve(path: Path) -> Path:
    """The complete version directory behind ``path`` (a checkpoint link, a version directory,
    or a directory of checkpoints: its newest complete one, ``newest_checkpoint``), or an error
    that says why not. A link is followed only to its own version beside it (``version_of``)."""
    if not os.path.lexists(path):
        partial = [p for p in path.parent.glob(f"{glob.escape(version_prefix(path))}*") if _real_directory(p) and not _complete(p)]
        if partial:
            raise CheckpointError(
                f"no complete checkpoint at {path}: the save into {partial[0]} was cut off before "
                f"it finished (incomplete: it has no {COMPLETE_FILE}). Resume from an earlier checkpoint."
            )
        raise FileNotFoundError(f"no checkpoint at {path}: the path does not exist.")
    if path.is_symlink():
        target = version_of(path)
        if target is None:
            raise CheckpointError(
                f"{path} is a link to {os.readlink(path)!r}, which is not a version of this checkpoint beside it "
                f"(a directory {version_prefix(path)}<id>); nxd_smp follows a checkpoint's link to its own version "
                f"only. Refused.")
    elif path.is_dir() and not _complete(path) and not path.name.startswith("."):
        target = version_of(newest_checkpoint(path))
    else:
        target = path
    if not target.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory.")
    if not _complete(target):
        raise CheckpointError(
            f"the checkpoint at {target} is incomplete (no {COMPLETE_FILE}): its save was cut off. "
            f"Resume from an earlier checkpoint."
        )
    return target.resolve()
