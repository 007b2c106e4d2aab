"""Version directories and the links that name them: the atomic swap, the record of a directory's
saves, retention, and which complete checkpoint a name means. Everything here works in one
directory, the root (a ``files.Folder``): the link ``<name>`` and its versions ``.<name>.v-<id>``
beside it.

A save writes a new version, fsyncs it, then swaps the link with one ``rename(2)`` and removes the
old version, so the name always means a complete checkpoint (one with ``COMPLETE.json``). A save
cut off before the swap leaves a version without it, which loading reports and the next save of
that name removes.

A link is read (``readlink``), never followed: it names a checkpoint only if its target is a plain
name ``.<name>.v-<id>`` (no ``/``) of a real directory in the same root. A link anywhere else
(another run's version, ``..``, an absolute path) is never loaded, and nothing behind it is ever
removed; removing such a checkpoint name removes the link only.

Which checkpoint of a directory is the newest, and which ones retention may remove, comes from the
writer's own record, ``.nxd_smp_saves.json`` in the directory (``SAVES_FILE``), never from a time,
step or name that a checkpoint's files claim: a planted folder dated in the far future neither
becomes the newest nor makes retention remove the run's own saves. Before each swap rank 0 rewrites
the record atomically (``{"format", "sequence", "saves": [[link name, version name], ...]}``, oldest
first): the saves still in place, then the new one. A save counts while its link names the recorded
version. A directory without a record loads its only complete checkpoint, and one holding several is
refused with their names (load one by name); retention there removes nothing it has not recorded.
"""

from __future__ import annotations

import json
import re
import secrets
import stat
from pathlib import Path
from typing import Any

from ..core.errors import CheckpointError
from .files import Folder, after_publish, replace_file, warn_on_failure
from .room import Room, Store
from .typed_json import loads

#: The record of a directory's saves, written by the saving run itself (the module's docstring).
SAVES_FILE = ".nxd_smp_saves.json"
SAVES_FORMAT = "nxd_smp.saves/1"
_SAVES_LIMIT = 16 << 20  # a save is ~60 bytes of the record; removed saves leave it at the next save
_VERSION_ID = r"[A-Za-z0-9_]+"  # (nxd_smp writes 12 hex digits)
#: The completion record of a version: written last, so a version without it is incomplete.
COMPLETE_FILE = "COMPLETE.json"

#: NxD's marker files: ``checkpoint`` when a tag folder's save begins, ``done`` when it is
#: complete. A folder holding only these, empty (optimum-neuron touches ``done`` in the tag folder
#: before each asynchronous save), holds nothing a save may not replace.
MARKER_FILE, DONE_FILE = "checkpoint", "done"
NXD_MARKERS = (MARKER_FILE, DONE_FILE)


def version_prefix(name: str) -> str:
    """The prefix of the versions of the checkpoint ``name`` (siblings of its link)."""
    return f".{name}.v-"


def is_version_name(link_name: str, version: Any) -> bool:
    """Whether ``version`` is the plain name of a version directory of the link ``link_name``."""
    return isinstance(version, str) and re.fullmatch(re.escape(version_prefix(link_name)) + _VERSION_ID,
                                                     version) is not None


def is_link_name(name: Any) -> bool:
    """Whether ``name`` may name a checkpoint in a directory: a plain name (no ``/`` or NUL), not
    hidden (hidden names are its versions' and its record's)."""
    return isinstance(name, str) and bool(name) and "/" not in name and "\0" not in name and not name.startswith(".")


def version_of(root: Folder, name: str) -> str | None:
    """The version the checkpoint link ``name`` of ``root`` names, if it is one of its own: a plain name
    ``.<name>.v-<id>`` of a real directory of ``root``. None for anything else (not a link, a link
    elsewhere, to a link, to nothing)."""
    target = root.readlink(name)
    return target if target is not None and is_version_name(name, target) and root.is_dir(target) else None


def is_complete(root: Folder, version: str) -> bool:
    return root.is_dir(version) and root.exists(f"{version}/{COMPLETE_FILE}")


