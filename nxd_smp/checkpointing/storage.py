"""The bytes of a checkpoint on disk: tensors as raw bytes, and the index that says where.

Each rank writes the tensors it saves straight from their memory (a view of a flat shard
is written as it is: no clone, no per-tensor pickle) into a few large files
(``__<rank>_<k>.bin``, one per writer thread), computing CRC-32 of each tensor and of each
file on the bytes while it writes them, then fsyncs (``write_tensors``). The index is a JSON
file (``write_index``: per key its file, offset, length, CRC-32, dtype and shape). Checkpoints of
format 2 kept the same records as ``dcp_index.RawItem`` in a pickled DCP ``Metadata``, and those of
format 1 DCP's own ``FileSystemWriter`` files (each tensor a ``torch.save`` at an offset); both still
load, their index through the one DCP index reader (``dcp_index``) and their records through the
strict reader (``reader``).

Reading never runs code from the files nor reads outside the checkpoint or more than it holds:
every entry's dtype, shape and length is checked against its record, and every record against its
file, before anything is allocated (``check_records``). Nothing here communicates: each rank reads
and writes its own files, and whoever calls these functions coordinates.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..core.errors import CheckpointError
from .dcp_index import METADATA_FILE, RawItem, read_dcp_index
from .paths import check_spans, inside, open_regular, read_json
from .reader import load_bytes
from .typed_json import dtype_named
from .values import check_cast, is_size

#: Format 3's index: a JSON file (formats 1 and 2 kept DCP's pickled ``Metadata`` in ``.metadata``).
INDEX_FILE = "nxd_smp_index.json"
INDEX_FORMAT = "nxd_smp.index/1"
#: The most bytes a checkpoint's JSON file may hold (an index of a million tensors is ~100 MB).
JSON_LIMIT = 1 << 30

#: Files (and threads) per rank: two overlap one file's checksum with the other's writes.
IO_THREADS = max(1, min(4, os.cpu_count() or 1))
_CHUNK = 64 << 20  # bytes per write/read call: large, and the GIL is released for each


class ChecksumError(CheckpointError):
    """The bytes read back are not the bytes written (CRC-32 mismatch, truncation)."""


# ---------------------------------------------------------------------------- writing
def write_bytes(path: str | os.PathLike, data: bytes, *, sync: bool = True) -> None:
    """``data`` as the file ``path``, on disk (fsynced) when this returns, unless not ``sync``."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def write_tensors(
    directory: str | os.PathLike,
    prefix: str,
    tensors: Mapping[str, torch.Tensor],
    *,
    threads: int = 2,
    sync: bool = True,
) -> tuple[dict[str, list], dict[str, list[int]]]:
    """Write CPU ``tensors`` as raw bytes into ``threads`` files ``<prefix><k>.bin`` of
    ``directory`` (largest first, balanced by size), fsynced when ``sync``.

    Returns:
        ``(entries, files)``, both JSON values: ``entries[key] = [file, offset, length,
        crc32, dtype name, shape]`` and ``files[name] = [size, crc32]``.
    """
    directory = Path(directory)
    threads = max(1, int(threads))
    groups: list[list[str]] = [[] for _ in range(threads)]
    sizes = [0] * threads
    for key in sorted(tensors, key=lambda k: tensors[k].numel() * tensors[k].element_size(), reverse=True):
        k = sizes.index(min(sizes))
        groups[k].append(key)
        sizes[k] += tensors[key].numel() * tensors[key].element_size()
    jobs = [(f"{prefix}{k}.bin", keys) for k, keys in enumerate(groups) if keys]
    entries: dict[str, list] = {}
    files: dict[str, list[int]] = {}
    lock = threading.Lock()

    def write_file(name: str, keys: list[str]) -> None:
        offset, file_crc, mine = 0, 0, {}
        with open(directory / name, "wb", buffering=0) as f:
            for key in keys:
                tensor = tensors[key].detach()
                if tensor.device.type != "cpu":
                    tensor = tensor.cpu()
                if not tensor.is_contiguous():
                    tensor = tensor.contiguous()
                view, crc = _byte_view(tensor), 0
                for start in range(0, len(view), _CHUNK):
                    chunk = view[start : start + _CHUNK]
                    crc = zlib.crc32(chunk, crc)
                    file_crc = zlib.crc32(chunk, file_crc)
                    while chunk:  # a raw write may take fewer bytes than given
                        chunk = chunk[f.write(chunk) :]
                mine[key] = [name, offset, len(view), crc, str(tensor.dtype).removeprefix("torch."),
                             list(tensor.shape)]
                offset += len(view)
            if sync:
                os.fsync(f.fileno())
        with lock:
            entries.update(mine)
            files[name] = [offset, file_crc]

    if len(jobs) == 1:
        write_file(*jobs[0])
    elif jobs:
        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(lambda job: write_file(*job), jobs))
    return entries, files


