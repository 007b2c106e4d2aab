"""Version directories and the links that name them: the atomic swap, retention, and which
complete checkpoint a path means.

``path`` is a symbolic link to a sibling directory ``.<name>.v-<id>``. A save writes a new
sibling, fsyncs it, then swaps the link with ``os.replace`` and removes the old sibling, so
``path`` always resolves to a complete checkpoint (one with ``COMPLETE.json``). A save cut off
before the swap leaves a sibling without it, which loading reports and the next save of that
path removes. Retention keeps the newest K complete checkpoints of a directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..core.errors import CheckpointError
from .format import COMPLETE_FILE
from .publish import fsync_dir, swap_link


def version_prefix(path: Path) -> str:
    """The prefix of ``path``'s version directories (siblings of the link)."""
    return f".{path.name}.v-"


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


def publish_version(path: Path, version: str) -> None:
    """Point ``path`` at ``version`` atomically and remove the version it replaced."""
    old = os.readlink(path) if path.is_symlink() else None
    swap_link(path, version, adopt=_adopt_folder)
    if old is not None and Path(old).name.startswith(version_prefix(path)) and old != version:
        shutil.rmtree(path.parent / old, ignore_errors=True)
    # versions left by saves that were cut off before their swap
    for stale in path.parent.glob(f"{version_prefix(path)}*"):
        if stale.name != version and not (stale / COMPLETE_FILE).exists():
            shutil.rmtree(stale, ignore_errors=True)


def checkpoint_links(directory: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``directory`` (links to a version with a completion
    record), with when they were saved, newest first."""
    found = []
    for entry in directory.iterdir():
        if not entry.is_symlink() or entry.name.startswith("."):
            continue
        target = directory / os.readlink(entry)
        if not target.name.startswith(version_prefix(entry)) or not (target / COMPLETE_FILE).is_file():
            continue
        try:
            with open(target / COMPLETE_FILE) as f:
                saved_at = int(json.load(f).get("saved_at_ns") or 0)
        except (OSError, ValueError):
            continue
        found.append((saved_at or int((target / COMPLETE_FILE).stat().st_mtime_ns), entry))
    return sorted(found, key=lambda item: (item[0], item[1].name), reverse=True)


def unpublish(link: Path) -> None:
    """Remove the checkpoint ``link`` names: the link first (the name then means no checkpoint,
    never a half-removed one), then its version directory."""
    version = link.parent / os.readlink(link)
    link.unlink()
    fsync_dir(link.parent)
    if version.name.startswith(version_prefix(link)):
        shutil.rmtree(version, ignore_errors=True)


def retain(directory: Path, keep: int, newest: Path) -> None:
    """Remove all but the newest ``keep`` complete checkpoints of ``directory`` (never
    ``newest``, the one just written), then every version directory no link points to: those
    of saves killed before their swap, or after an unlink here. Only this save is in flight."""
    for _, link in checkpoint_links(directory)[keep:]:
        if link != newest:
            unpublish(link)
    pointed = {os.readlink(entry) for entry in directory.iterdir() if entry.is_symlink()}
    for entry in directory.iterdir():
        if entry.name.startswith(".") and ".v-" in entry.name and entry.is_dir() and entry.name not in pointed:
            shutil.rmtree(entry, ignore_errors=True)
    fsync_dir(directory)


def resolve(path: Path) -> Path:
    """The complete version directory behind ``path`` (a checkpoint link, a version directory,
    or a directory of checkpoints: its newest complete one), or an error that says why not."""
    if not os.path.lexists(path):
        partial = [p for p in path.parent.glob(f"{version_prefix(path)}*") if not (p / COMPLETE_FILE).exists()]
        if partial:
            raise CheckpointError(
                f"no complete checkpoint at {path}: the save into {partial[0]} was cut off before "
                f"it finished (incomplete: it has no {COMPLETE_FILE}). Resume from an earlier checkpoint."
            )
        raise FileNotFoundError(f"no checkpoint at {path}: the path does not exist.")
    if path.is_dir() and not path.is_symlink() and not (path / COMPLETE_FILE).exists() \
            and not path.name.startswith("."):
        links = checkpoint_links(path)
        if not links:
            raise CheckpointError(f"{path} is a directory without a complete checkpoint in it.")
        return links[0][1].resolve()
    target = path.resolve()
    if not target.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory.")
    if not (target / COMPLETE_FILE).exists():
        raise CheckpointError(
            f"the checkpoint at {target} is incomplete (no {COMPLETE_FILE}): its save was cut off. "
            f"Resume from an earlier checkpoint."
        )
    return target
