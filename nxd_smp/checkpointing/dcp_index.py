"""The one reader of ``torch.distributed.checkpoint`` (DCP) indexes: the ``.metadata`` of a native torch
run's checkpoint (``import_torch``).

A DCP index is a pickled ``Metadata``. It is unpickled by the strict reader (``reader.load_pickle``,
kind ``"dcp_metadata"``), which admits only the classes DCP writes into its metadata, and then checked
as a whole before anything it describes is read: every storage record belongs to an entry of the
index, is a DCP ``_StorageInfo`` without storage transforms, in a regular file of the checkpoint
folder (no link followed: ``files.Folder``), at an offset and length within that file, and no two
records of one file overlap (``storage.check_spans``). What the index makes a reader allocate is then
bounded by the folder's size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from ..core.errors import CheckpointError, UnsafeFileError
from .files import Folder
from .reader import load_pickle
from .storage import check_spans

METADATA_FILE = ".metadata"
#: The most bytes a DCP index may hold (a few hundred bytes per entry; a million entries is ~300 MB).
_METADATA_LIMIT = 1 << 30


@dataclass
class DcpEntry:
    """One entry of a DCP index, checked.

    Attributes:
        meta: its ``TensorStorageMetadata`` (a tensor: dtype, size, chunks) or ``BytesStorageMetadata``.
        records: where each chunk's bytes are, by the chunk's offsets (None for a bytes entry): DCP's
            ``_StorageInfo``.
        path: the entry's place in the saved state dict (``("optim", "state", fqn, "exp_avg")``), when
            the index's planner data records it.
    """

    meta: TensorStorageMetadata | BytesStorageMetadata
    records: dict[tuple[int, ...] | None, Any] = field(default_factory=dict)
    path: tuple | None = None


def read_metadata(folder: Folder) -> Metadata:
    """The DCP ``Metadata`` in ``folder``'s ``.metadata``, unpickled by the strict reader's
    ``"dcp_metadata"`` kind (not yet checked against the folder: ``read_dcp_index`` does that).

    Raises:
        UnsafeFileError: the file asks for a class a DCP index does not hold, or is no index.
    """
    source = str(folder.where(METADATA_FILE))
    data = folder.read_bytes(METADATA_FILE, limit=_METADATA_LIMIT)
    try:
        metadata = load_pickle(data, source, kind="dcp_metadata")
    except UnsafeFileError:
        raise
    except CheckpointError as e:  # a damaged pickle
        raise UnsafeFileError(f"{source} is not a readable checkpoint index: {e}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeFileError(f"{source} holds a {type(metadata).__name__}, not a checkpoint index.")
    return metadata


def read_dcp_index(folder: Folder) -> dict[str, DcpEntry]:
    """Every entry of the DCP index in ``folder``, by its flat key, checked (see the module's docstring).

    Raises:
        UnsafeFileError: the index asks for a class a DCP index does not hold, or is no index.
        CheckpointError: a record that is not one of an entry, names a file outside the folder, a file
            that is missing or not regular, bytes the file does not hold, or bytes another record holds.
    """
    index_path = folder.where(METADATA_FILE)
    metadata = read_metadata(folder)
    if not isinstance(metadata.storage_data, (dict, type(None))):
        raise CheckpointError(f"{index_path}: its storage data is a {type(metadata.storage_data).__name__}, not a "
                              f"dict; refused.")
    entries: dict[str, DcpEntry] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(meta, (TensorStorageMetadata, BytesStorageMetadata)):
            raise CheckpointError(f"{index_path}: entry {key!r} is neither a tensor nor a bytes entry.")
        entries[key] = DcpEntry(meta)
    records: list[tuple[str, Any, int, int]] = []
    found: list[tuple[str, tuple[int, ...] | None, Any]] = []
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(index, MetadataIndex) or index.fqn not in entries:
            raise CheckpointError(f"{index_path} names storage for an unknown entry {index!r}.")
        key = index.fqn
        if type(info).__name__ != "_StorageInfo":
            raise CheckpointError(f"{index_path}: entry {key!r} is stored as {type(info).__name__}; no DCP writer "
                                  f"nxd_smp reads writes such an entry.")
        if info.transform_descriptors:
            raise CheckpointError(f"{index_path}: {key!r} was written with storage transforms "
                                  f"{list(info.transform_descriptors)}, which nxd_smp does not apply; save without them.")
        records.append((key, info.relative_path, info.offset, info.length))
        found.append((key, None if index.offset is None else tuple(index.offset), info))
    check_spans(folder, records, source=str(index_path))
    for key, chunk, info in found:
        entries[key].records[chunk] = info
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    for key, entry in entries.items():
        where = paths.get(key)
        entry.path = where if isinstance(where, tuple) and where else None
    return entries
