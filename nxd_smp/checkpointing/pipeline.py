"""The checkpoint folder formats the entry points meet (``FolderFormat``): each hands the one load
pipeline (``nxd_smp.optim.loading.run``: read -> check -> agree -> install) the reader of its files.

Formats are registered here by the layer that knows them (``register_format``): nxd_smp's own is
registered below; NxD's tag folders by ``nxd_smp.interop`` when ``nxd_smp`` is imported.
``load_checkpoint`` runs the reader of the format rank 0 decides a path means (``locate_checkpoint``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from ..core.errors import CheckpointError, NotCommittedError
from ..optim.loading.run import Reader
from ..optim.loading.staged import Request, Staged, Targets
from .files import entry_kind
from .locations import open_store
from .object_io import S3Path
from .room import Room
from .smp_format import open_version, read


# ---------------------------------------------------------------------------- formats
class FolderFormat(ABC):
    """One tool's checkpoint folder layout, as the entry points meet it."""

    #: The tool's name, as errors name it.
    name: str = ""
    #: Whether ``save_state_dicts`` writes the state dicts a caller passes instead of objects.
    writes_state_dicts: bool = False

    @abstractmethod
    def is_folder(self, path: Path) -> bool:
        """Whether ``path`` is a checkpoint of this format, complete or not."""

    @abstractmethod
    def is_complete(self, path: Path) -> bool:
        """Whether ``path`` (``is_folder``) holds a complete checkpoint."""

    @abstractmethod
    def newest(self, directory: Path) -> Path | None:
        """The newest complete checkpoint of this format in ``directory``, None if it holds none."""

    @abstractmethod
    def remove(self, path: Path) -> None:
        """Remove ``path`` so that an interrupted removal never leaves something complete-looking."""

    @abstractmethod
    def locate(self, path: Path) -> Any:
        """Rank 0: the complete checkpoint ``path`` means, as a JSON value every rank's ``reader`` takes."""

    @abstractmethod
    def reader(self, location: Any, targets: Targets, *, verify: bool) -> Reader:
        """The reader of the checkpoint at ``location`` (``locate``'s) for ``targets``."""

    def locate_in_bucket(self, path: S3Path) -> Any | None:
        """Where this tool's own folder at ``path`` (or the newest under it) is in a bucket, written there by the
        tool itself (no commit record of nxd_smp's), as a JSON value its ``reader`` takes; None if none is."""
        return None

    def holds(self, version: Room) -> bool:
        """Whether a version of nxd_smp's stores (an object store's: ``locate_checkpoint``) holds this format's
        files rather than nxd_smp's own; its ``reader`` then takes the location ``["store", root, *located]``."""
        return False

    def save_state_dicts(self, folder: Path, *, model: Any, optimizer: Any, scheduler: Any, user_content: Any,
                         backend: Any, async_save: bool, num_kept: int | None) -> Path:
        """Write the state dicts ``model`` and ``optimizer`` into ``folder``; every rank calls it."""
        raise NotImplementedError(f"{self.name} folders are read, not written, by nxd_smp.")


class SmpFormat(FolderFormat):
    """nxd_smp's own checkpoints (``smp_format``) in either store (``locations.open_store``): a checkpoint, a
    version, or a directory (prefix) of checkpoints (its newest complete one)."""

    name = "nxd_smp"

    def is_folder(self, path: Path | S3Path) -> bool:
        try:
            with open_store(path.parent) as store:
                return store.is_checkpoint(path.name)
        except (OSError, CheckpointError):
            return False

    def is_complete(self, path: Path | S3Path) -> bool:
        try:
            self.locate(path)
            return True
        except (FileNotFoundError, CheckpointError):
            return False

    def newest(self, directory: Path | S3Path) -> Path | S3Path | None:
        try:
            with open_store(directory) as store:
                return directory if store.has_checkpoints() else None
        except (OSError, CheckpointError):
            return None

    def remove(self, path: Path | S3Path) -> None:
        with open_store(path.parent) as store:
            store.remove(path.name)

    def locate(self, path: Path | S3Path) -> Any:
        with open_store(path.parent) as store:
            return [str(store.where()), *store.locate(path.name)]

    def reader(self, location: Any, targets: Targets, *, verify: bool) -> Reader:
        root, *located = location

        def read_smp(request: Request) -> Staged:
            with open_store(root) as store, store.open_located(located) as version:
                return read(open_version(version), request, verify=verify)

        return read_smp


_formats: list[FolderFormat] = [SmpFormat()]


def register_format(folder_format: FolderFormat) -> None:
    """Teach the checkpoint entry points ``folder_format`` (once; a second registration of the same class
    replaces the first). Other tools' formats are asked before nxd_smp's own."""
    _formats[:] = [f for f in _formats if type(f) is not type(folder_format)]
    _formats.insert(len(_formats) - 1, folder_format)


def registered_formats() -> list[FolderFormat]:
    return list(_formats)


def format_named(name: str) -> FolderFormat:
    return next(f for f in _formats if f.name == name)


def locate_checkpoint(path: Path | S3Path) -> list:
    """Rank 0: which format's checkpoint ``path`` means, and where, as ``[format name, location]``: another
    tool's folder that ``path`` is, or (a directory holding no nxd_smp checkpoint) its newest complete one;
    else nxd_smp's.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: nothing complete there, naming why.
    """
    own = _formats[-1]
    if isinstance(path, S3Path):  # (a version of the object store: nxd_smp's files, or another format's inside it)
        try:
            location = own.locate(path)
        except (FileNotFoundError, NotCommittedError):  # (nothing nxd_smp committed: another tool's own folder?)
            found = next(([f.name, where] for f in _formats[:-1] if (where := f.locate_in_bucket(path)) is not None),
                         None)
            if found is None:
                raise
            return found
        with open_store(location[0]) as store, store.open_located(location[1:]) as version:
            other = next((f for f in _formats[:-1] if f.holds(version)), None)
        return [own.name, location] if other is None else [other.name, ["store", *location]]
    kind = entry_kind(path)
    if kind != "link":
        for folder_format in _formats[:-1]:
            if folder_format.is_folder(path):
                return [folder_format.name, folder_format.locate(path)]
        if kind == "directory" and own.newest(path) is None:
            for folder_format in _formats[:-1]:
                newest = folder_format.newest(path)
                if newest is not None:
                    return [folder_format.name, folder_format.locate(newest)]
    return [own.name, own.locate(path)]


def state_dict_format() -> FolderFormat:
    """The registered format that writes state dicts (NxD's tag folders).

    Raises:
        TypeError: none is registered (``nxd_smp.interop`` was not imported).
    """
    for folder_format in _formats:
        if folder_format.writes_state_dicts:
            return folder_format
    raise TypeError("no checkpoint format for state dicts is registered: import nxd_smp (its interop part registers "
                    "NxD's), or pass the model and optimizer objects.")