def replaceable_folder(root: Folder, name: str) -> bool:
    """Whether ``name`` is a folder a new checkpoint link may take the place of: empty, or holding
    nothing but NxD's empty marker files."""
    if not root.is_dir(name):
        return False
    with root.sub(name) as folder:
        for entry in folder.names():
            st = folder.lstat(entry)
            if entry not in NXD_MARKERS or st is None or not _regular(st) or st.st_size > 2:
                return False
    return True


def _regular(st: Any) -> bool:
    return stat.S_ISREG(st.st_mode)


def clear_folder(root: Folder, name: str) -> None:
    """Remove the ``replaceable_folder`` ``name`` of ``root`` (its markers, then itself)."""
    with root.sub(name) as folder:
        for entry in folder.names():
            folder.unlink(entry)
    root.rmdir(name)


def _adopt_folder(root: Folder, name: str, version: Folder) -> None:
    """A folder made at ``name`` while its save was in flight (optimum-neuron writes its consolidation
    metadata into the tag folder as soon as ``save_checkpoint`` returns) joins the new version: its
    files move there, so the link can take its place. A name the checkpoint holds itself is refused,
    never overwritten."""
    with root.sub(name) as folder:
        entries = folder.names()
        clashes = sorted(entry for entry in entries if version.exists(entry))
        if clashes:
            raise CheckpointError(f"{root.where(name)} was made while the checkpoint was being written, holding "
                                  f"{clashes}, which the checkpoint writes too; move them away and save again.")
        for entry in entries:
            folder.rename(entry, entry, into=version)
    root.rmdir(name)


# ---------------------------------------------------------------------------- the record of saves
def read_record(root: Folder) -> tuple[int, list[tuple[str, str]]] | None:
    """The record of ``root``'s saves: its sequence counter (saves recorded so far) and the saves it
    lists, oldest first, as (link name, version name); None if it has none.

    Raises:
        CheckpointError: the record is unsafe (a link, a FIFO, too large) or damaged, naming it.
    """
    if not root.exists(SAVES_FILE):
        return None
    value = loads(root.read_bytes(SAVES_FILE, limit=_SAVES_LIMIT), str(root.where(SAVES_FILE)))
    if not _is_record(value):
        raise CheckpointError(
            f"{root.where(SAVES_FILE)}, the record of the saves in {root.where()}, is damaged or crafted (nxd_smp "
            f"writes {{'format': {SAVES_FORMAT!r}, 'sequence': n, 'saves': [[link name, '.<name>.v-<id>'], ...]}}); "
            f"it is not trusted. Load a checkpoint by name, or remove the record (retention then removes nothing "
            f"saved before the next save).")
    return value["sequence"], [(name, version) for name, version in value["saves"]]


def _is_record(value: Any) -> bool:
    """Whether ``value`` is a record of saves as nxd_smp writes it: its three fields, a sequence counter
    no smaller than the saves listed, each save a plain link name and that link's version name."""
    if not isinstance(value, dict) or set(value) != {"format", "sequence", "saves"} or value["format"] != SAVES_FORMAT:
        return False
    sequence, saves = value["sequence"], value["saves"]
    if isinstance(sequence, bool) or not isinstance(sequence, int) or not isinstance(saves, list) \
            or len(saves) > sequence:
        return False
    return all(isinstance(s, list) and len(s) == 2 and is_link_name(s[0]) and is_version_name(s[0], s[1])
               for s in saves)


def _in_place(root: Folder, saves: list[tuple[str, str]]) -> list[str]:
    """The links of ``saves`` that still name the recorded version, oldest first."""
    links: list[str] = []
    for name, version in saves:
        if version_of(root, name) == version and name not in links:
            links.append(name)
    return links


def recorded_checkpoints(root: Folder) -> list[str] | None:
    """The links of ``root`` that its record holds and that still name the recorded version, oldest
    first; None without a record."""
    record = read_record(root)
    return None if record is None else _in_place(root, record[1])


