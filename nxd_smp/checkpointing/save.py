"""Saving: this rank's tensors of a checkpoint, the small files, and how every rank writes and rank 0
publishes, into either store (``room.Store``: a local directory, ``versions.LocalStore``; an S3
prefix, ``object_store.ObjectStore``).

Rank 0 decides (``agreement.decide``): it encodes the small files (a value nxd_smp's format cannot
hold is refused on every rank with nothing written), begins a new version in the store
(``Store.begin``: on disk a new folder in the root, on S3 a new prefix and the commit record it will
take) and tells every rank how to open it; every rank opens it and checks it is that very version
(``Store.open_version``: on disk below the root without following a link, by device and inode), so a
folder swapped in meanwhile is refused, not written into. Then every rank writes the pieces of the
state it owns and its share of the (replicated) model tensors into files it creates there
(``storage``), and through the ranks' write-and-publish (``write_and_publish``) rank 0 writes the
index and the small files, and the store commits the version with its completion record
(``Store.publish``: the link swapped on disk, the commit record's conditional PUT on S3) and applies
the retention; if a rank failed, rank 0 removes the version (``Store.discard``). A failure anywhere
before the commit is a ``CheckpointError`` on every rank; after it (the old version's removal, the
retention) a warning: a save that published never reports failure. With ``async_save`` the tensors
are staged into host buffers and the rest happens on the background writer (``writer``), which owns
its own handles of the store and the version.
"""

from __future__ import annotations

import logging
import secrets
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..backend import Backend
from ..backend.agreement import decide, error_text
from ..backend.coordination import Coordinator
from ..core.dtensors import tensor_parallel_layout
from ..core.errors import CheckpointError
from ..core.progress import phases, transfer
from ..zero1_optimizer import Zero1Optimizer
from .files import Folder
from .smp_format import completion_bytes, entries_to_save, small_files
from .storage import INDEX_FILE, IO_THREADS, write_index, write_tensors
from .locations import open_store
from .room import Room, Store
from .versions import is_link_name
from .writer import stage, start_save

log = logging.getLogger("nxd_smp.checkpoint")


def save(path: Any, model: nn.Module, optimizer: Zero1Optimizer | None, backend: Backend, *,
         objects: Mapping[str, Any], extra: Any, save_master_weights: bool, async_save: bool,
         num_kept_ckpts: int | None, progress: bool | None) -> Any:
    """``save_checkpoint`` once its arguments are checked and no save of this rank is in flight:
    decide a new version, write this rank's part (now, or staged and in the background), publish.
    Returns the version directory."""
    coordinator = backend.coordinator
    if async_save:
        check_async_save(coordinator)
    if not is_link_name(path.name):
        raise CheckpointError(f"{path}: a checkpoint's name must be a plain name, not hidden (names starting with '.' "
                              f"are its versions' and the record of saves'); pick another.")
    layout = tensor_parallel_layout(model)
    if layout is not None:  # one id for every tensor-parallel coordinate of this save: the join checks it
        layout["save"] = decide(backend.world_coordinator, lambda: secrets.token_hex(16))
    state, meta, copied = entries_to_save(model, optimizer, bool(save_master_weights), backend, layout)
    small: dict[str, bytes] = {}

    def encode() -> None:
        """Rank 0, before the version is begun: the small files (what they cannot hold is refused)."""
        nonlocal small
        try:
            small, tensors = small_files(meta, extra, objects)
        except TypeError as e:
            raise TypeError(f"nothing was saved to {path}: {e}") from None
        state.update(tensors)

    begun, opened = begin_version(coordinator, path, encode, refused=f"nothing was saved to {path}")
    # (a bar in bytes from the background writer would cut through the training loop's output: it logs)
    job = dict(opened=opened, path=path, begun=begun, num_kept=num_kept_ckpts,
               progress=False if async_save else progress)
    if not async_save:
        try:
            with phases(progress, coordinator.rank, ["write", "publish"], f"save {path.name}", log) as advance:
                _write_and_publish(state, small, coordinator, advance=advance, **job)
        finally:
            close_opened(opened)
        return path.parent / begun[0]

    with phases(progress, coordinator.rank, ["stage"], f"stage {path.name}", log) as advance:
        if not copied:  # the live tensors may change while they are written
            state = stage(state)
        advance("stage")
    if not isinstance(opened, BaseException):  # the writer thread's own descriptors
        job["opened"] = (opened[0].dup(), opened[1].dup())
        close_opened(opened)

    def work() -> None:
        try:
            _write_and_publish(state, small, coordinator, advance=lambda phase: log.info("save %s: %s", path.name, phase),
                               **job)
        finally:
            close_opened(job["opened"])

    start_save(str(path), work)
    return path.parent / begun[0]


