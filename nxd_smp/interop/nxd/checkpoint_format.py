"""NxD's tag folders as a checkpoint format of nxd_smp's load pipeline: ``load_checkpoint``,
``has_checkpoint``, ``remove_checkpoint`` and ``save_checkpoint`` with state dicts (NxD Training's call
shape) reach ``folders`` and ``state_dicts`` through it. Registered when this module is imported
(``nxd_smp.interop`` imports it)."""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from ...backend import Backend
from ...checkpointing.files import Folder, user_path
from ...checkpointing.locations import open_store
from ...checkpointing.object_io import S3Path
from ...checkpointing.object_store import ObjectRoom
from ...checkpointing.pipeline import FolderFormat, register_format
from ...checkpointing.room import Room
from ...optim.loading.run import Reader
from ...optim.loading.staged import Request, Staged, Targets
from .folders import (
    STATE_DICTS_FILE,
    here,
    is_complete,
    is_nxd_checkpoint,
    newest_tag_in_bucket,
    nxd_tags,
    read_tag,
    remove_tag,
    store_completion,
)
from .state_dicts import read_state_dicts, save_state_dicts


class NxdTagFolders(FolderFormat):
    """``neuronx_distributed.trainer.save_checkpoint``'s folders: one per tag, ``done`` written last."""

    name = "NxD"
    writes_state_dicts = True

    def is_folder(self, path: Path) -> bool:
        return is_nxd_checkpoint(path)

    def is_complete(self, path: Path) -> bool:
        return is_complete(path)

    def newest(self, directory: Path) -> Path | None:
        tags = nxd_tags(directory)
        return tags[-1] if tags else None

    def remove(self, path: Path) -> None:
        remove_tag(path)

    def locate(self, path: Path) -> Any:
        return [user_path(path.parent), path.name]

    def reader(self, location: Any, targets: Targets, *, verify: bool) -> Reader:
        # the data-parallel group the agreement compares digests within: this rank's (TP, PP) coordinate
        coordinate = here(targets)
        targets.coordinate = (coordinate.data, coordinate.data_size, coordinate.tensor, coordinate.pipeline)
        state_dicts = isinstance(targets.model, MutableMapping) or isinstance(targets.optimizer, MutableMapping)

        def read_nxd(request: Request) -> Staged:
            if location[0] == "bucket":  # (NxD's own tag folder in a bucket, as NxD wrote it there)
                tag = ObjectRoom(S3Path.parse(location[1]))
                if state_dicts or tag.is_file(STATE_DICTS_FILE):
                    return read_state_dicts(tag, targets, request)
                return read_tag(tag, targets, request)
            if location[0] == "store":  # (a tag saved from state dicts to object storage: its committed version,
                _, root, *located = location  # seen as its completion record lists it)
                with open_store(root) as store, store.open_located(located) as version:
                    return read_state_dicts(version.restricted_to(store_completion(version)), targets, request)
            root, name = location
            with Folder.open(root) as parent, parent.sub(name) as tag:  # (opened once: no link below the root)
                # state dicts to fill, or a tag saved from state dicts (rank-local, loaded as saved)
                if state_dicts or tag.is_file(STATE_DICTS_FILE):
                    return read_state_dicts(tag, targets, request)
                return read_tag(tag, targets, request)

        return read_nxd

    def locate_in_bucket(self, path: S3Path) -> Any | None:
        tag = newest_tag_in_bucket(path)
        return None if tag is None else ["bucket", str(tag)]

    def holds(self, version: Room) -> bool:
        return version.is_file(STATE_DICTS_FILE)

    def save_state_dicts(self, folder: Path, *, model: Any, optimizer: Any, scheduler: Any, user_content: Any,
                         backend: Backend, async_save: bool, num_kept: int | None) -> Path:
        return save_state_dicts(folder, model=model, optimizer=optimizer, scheduler=scheduler,
                                user_content=user_content, backend=backend, async_save=async_save, num_kept=num_kept)


register_format(NxdTagFolders())