def _record_save(root: Folder, name: str, version: str) -> None:
    """Rewrite the record before ``name`` is swapped to ``version``: the saves still in place, then this
    one. Cut off before the swap, the new entry names a version its link does not: it counts for nothing."""
    sequence, saves = read_record(root) or (0, [])
    kept = [[link, version_of(root, link)] for link in _in_place(root, saves)]
    record = {"format": SAVES_FORMAT, "sequence": sequence + 1, "saves": kept + [[name, version]]}
    replace_file(root, SAVES_FILE, json.dumps(record).encode())


# ---------------------------------------------------------------------------- publish, remove, retain
def publish_version(root: Folder, name: str, version: str, identity: tuple[int, int]) -> None:
    """Record the save, point ``name`` at ``version`` atomically, and remove the version it replaced
    and versions of ``name`` left by saves cut off before their swap. ``identity``: the (device, inode)
    of the version this save wrote: if ``version`` names anything else now (someone renamed it away
    and put another folder there), nothing is published.

    Raises:
        CheckpointError: the record is damaged, or the version was swapped (before anything is swapped).
    """
    if root.lstat(version) is None or root.identity(version) != tuple(identity):
        raise CheckpointError(f"{root.where(version)}, the version this save wrote, was moved or replaced while it was "
                              f"being written; nothing was published (the files written stay in the folder that was "
                              f"moved).")
    old = version_of(root, name)
    _record_save(root, name, version)
    link = f".{name}.link-{version.rsplit('-', 1)[-1]}"
    root.unlink(link)
    root.symlink(version, link)
    try:
        for attempt in range(100):
            if root.is_dir(name):
                with root.sub(version) as target:
                    try:
                        _adopt_folder(root, name, target)
                    except OSError:  # (it gained a file after the listing: again)
                        continue
            try:
                root.rename(link, name)
                break
            except OSError:  # (a folder was made at ``name`` after the adoption: again)
                if attempt == 99 or not root.is_dir(name):
                    raise
    except BaseException:
        root.unlink(link)
        raise
    # published: from here on nothing fails the save (``after_publish``)
    with after_publish(f"syncing {root.where()}"):
        root.fsync()
    if old is not None and old != version:
        with after_publish(f"removing {root.where(old)} (the version {name} named before)", LEFT):
            remove_version(root, old)
    with after_publish(f"looking for versions of {name} left by saves cut off in {root.where()}"):
        for stale in root.names():
            if stale.startswith(version_prefix(name)) and stale != version and root.is_dir(stale) \
                    and not is_complete(root, stale):
                with after_publish(f"removing {root.where(stale)} (left by a save cut off)", LEFT):
                    root.remove_tree(stale)


def checkpoint_links(root: Folder) -> list[str]:
    """The complete checkpoints in ``root``: links to a version of their own beside them that has a
    completion record; by name (recorded or not)."""
    found = []
    for entry in root.names():
        if entry.startswith(".") or not root.is_link(entry):
            continue
        version = version_of(root, entry)
        if version is not None and is_complete(root, version):
            found.append(entry)
    return found


def unpublish(root: Folder, name: str) -> None:
    """Remove the checkpoint ``name``: the link first (the name then means no checkpoint, never a
    half-removed one), then its version if it is the link's own beside it (``remove_version``); a link
    elsewhere goes alone. What of the version cannot be removed is left with a warning (``Folder.remove_tree``).

    Raises:
        OSError: the link could not be removed (the checkpoint is then still whole).
    """
    version = version_of(root, name)
    root.unlink(name)
    root.fsync()
    if version is not None:
        remove_version(root, version)


def remove_version(root: Folder, version: str) -> None:
    """Remove the version directory ``version`` of ``root``: its completion record first (made durable),
    so that a removal cut off or left in part never leaves a version that looks complete, then the
    rest (``Folder.remove_tree``: bounded, never through a link, what it cannot remove left with a warning)."""
    if root.is_dir(version):
        with root.sub(version) as folder:
            folder.unlink(COMPLETE_FILE)
            folder.fsync()
    root.remove_tree(version)