def begin_version(coordinator: Coordinator, path: Any, first: Callable[[], None], *, refused: str
                  ) -> tuple[list, tuple[Store, Room] | Exception]:
    """Rank 0 runs ``first()`` (what it checks or encodes before anything is made), then begins a version of
    the checkpoint ``path`` in its parent's store (a local directory made where missing); every rank opens
    it (``open_begun``). Returns what ``Store.begin`` answered and what this rank opened, or why it could not
    (which the ranks' write-and-publish tells every rank). nxd_smp's format and NxD's state-dict tags on S3
    both save through it.

    Raises:
        CheckpointError: rank 0 could not begin (``refused`` leads the message), on every rank.
        TypeError: ``first()``'s, on every rank.
    """
    store: Store | None = None

    def begin() -> list:
        nonlocal store
        first()
        store = open_store(path.parent, create=True)
        return store.begin(path.name)

    try:
        begun = decide(coordinator, begin)
    except (CheckpointError, FileNotFoundError) as e:
        if store is not None:
            store.close()
        raise CheckpointError(f"{refused}: {e}") from None
    return begun, open_begun(store, path.parent, begun)


def discard_version(opened: tuple[Store, Room] | Exception, begun: list) -> None:
    """Rank 0, once a rank failed to write: the version ``begun`` removed from the store that ``opened`` it."""
    if not isinstance(opened, BaseException):
        opened[0].discard(begun)


def open_begun(store: Store | None, parent: Any, begun: list) -> tuple[Store, Room] | Exception:
    """The store (``parent``, or rank 0's ``store`` already open) and the version rank 0 began in it, opened on
    this rank and checked to be that very one (``Store.open_version``); or why not, which the ranks'
    write-and-publish then tells every rank."""
    try:
        store = store or open_store(parent)
    except Exception as e:  # noqa: BLE001 - every rank learns of it in the write-and-publish
        return e
    try:
        return store, store.open_version(begun)
    except Exception as e:  # noqa: BLE001 - every rank learns of it in the write-and-publish
        store.close()
        return e


def open_made(root: Folder | None, parent: Path, name: str, identity: list[int], what: str
              ) -> tuple[Folder, Folder] | Exception:
    """The root (``parent``, or rank 0's ``root`` already open) and the folder ``name`` rank 0 made in it,
    opened on this rank below the root and checked to be that very folder (device and inode, ``identity``);
    or why not, which the ranks' write-and-publish then tells every rank (``what`` names the folder)."""
    try:
        root = root or Folder.open(parent)
        folder = root.sub(name)
        if folder.identity() != tuple(identity):
            folder.close()
            raise CheckpointError(f"{root.where(name)} is not the {what} rank 0 made for this save (it was replaced); "
                                  f"nothing was written into it.")
        return root, folder
    except Exception as e:  # noqa: BLE001 - every rank learns of it in the write-and-publish
        return e


def close_opened(opened: tuple[Any, Any] | Exception) -> None:
    """Close what ``open_made`` or ``open_begun`` opened (nothing, if it could not). It runs after the publish
    too, so a directory descriptor that will not close (nothing of the save's is lost with it) fails nothing."""
    if not isinstance(opened, BaseException):
        for folder in opened:
            try:
                folder.close()
            except OSError:
                if isinstance(folder, Folder):
                    folder.fd = -1


