"""NxD's tag folders as a checkpoint format nxd_smp's entry points take: ``load_checkpoint``,
``has_checkpoint``, ``remove_checkpoint`` and ``save_checkpoint`` with state dicts (NxD Training's
call shape) reach ``folders`` and ``state_dicts`` through it. Registered when this module is
imported (``nxd_smp.interop`` imports it)."""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from ...backend import Backend
from ...backend.coordination import Coordinator
from ...checkpointing.formats import FolderFormat, register_format
from ...checkpointing.links import DONE_FILE
from .folders import STATE_DICTS_FILE, is_nxd_checkpoint, load_nxd, nxd_tags, remove_tag
from .state_dicts import load_state_dicts, save_state_dicts


class NxdTagFolders(FolderFormat):
    """``neuronx_distributed.trainer.save_checkpoint``'s folders: one per tag, ``done`` written last."""

    name = "NxD"
    writes_state_dicts = True

    def is_folder(self, path: Path) -> bool:
        return is_nxd_checkpoint(path)

    def is_complete(self, folder: Path) -> bool:
        return (folder / DONE_FILE).is_file()

    def newest(self, directory: Path) -> Path | None:
        tags = nxd_tags(directory)
        return tags[-1] if tags else None

    def remove(self, folder: Path) -> None:
        remove_tag(folder)

    def load(self, folder: Path, *, model: Any, optimizer: Any, scheduler: Any, strict: bool,
             coordinator: Coordinator) -> Any:
        # state dicts to fill, or a tag saved from state dicts (rank-local, loaded as saved)
        if isinstance(model, MutableMapping) or isinstance(optimizer, MutableMapping) \
                or (folder / STATE_DICTS_FILE).is_file():
            return load_state_dicts(folder, model=model, optimizer=optimizer, scheduler=scheduler, strict=strict,
                                    coordinator=coordinator)
        return load_nxd(folder, model=model, optimizer=optimizer, scheduler=scheduler, strict=strict,
                        coordinator=coordinator)

    def save_state_dicts(self, folder: Path, *, model: Any, optimizer: Any, scheduler: Any, user_content: Any,
                         backend: Backend, async_save: bool, num_kept: int | None) -> Path:
        return save_state_dicts(folder, model=model, optimizer=optimizer, scheduler=scheduler,
                                user_content=user_content, backend=backend, async_save=async_save, num_kept=num_kept)


register_format(NxdTagFolders())
