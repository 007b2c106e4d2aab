"""Checkpoint folders of other tools that nxd_smp's entry points also take: a format is described
here and registered by the part that knows it (``nxd_smp.interop`` registers NxD's tag folders when
``nxd_smp`` is imported), so that checkpointing dispatches to it without importing it.

``load_checkpoint(path)`` reads a registered format's folder when ``path`` is one, or is a directory
of them holding no nxd_smp checkpoint; ``has_checkpoint`` and ``remove_checkpoint`` know its
folders; ``save_checkpoint`` hands it the state dicts of a caller that passes state dicts instead of
objects (NxD Training's call shape).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from ..backend import Backend
from ..backend.coordination import Coordinator


class FolderFormat(ABC):
    """One tool's checkpoint folder layout (a folder per checkpoint)."""

    #: The tool's name, as errors name it.
    name: str = ""
    #: Whether ``save_state_dicts`` writes the state dicts a caller passes instead of objects.
    writes_state_dicts: bool = False

    @abstractmethod
    def is_folder(self, path: Path) -> bool:
        """Whether ``path`` is a checkpoint folder of this format, complete or not."""

    @abstractmethod
    def is_complete(self, folder: Path) -> bool:
        """Whether the folder ``folder`` of this format holds a complete checkpoint."""

    @abstractmethod
    def newest(self, directory: Path) -> Path | None:
        """The newest complete folder of this format in ``directory``, None if it holds none."""

    @abstractmethod
    def remove(self, folder: Path) -> None:
        """Remove ``folder`` so that an interrupted removal never leaves something complete-looking."""

    @abstractmethod
    def load(self, folder: Path, *, model: Any, optimizer: Any, scheduler: Any, strict: bool,
             coordinator: Coordinator) -> Any:
        """Load ``folder`` into ``model`` and ``optimizer`` (objects, or state dicts to fill) and
        ``scheduler``; every rank calls it; returns the saved user content."""

    def save_state_dicts(self, folder: Path, *, model: Any, optimizer: Any, scheduler: Any, user_content: Any,
                         backend: Backend, async_save: bool, num_kept: int | None) -> Path:
        """Write the state dicts ``model`` and ``optimizer`` into ``folder``; every rank calls it."""
        raise NotImplementedError(f"{self.name} folders are read, not written, by nxd_smp.")


_formats: list[FolderFormat] = []


def register_format(folder_format: FolderFormat) -> None:
    """Teach nxd_smp's checkpoint entry points ``folder_format`` (once; a second registration of the
    same class replaces the first)."""
    _formats[:] = [f for f in _formats if type(f) is not type(folder_format)] + [folder_format]


def registered_formats() -> list[FolderFormat]:
    return list(_formats)


def folder_format_of(path: Path, *, nxd_smp_checkpoints_there: bool) -> tuple[FolderFormat, Path] | None:
    """The registered format whose folder ``path`` means, and that folder: ``path`` itself, or (a
    directory holding no nxd_smp checkpoint: ``nxd_smp_checkpoints_there`` False) its newest complete
    folder. None: an nxd_smp checkpoint (or nothing registered knows it)."""
    if path.is_symlink():
        return None
    for folder_format in _formats:
        if folder_format.is_folder(path):
            return folder_format, path
    if path.is_dir() and not nxd_smp_checkpoints_there:
        for folder_format in _formats:
            newest = folder_format.newest(path)
            if newest is not None:
                return folder_format, newest
    return None


def state_dict_format() -> FolderFormat:
    """The registered format that writes state dicts (NxD's tag folders).

    Raises:
        TypeError: none is registered (``nxd_smp.interop`` was not imported).
    """
    for folder_format in _formats:
        if folder_format.writes_state_dicts:
            return folder_format
    raise TypeError("no checkpoint format for state dicts is registered: import nxd_smp (its interop part "
                    "registers NxD's), or pass the model and optimizer objects.")
