"""The one reader of ``torch.distributed.checkpoint`` (DCP) indexes: the ``.metadata`` of nxd_smp's
formats 1 and 2, and of a native torch run's checkpoint (``import_torch``).

A DCP index is a pickled ``Metadata``. It is unpickled by the strict reader
(``reader.load_pickle``, kind ``"dcp_metadata"``), which admits only the classes DCP writes into its
metadata (and nxd_smp's own ``RawItem``, passed to it from here), and then checked as a whole
before anything it describes is read: every storage record belongs to an entry of the index, is a
``RawItem`` (nxd_smp's raw bytes) or a DCP ``_StorageInfo`` without storage transforms, in a regular
file inside the checkpoint folder, at an offset and length within that file, and no two records
of one file overlap. What the index makes a reader allocate is then bounded by the folder's size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from ..core.errors import CheckpointError
from .paths import check_spans, inside, open_regular
from .reader import UnsafeFileError, load_pickle

METADATA_FILE = ".metadata"


@dataclass(frozen=True)
class RawItem:
    """Where one saved tensor's bytes are: ``length`` bytes at ``offset`` of ``file``, with
    their CRC-32, the tensor's dtype and shape (a C-contiguous layout)."""

    file: str
    offset: int
    length: int
    crc32: int
    dtype: torch.dtype
    shape: tuple[int, ...]


#: The name the index pickles ``RawItem`` under: part of the format (``nxd_smp/checkpoint_storage.py``).
RawItem.__module__ = "nxd_smp.checkpoint_storage"


def SafeUnpickler(file, *, source: str = "the file") -> Any:  # noqa: N802 - the name earlier releases exported
    """Kept for callers of earlier releases: an object whose ``load()`` reads ``file`` as a DCP
    index by the strict reader (``reader.load_pickle``), which now holds the allow-list."""
    class _Index:
        def load(self) -> Any:
            return load_pickle(file.read(), source, kind="dcp_metadata", own=(RawItem,))
    return _Index()


@dataclass
class DcpEntry:
    """One entry of a DCP index, checked.

    Attributes:
        meta: its ``TensorStorageMetadata`` (a tensor: dtype, size, chunks) or ``BytesStorageMetadata``.
        records: where each chunk's bytes are, by the chunk's offsets (None for a bytes entry): a
            ``RawItem`` or DCP's ``_StorageInfo``, each with ``path`` (its file, resolved inside the
            folder) beside it.
        path: the entry's place in the saved state dict (``("optim", "state", fqn, "exp_avg")``), when
            the index's planner data records it.
    """

    meta: TensorStorageMetadata | BytesStorageMetadata
    records: dict[tuple[int, ...] | None, tuple[Any, Path]] = field(default_factory=dict)
    path: tuple | None = None


def read_metadata(directory: str | os.PathLike) -> Metadata:
    """The DCP ``Metadata`` in ``directory/.metadata``, unpickled by the strict reader's
    ``"dcp_metadata"`` kind (not yet checked against the folder: ``read_dcp_index`` does that).

    Raises:
        UnsafeFileError: the file asks for a class a DCP index does not hold, or is no index.
    """
    index_path = inside(directory, METADATA_FILE)
    with open_regular(index_path) as f:
        data = f.read()  # bounded by the file: no read the pickle asks for can exceed it
    try:
        metadata = load_pickle(data, str(index_path), kind="dcp_metadata", own=(RawItem,))
    except UnsafeFileError:
        raise
    except CheckpointError as e:  # a damaged pickle
        raise UnsafeFileError(f"{index_path} is not a readable checkpoint index: {e}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeFileError(f"{index_path} holds a {type(metadata).__name__}, not a checkpoint index.")
    return metadata


def read_dcp_index(directory: str | os.PathLike) -> dict[str, DcpEntry]:
    """Every entry of the DCP index ``directory/.metadata``, by its flat key, checked (see the
    module's docstring).

    Raises:
        UnsafeFileError: the index asks for a class a DCP index does not hold, or is no index.
        CheckpointError: a record that is not one of an entry, names a file outside the folder, a
            file that is missing or not regular, bytes the file does not hold, or bytes another
            record holds.
    """
    index_path = inside(directory, METADATA_FILE)
    metadata = read_metadata(directory)
    if not isinstance(metadata.storage_data, (dict, type(None))):
        raise CheckpointError(f"{index_path}: its storage data is a {type(metadata.storage_data).__name__}, not a "
                              f"dict; refused.")
    entries: dict[str, DcpEntry] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(meta, (TensorStorageMetadata, BytesStorageMetadata)):
            raise CheckpointError(f"{index_path}: entry {key!r} is neither a tensor nor a bytes entry.")
        entries[key] = DcpEntry(meta)
    records: list[tuple[str, Any, int, int]] = []
    found: list[tuple[str, tuple[int, ...] | None, Any, Any]] = []
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(index, MetadataIndex) or index.fqn not in entries:
            raise CheckpointError(f"{index_path} names storage for an unknown entry {index!r}.")
        key = index.fqn
        if isinstance(info, RawItem):
            name, offset, length = info.file, info.offset, info.length
        elif type(info).__name__ == "_StorageInfo":
            name, offset, length = info.relative_path, info.offset, info.length
            if info.transform_descriptors:
                raise CheckpointError(f"{index_path}: {key!r} was written with storage transforms "
                                      f"{list(info.transform_descriptors)}, which nxd_smp does not apply; save "
                                      f"without them.")
        else:
            raise CheckpointError(f"{index_path}: entry {key!r} is stored as {type(info).__name__}; no DCP "
                                  f"writer nxd_smp reads writes such an entry.")
        records.append((key, name, offset, length))
        found.append((key, None if index.offset is None else tuple(index.offset), info, name))
    files = check_spans(directory, records, source=str(index_path))
    for key, chunk, info, name in found:
        entries[key].records[chunk] = (info, files[name])
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    for key, entry in entries.items():
        where = paths.get(key)
        entry.path = where if isinstance(where, tuple) and where else None
    return entries