def check_async_save(coordinator: Coordinator) -> None:
    """Refuse an asynchronous save that the background writer could not coordinate.

    Raises:
        CheckpointError: naming the fix.
    """
    if not coordinator.works_off_thread:
        raise CheckpointError(
            "async_save=True needs a coordination that a background thread can use, and these XLA replicas "
            "coordinate through xm.rendezvous, which only their own threads may call. Launch with torchrun and "
            "init_process_group('xla') (a gloo group then coordinates), or save with async_save=False.")


def _write_and_publish(state: Mapping[str, torch.Tensor], small: Mapping[str, bytes], coordinator: Coordinator, *,
                       opened: tuple[Store, Room] | Exception, path: Any, begun: list, num_kept: int | None,
                       advance: Callable[[str], None], progress: bool | None) -> None:
    """Every rank writes its tensors into the version it opened (``opened``: the store and the version, or why
    it could not); then rank 0 writes the index and the small files, and the store commits the version with
    its completion record and applies the retention."""

    def write() -> Any:
        if isinstance(opened, BaseException):
            raise opened
        total = sum(t.numel() * t.element_size() for t in state.values())
        desc = f"write {path.name}: rank {coordinator.rank}'s part"
        with transfer(progress, coordinator.rank, total, desc, log) as moved:
            return write_tensors(opened[1], f"__{coordinator.rank}_", state, threads=IO_THREADS, moved=moved)

    def publish(written: list) -> None:
        store, version = opened
        entries = {}
        for part_entries, _ in written:  # replicated scalars (a parameter's step) come from several ranks
            for key, entry in part_entries.items():
                entries.setdefault(key, entry)
        files = {file: v for _, part_files in written for file, v in part_files.items()}
        files[INDEX_FILE] = write_index(version, entries)
        for file, data in small.items():
            version.write_bytes(file, data)
            files[file] = [len(data), zlib.crc32(data)]
        store.publish(path.name, begun, version, completion_bytes(files))
        if num_kept is not None:  # (published: the retention warns, never fails the save)
            store.retain(num_kept, newest=path.name)

    write_and_publish(coordinator, write, publish, what=str(path), discard=lambda: discard_version(opened, begun),
                      advance=advance)


def write_and_publish(coordinator: Coordinator, write: Callable[[], Any], publish: Callable[[list[Any]], None], *,
                      what: str, discard: Callable[[], None] | None = None,
                      advance: Callable[[str], None] = lambda phase: None) -> None:
    """Every rank of ``coordinator``'s group runs ``write()`` (its own files; a JSON value back), and all
    learn every rank's outcome; then rank 0 decides: ``publish(results)`` (in rank order: what completes
    the save and puts it in place), or ``discard()`` if a rank failed. Every rank ends with the same
    outcome: a failure anywhere, of any kind, is a ``CheckpointError`` naming ``what`` on every rank.
    nxd_smp's format and NxD's state-dict tags are both saved through it. ``advance``: told ``"write"``
    and ``"publish"`` as they end."""
    mine: dict[str, Any] = {"result": None, "error": None}
    try:
        mine["result"] = write()
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        mine["error"] = f"rank {coordinator.rank}: {error_text(e)}"
    gathered = coordinator.all_gather(mine)
    failures = [part["error"] for part in gathered if part["error"]]
    if not failures:
        advance("write")

    def finish() -> None:
        if failures:
            if discard is not None:
                discard()
            raise CheckpointError("; ".join(failures))
        publish([part["result"] for part in gathered])

    try:
        decide(coordinator, finish)
    except (CheckpointError, FileNotFoundError, TypeError) as e:
        raise CheckpointError(f"the save of {what} failed: {e}") from None
    advance("publish")