def write_index(directory: str | os.PathLike, entries: Mapping[str, Sequence], *, sync: bool = True) -> list[int]:
    """The index of every rank's ``entries`` (as ``write_tensors`` returns them) as the JSON file
    ``directory/INDEX_FILE`` (format 3: ``{"format", "entries": {key: [file, offset, length,
    crc32, dtype name, shape]}}``). Returns the file's ``[size, crc32]``."""
    data = json.dumps({"format": INDEX_FORMAT, "entries": dict(sorted(entries.items()))},
                      ensure_ascii=True, separators=(",", ":")).encode("ascii")
    write_bytes(Path(directory) / INDEX_FILE, data, sync=sync)
    return [len(data), zlib.crc32(data)]


# ---------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint: its dtype and shape, and where its bytes are. ``raw``:
    raw bytes with a CRC-32 (formats 2 and 3), else a ``torch.save`` record (format 1)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str
    offset: int
    length: int
    crc32: int | None
    raw: bool
    path: Path | None = None  # ``file`` resolved inside the checkpoint folder (``read_index``)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def read_index(directory: str | os.PathLike, *, dcp: bool = False) -> dict[str, StoredTensor]:
    """Every tensor of the nxd_smp checkpoint in ``directory``, from its JSON index (format 3) or,
    with ``dcp``, its DCP index (formats 1 and 2, through ``dcp_index.read_dcp_index``), each one
    whole tensor whose record holds its bytes (a raw entry exactly so), in a regular file inside
    the folder, no two records of a file overlapping: what a reader allocates is bounded by the
    folder's size.

    Raises:
        CheckpointError: an entry that is not one whole tensor (nxd_smp writes no other), or whose
            dtype, shape or length does not fit its record, or a record outside its file.
    """
    if dcp:
        return _dcp_index(directory)
    path = Path(directory) / INDEX_FILE
    value = read_json(directory, INDEX_FILE, limit=JSON_LIMIT)
    entries = value.get("entries") if isinstance(value, dict) and value.get("format") == INDEX_FORMAT else None
    if not isinstance(entries, dict):
        raise CheckpointError(f"{path} is not an nxd_smp index ({{'format': {INDEX_FORMAT!r}, 'entries': ...}}).")
    out: dict[str, StoredTensor] = {}
    for key, entry in entries.items():
        if not (isinstance(entry, list) and len(entry) == 6 and isinstance(entry[0], str)
                and all(is_size(v) for v in entry[1:4]) and entry[3] < 1 << 32 and dtype_named(entry[4])
                and isinstance(entry[5], list) and all(is_size(d) for d in entry[5])):
            raise CheckpointError(f"{path}: entry {key!r} is not [file, offset, length, CRC-32, dtype, shape].")
        file, offset, length, crc, dtype, shape = entry
        out[key] = StoredTensor(dtype_named(dtype), tuple(shape), file, offset, length, crc, True)
    return check_records(directory, out, str(path))