#: What a removal after a save's publish that failed leaves, as ``after_publish`` says it.
LEFT = "it is left in place (remove it by hand)"


def retain(root: Folder, keep: int, newest: str) -> None:
    """Remove all but the newest ``keep`` checkpoints the record of ``root`` holds, oldest first by the
    record (never ``newest``, the one just written), then every version directory (``.<name>.v-<id>``) no
    link points to: those of saves killed before their swap, or after an unlink here. A checkpoint the
    record does not hold, or a hidden folder not named as a version, is never removed. One run saves
    into a root at a time (another's version in flight would count as killed).

    It runs after the save is published, so it raises nothing (but ``KeyboardInterrupt`` and
    ``SystemExit``): each removal that fails is a warning naming what was left (``after_publish``), and
    the others still run."""
    with after_publish(f"the retention in {root.where()} (num_kept_ckpts={keep})"):
        recorded = recorded_checkpoints(root) or []
        tried = set()  # (the versions just removed: what is left of one is told once)
        for name in recorded[:max(0, len(recorded) - keep)]:
            if name != newest:
                tried.add(version_of(root, name))
                with after_publish(f"removing the checkpoint {root.where(name)} (num_kept_ckpts={keep})", LEFT):
                    unpublish(root, name)
        pointed = {root.readlink(entry) for entry in root.names() if root.is_link(entry)}
        for entry in root.names():
            found = re.fullmatch(r"\.(.+)\.v-" + _VERSION_ID, entry)
            if found and is_link_name(found.group(1)) and entry not in pointed | tried and root.is_dir(entry):
                with after_publish(f"removing {root.where(entry)} (a version no checkpoint names)", LEFT):
                    remove_version(root, entry)
        root.fsync()


# ---------------------------------------------------------------------------- which checkpoint
def newest_checkpoint(root: Folder) -> str:
    """The link of the newest complete checkpoint of ``root``: the last its record holds; in a directory
    without a record, its only complete checkpoint.

    Raises:
        CheckpointError: none; or, without a record (or with one that holds none of them), several,
            which it names: load one by name.
    """
    recorded = recorded_checkpoints(root)
    for name in reversed(recorded or []):
        if is_complete(root, version_of(root, name)):
            return name
    found = checkpoint_links(root)
    if not found:
        raise CheckpointError(f"{root.where()} is a directory without a complete checkpoint in it.")
    if recorded is None and len(found) == 1:
        return found[0]
    names = ", ".join(found)
    why = (f"no record of which was saved last ({SAVES_FILE})" if recorded is None
           else f"none of them is a save its record {SAVES_FILE} holds (copied in?)")
    raise CheckpointError(f"{root.where()} holds the checkpoints {names} and {why}; nxd_smp does not guess the newest "
                          f"from what their files claim. Load one by name: {root.where(found[-1])}.")


