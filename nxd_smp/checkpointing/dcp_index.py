"""The one reader of ``torch.distributed.checkpoint`` (DCP) indexes: the ``.metadata`` of a native torch
run's checkpoint (``import_torch``).

A DCP index is a pickled ``Metadata``. It is unpickled by the strict reader (``reader.load_pickle``,
kind ``"dcp_metadata"``), which admits only the classes DCP writes into its metadata, and then checked
as a whole before anything it describes is read: every storage record belongs to an entry of the
index, is a DCP ``_StorageInfo`` without storage transforms, in a regular file of the checkpoint
folder (no link followed: ``files.Folder``), at an offset and length within that file, and no two
records of one file overlap (``storage.check_spans``). Every tensor entry has a dtype and a shape
whose size torch can compute (``check.is_shape``), and its chunks are each used once: inside
the tensor, listed once and at offsets no other chunk of it has (an index can list one chunk a hundred
thousand times at a few bytes a listing: pickle's memo), each held by its own record at least its bytes
long (DCP's ``FileSystemWriter`` writes one ``torch.save`` record per chunk), their elements adding up to
exactly the tensor's. Chunks of no elements (the empty shards of ranks beyond a dimension's size, which
torch places at the dimension's end: several at one offset where a planner did not merge them) are
skipped: they hold and allocate nothing.

What the index makes a reader allocate is then bounded by the folder's size: distinct chunks, each
within its record, records that share no byte, so a tensor's elements take no more bytes than its
records; a reader may allocate the tensor and a mask of what its chunks covered (``import_torch``
refuses chunks that overlap with that mask as it copies them in). Each check is linear in the index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..core.errors import CheckpointError, UnsafeFileError
from ..optim.loading.check import is_shape
from .files import Folder
from .reader import load_pickle
from .storage import check_spans
from .unpickler import _show  # (a file's value in a message, short)

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

    @property
    def chunks(self) -> list[tuple[tuple[int, ...], tuple[int, ...], Any]]:
        """A checked tensor entry's chunks that hold elements: ``(offsets, sizes, record)`` each, every
        one at offsets of its own."""
        out = []
        for chunk in self.meta.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if math.prod(sizes):
                out.append((offsets, sizes, self.records[offsets]))
        return out


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
            that is missing or not regular, bytes the file does not hold, or bytes another record holds; a
            tensor entry without a dtype or with a shape torch cannot size; a chunk outside its tensor,
            without a record, longer than its record, or listed twice; chunks that do not add up to their
            tensor. Each naming the index file and the entry.
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
    for key, entry in entries.items():
        if isinstance(entry.meta, TensorStorageMetadata):
            _check_chunks(key, entry, str(index_path))
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    for key, entry in entries.items():
        where = paths.get(key)
        entry.path = where if isinstance(where, tuple) and where else None
    return entries


def _check_chunks(key: str, entry: DcpEntry, source: str) -> None:
    """The tensor entry ``key``: a dtype, a shape torch can size, and chunks each used once (see the
    module's docstring), checked before anything is allocated by them, in one pass over its chunks.
    Each listing costs a constant but for what it alone brings: a chunk object listed again is refused
    by its identity, a tuple of sizes is measured once however many chunks share it, and a chunk of no
    elements is skipped before its offsets are read; a chunk that holds elements has offsets no other
    has, so each tuple of offsets walked is one of its own bytes in the file.

    Raises:
        CheckpointError: naming ``source``, the entry and the chunk.
    """
    meta = entry.meta
    properties, size, chunks = (getattr(meta, name, None) for name in ("properties", "size", "chunks"))
    dtype = properties.dtype if isinstance(properties, TensorProperties) else None
    if not isinstance(dtype, torch.dtype) or not is_shape(size, dtype):
        raise CheckpointError(f"{source}: entry {key!r} has the shape {_show(size)} and dtype {_show(dtype)}; a tensor "
                              f"has a torch dtype and a shape of sizes whose bytes torch can count (below 2**63). "
                              f"Refused.")
    if type(chunks) is not list:
        raise CheckpointError(f"{source}: entry {key!r} lists its chunks as a {type(chunks).__name__}, not a list.")
    size = tuple(size)
    numel = math.prod(size)
    listed: set[int] = set()  # the chunk objects met, by identity (each alive in the index while this runs)
    elements_of: dict[int, int] = {}  # a tuple of sizes' elements, by its identity
    seen: set[tuple[int, ...]] = set()  # the offsets of the chunks that hold elements
    held = 0
    for chunk in chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            raise CheckpointError(f"{source}: entry {key!r} lists a {type(chunk).__name__} among its chunks.")
        sizes = getattr(chunk, "sizes", None)
        if id(chunk) in listed:
            raise CheckpointError(f"{source}: chunk {_show(getattr(chunk, 'offsets', None))} of {key!r} is listed "
                                  f"twice; each chunk of a tensor is one record, used once. Refused before anything "
                                  f"is allocated.")
        listed.add(id(chunk))
        elements = elements_of.get(id(sizes))
        if elements is None:
            if not is_shape(sizes, dtype) or len(sizes) != len(size):
                raise CheckpointError(f"{source}: a chunk of {key!r} has the sizes {_show(sizes)}, not sizes of its "
                                      f"shape {_show(size)}.")
            elements = elements_of[id(sizes)] = math.prod(sizes)
        if not elements:  # an empty shard: nothing to read, nothing to allocate
            continue
        offsets = getattr(chunk, "offsets", None)
        if not (is_shape(offsets) and len(offsets) == len(size)
                and all(o + s <= n for o, s, n in zip(offsets, sizes, size))):
            raise CheckpointError(f"{source}: chunk {_show(offsets)} of {key!r} (sizes {_show(sizes)}) is not a chunk "
                                  f"inside its shape {_show(size)}.")
        offsets = tuple(offsets)
        info = entry.records.get(offsets)  # (the records' offsets: few of one hash, the strict reader saw to that)
        if info is None:
            raise CheckpointError(f"{source}: chunk {_show(offsets)} of {key!r} has no record.")
        if offsets in seen:
            raise CheckpointError(f"{source}: chunk {_show(offsets)} of {key!r} is listed twice; each chunk of a "
                                  f"tensor is one record, used once. Refused before anything is allocated.")
        seen.add(offsets)
        if elements * dtype.itemsize > info.length:
            raise CheckpointError(f"{source}: chunk {_show(offsets)} of {key!r} claims {elements} {dtype} elements, "
                                  f"more than its record of {info.length} bytes holds; refused.")
        held += elements
    if held != numel:
        raise CheckpointError(f"{source}: the chunks of {key!r} hold {held} elements, its shape {_show(size)} "
                              f"{numel}; a tensor's chunks tile it exactly. Refused before anything is allocated.")