def _dcp_index(directory: str | os.PathLike) -> dict[str, StoredTensor]:
    """``read_index`` of formats 1 and 2: a DCP index of ``RawItem`` (2) or DCP's own records (1)."""
    path = Path(directory) / METADATA_FILE
    out: dict[str, StoredTensor] = {}
    for key, entry in read_dcp_index(directory).items():
        meta = entry.meta
        if not isinstance(meta, TensorStorageMetadata) or len(meta.chunks) != 1 or len(entry.records) != 1:
            raise CheckpointError(f"{path}: entry {key!r} is not one whole tensor; nxd_smp writes no other.")
        (info, _), = entry.records.values()
        shape = tuple(meta.size) if isinstance(meta.size, (tuple, list)) else None
        if shape is None or not all(is_size(d) for d in shape):
            raise CheckpointError(f"{path}: entry {key!r} has the shape {meta.size!r}, not a tuple of sizes.")
        if isinstance(info, RawItem):
            name, offset, length, crc, dtype, raw = info.file, info.offset, info.length, info.crc32, info.dtype, True
            if not isinstance(info.shape, (tuple, list)) or tuple(info.shape) != shape:
                raise CheckpointError(f"{path}: entry {key!r} is stored with shape {info.shape!r}, indexed as {shape}.")
            if not isinstance(crc, int):
                raise CheckpointError(f"{path}: entry {key!r} has no CRC-32.")
        else:  # format 1: DCP's, a torch.save record at an offset
            name, offset, length, crc, raw = info.relative_path, info.offset, info.length, None, False
            dtype = getattr(meta.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{path}: entry {key!r} has the dtype {dtype!r}; refused.")
        out[key] = StoredTensor(dtype, shape, str(name), offset, length, crc, raw)
    return check_records(directory, out, str(path))


def check_records(directory: str | os.PathLike, index: dict[str, StoredTensor], source: str) -> dict[str, StoredTensor]:
    """``index`` checked against the folder: each record's length that of its tensor (a raw
    entry's exactly, a ``torch.save`` record's at least), and its bytes in its file
    (``paths.check_spans``); each entry's ``path`` filled in.

    Raises:
        CheckpointError: naming ``source``, the entry and the file.
    """
    for key, stored in index.items():
        if stored.raw and stored.length != stored.nbytes or not stored.raw and stored.length < stored.nbytes:
            raise CheckpointError(f"{source}: entry {key!r} claims {stored.length} bytes for a {stored.shape} "
                                  f"{stored.dtype} tensor of {stored.nbytes}.")
    files = check_spans(directory, ((key, s.file, s.offset, s.length) for key, s in index.items()), source=source)
    return {key: dataclasses.replace(stored, path=files[stored.file]) for key, stored in index.items()}


def read_tensors(
    directory: str | os.PathLike,
    index: Mapping[str, StoredTensor],
    targets: Mapping[str, torch.Tensor],
    *,
    verify: bool = True,
    threads: int = 2,
) -> None:
    """Read each ``targets[key]`` (a tensor of the stored shape) from the checkpoint in
    ``directory``: raw bytes straight into it where it is a contiguous CPU tensor of the
    stored dtype (else through a staging tensor, cast on the copy), checked against their
    CRC-32 when ``verify``; format-1 records through the strict reader.

    Raises:
        ChecksumError: bytes that are not those written, naming the tensor and the file.
    """
    directory = Path(directory)
    per_file: dict[str, list[str]] = {}
    for key in targets:
        per_file.setdefault(index[key].file, []).append(key)

    def read_file(name: str, keys: Sequence[str]) -> None:
        stored = index[keys[0]]
        with open_regular(stored.path or inside(directory, name)) as f:
            for key in sorted(keys, key=lambda k: index[k].offset):
                stored, target = index[key], targets[key]
                if tuple(target.shape) != stored.shape:
                    raise ValueError(f"{key}: stored with shape {stored.shape}, the target has "
                                     f"{tuple(target.shape)}.")
                if stored.raw and target.is_contiguous() and target.device.type == "cpu" and target.dtype == stored.dtype:
                    _read_raw(f, key, stored, target, verify)
                elif stored.raw:
                    staging = torch.empty(stored.shape, dtype=stored.dtype)
                    _read_raw(f, key, stored, staging, verify)
                    check_cast(staging, target.dtype, f"{key} in {stored.file}")
                    target.copy_(staging)
                else:
                    record = _read_record(f, key, stored)
                    check_cast(record, target.dtype, f"{key} in {stored.file}")
                    target.copy_(record)

    jobs = list(per_file.items())
    if len(jobs) <= 1 or threads <= 1:
        for job in jobs:
            read_file(*job)
    else:
        with ThreadPoolExecutor(min(threads, len(jobs))) as pool:
            list(pool.map(lambda job: read_file(*job), jobs))


def _read_raw(f, key: str, stored: StoredTensor, tensor: torch.Tensor, verify: bool) -> None:
    view = _byte_view(tensor)
    if len(view) != stored.length:
        raise ChecksumError(f"{key}: {stored.length} bytes in {stored.file}, the destination holds {len(view)}.")
    f.seek(stored.offset)
    crc, done = 0, 0
    while done < len(view):
        n = f.readinto(view[done : done + _CHUNK])
        if not n:
            raise ChecksumError(f"{key}: {stored.file} ends before its bytes (truncated).")
        if verify:
            crc = zlib.crc32(view[done : done + n], crc)
        done += n
    if verify and crc != stored.crc32:
        raise ChecksumError(f"{key} in {stored.file} is corrupted (CRC-32 mismatch).")


def read_record(directory: str | os.PathLike, file: str, offset: int, length: int, key: str) -> Any:
    """The ``torch.save`` record of ``key`` (a tensor, or a non-tensor entry of a DCP
    ``FileSystemWriter`` checkpoint: numbers, strings, containers) at ``offset`` of
    ``directory/file``, loaded by the strict reader (``reader.load_bytes``) on the CPU.

    Raises:
        UnsafeFileError: the record asks for something the strict reader refuses.
        ChecksumError: the file ends before the record.
    """
    with open_regular(inside(directory, file, source=f"the index of {directory}")) as f:
        return _load_record(f, key, file, offset, length)


def _load_record(f, key: str, file: str, offset: int, length: int) -> Any:
    size = os.fstat(f.fileno()).st_size
    if not (is_size(offset) and is_size(length)) or offset + length > size:
        raise ChecksumError(f"{key}: its record claims bytes [{offset}, {offset}+{length}) of {file}, which holds "
                            f"{size} (truncated, or a crafted index).")
    f.seek(offset)
    data = bytearray(length)
    view, done = memoryview(data), 0
    while done < length:  # one raw read returns at most ~2 GiB
        n = f.readinto(view[done : done + _CHUNK])
        if not n:
            raise ChecksumError(f"{key}: {file} ends before its bytes (truncated).")
        done += n
    return load_bytes(data, f"{key} in {file}")


def _read_record(f, key: str, stored: StoredTensor) -> torch.Tensor:
    tensor = _load_record(f, key, stored.file, stored.offset, stored.length)
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != stored.shape or tensor.dtype != stored.dtype:
        raise ChecksumError(f"{key} in {stored.file} is not the {stored.shape} tensor its index says.")
    return tensor