def locate(root: Folder, name: str) -> tuple[str, str]:
    """The complete version behind ``name`` of ``root`` (a checkpoint link, a version directory, or a
    directory of checkpoints: its newest complete one), as (folder holding it relative to ``root``: ``""``
    or ``name``, version name), or an error that says why not. A link is read, never followed.

    Raises:
        FileNotFoundError: nothing at ``name``.
        CheckpointError: not a complete checkpoint, naming why.
    """
    if not root.exists(name):
        partial = [v for v in root.names() if v.startswith(version_prefix(name)) and root.is_dir(v)
                   and not is_complete(root, v)]
        if partial:
            raise CheckpointError(f"no complete checkpoint at {root.where(name)}: the save into {root.where(partial[0])} "
                                  f"was cut off before it finished (incomplete: it has no {COMPLETE_FILE}). Resume from "
                                  f"an earlier checkpoint.")
        raise FileNotFoundError(f"no checkpoint at {root.where(name)}: the path does not exist.")
    if root.is_link(name):
        version = version_of(root, name)
        if version is None:
            raise CheckpointError(f"{root.where(name)} is a link to {root.readlink(name)!r}, which is not a version of "
                                  f"this checkpoint beside it (a directory {version_prefix(name)}<id>); nxd_smp reads a "
                                  f"checkpoint's link to its own version only. Refused.")
        where, version = "", version
    elif not root.is_dir(name):
        raise CheckpointError(f"{root.where(name)} is not a checkpoint directory.")
    elif not root.exists(f"{name}/{COMPLETE_FILE}") and not name.startswith("."):
        with root.sub(name) as directory:
            where, version = name, version_of(directory, newest_checkpoint(directory))
    else:
        where, version = "", name
    if not root.exists(f"{where}/{version}/{COMPLETE_FILE}" if where else f"{version}/{COMPLETE_FILE}"):
        raise CheckpointError(f"the checkpoint at {root.where(version)} is incomplete (no {COMPLETE_FILE}): its save "
                              f"was cut off. Resume from an earlier checkpoint.")
    return where, version


# ---------------------------------------------------------------------------- the local store
class LocalStore(Store):
    """A directory of checkpoints on a local file system (the ``Store`` of ``room``): links swapped to
    version directories, with the record of saves (this module's docstring)."""

    def __init__(self, root: Folder):
        self.root = root

    def where(self, name: str = "") -> Path:
        return self.root.where(name)

    def begin(self, name: str) -> list:
        root = self.root
        if root.exists(name) and not root.is_link(name):
            if not replaceable_folder(root, name):
                raise CheckpointError(f"{root.where(name)} exists and is not an nxd_smp checkpoint link; pass a new "
                                      f"path (or tag) or remove it.")
            # an empty folder made for us (or NxD's markers only): the link takes its place
            clear_folder(root, name)
        version = f"{version_prefix(name)}{secrets.token_hex(6)}"
        with root.mkdir(version) as made:
            return [version, *made.identity()]

    def open_version(self, begun: list) -> Folder:
        version, *identity = begun
        folder = self.root.sub(version)
        if folder.identity() != tuple(identity):
            folder.close()
            raise CheckpointError(f"{self.root.where(version)} is not the version rank 0 made for this save (it was "
                                  f"replaced); nothing was written into it.")
        return folder

    def publish(self, name: str, begun: list, version: Room, completion: bytes) -> None:
        version.write_bytes(COMPLETE_FILE, completion)
        version.fsync()
        publish_version(self.root, name, begun[0], tuple(begun[1:]))

    def discard(self, begun: list) -> None:
        with warn_on_failure(f"removing {self.root.where(begun[0])}, the version of a save that failed",
                             "the next save of its name removes it"):
            if self.root.lstat(begun[0]) is not None and self.root.identity(begun[0]) == tuple(begun[1:]):
                remove_version(self.root, begun[0])

    def retain(self, keep: int, newest: str) -> None:
        retain(self.root, keep, newest)

    def locate(self, name: str) -> list:
        where, version = locate(self.root, name)
        return [f"{where}/{version}" if where else version]

    def open_located(self, location: list) -> Folder:
        return self.root.sub(location[0])

    def is_checkpoint(self, name: str) -> bool:
        return version_of(self.root, name) is not None or self.root.exists(f"{name}/{COMPLETE_FILE}")

    def has_checkpoints(self) -> bool:
        return bool(checkpoint_links(self.root))

    def remove(self, name: str) -> None:
        target = self.root.readlink(name)
        if target is not None and target.rsplit("/", 1)[-1].startswith(version_prefix(name)):
            unpublish(self.root, name)
        elif self.root.exists(name):
            raise CheckpointError(f"{self.root.where(name)} is not a checkpoint (an nxd_smp checkpoint link or an NxD "
                                  f"tag folder); nothing was removed.")

    def dup(self) -> LocalStore:
        return LocalStore(self.root.dup())

    def close(self) -> None:
        self.root.close()
