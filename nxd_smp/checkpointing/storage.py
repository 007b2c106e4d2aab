"""The bytes of a checkpoint on disk: tensors as raw bytes, and the JSON index that says where.

Each rank writes the tensors it saves straight from their memory (a view of a flat shard is written
as it is: no clone, no per-tensor pickle) into a few large files (``__<rank>_<k>.bin``, one per
writer thread) of the version folder, created there (``room.Room.create``: a local file, or an object uploaded in parts), computing CRC-32 of
each tensor and of each file on the bytes while it writes them, then fsyncs (``write_tensors``).
The index is a JSON file (``write_index``: per key its file, offset, length, CRC-32, dtype and shape).

Reading never runs code from the files nor reads outside the folder or more than it holds: every
entry's dtype, shape and length is checked against its record, and every record against its file
(``check_spans``: a regular file of the folder, within its size, no two records overlapping) before
anything is allocated. Nothing here communicates: each rank reads and writes its own files, and
whoever calls these functions coordinates.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Hashable

import torch

from ..core.errors import CheckpointError, ChecksumError
from ..optim.loading.check import check_cast, is_shape, is_size
from .budget import Budget
from .files import Folder, check_name
from .room import Room
from .reader import first_overlap, load_bytes
from .typed_json import dtype_named, loads

#: The index: a JSON file.
INDEX_FILE = "nxd_smp_index.json"
INDEX_FORMAT = "nxd_smp.index/1"
#: The most bytes a checkpoint's JSON file may hold (an index of a million tensors is ~100 MB).
JSON_LIMIT = 1 << 30

#: Files (and threads) per rank: two overlap one file's checksum with the other's writes.
IO_THREADS = max(1, min(4, os.cpu_count() or 1))
_CHUNK = 64 << 20  # bytes per write/read call: large, and the GIL is released for each


# ---------------------------------------------------------------------------- writing
def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def write_tensors(folder: Room, prefix: str, tensors: Mapping[str, torch.Tensor], *, threads: int = 2,
                  sync: bool = True, moved: Callable[[int], None] | None = None
                  ) -> tuple[dict[str, list], dict[str, list[int]]]:
    """Write CPU ``tensors`` as raw bytes into ``threads`` new files ``<prefix><k>.bin`` of ``folder``
    (largest first, balanced by size), fsynced when ``sync``; ``moved(n)`` is told of the bytes as they go
    (from the writing threads).

    Returns:
        ``(entries, files)``, both JSON values: ``entries[key] = [file, offset, length, crc32, dtype
        name, shape]`` and ``files[name] = [size, crc32]``.
    """
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
        with folder.create(name) as f:
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
                    if moved is not None:
                        moved(min(_CHUNK, len(view) - start))
                mine[key] = [name, offset, len(view), crc, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
                offset += len(view)
            if sync:
                folder.sync_file(f)
        with lock:
            entries.update(mine)
            files[name] = [offset, file_crc]

    if len(jobs) == 1:
        write_file(*jobs[0])
    elif jobs:
        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(lambda job: write_file(*job), jobs))
    return entries, files


def write_index(folder: Room, entries: Mapping[str, Sequence], *, sync: bool = True) -> list[int]:
    """The index of every rank's ``entries`` (as ``write_tensors`` returns them) as the JSON file
    ``INDEX_FILE`` of ``folder`` (``{"format", "entries": {key: [file, offset, length, crc32, dtype name,
    shape]}}``). Returns the file's ``[size, crc32]``."""
    data = json.dumps({"format": INDEX_FORMAT, "entries": dict(sorted(entries.items()))},
                      ensure_ascii=True, separators=(",", ":")).encode("ascii")
    folder.write_bytes(INDEX_FILE, data, sync=sync)
    return [len(data), zlib.crc32(data)]


# ---------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint: its dtype and shape, and where its bytes are (raw, with a CRC-32)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str
    offset: int
    length: int
    crc32: int

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def read_index(folder: Room, *, data: bytes | None = None) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint in ``folder``, from its JSON index (``data``: its bytes, already
    read and checked against the completion record), each one whole tensor whose record holds exactly
    its bytes, in a regular file of the folder, no two records of a file overlapping: what a reader
    allocates is bounded by the folder's size.

    Raises:
        CheckpointError: an entry that is not one whole tensor, or whose dtype, shape or length does not
            fit its record, or a record outside its file.
    """
    source = str(folder.where(INDEX_FILE))
    if data is None:
        data = folder.read_bytes(INDEX_FILE, limit=JSON_LIMIT)
    value = loads(data, source)
    entries = value.get("entries") if isinstance(value, dict) and value.get("format") == INDEX_FORMAT else None
    if not isinstance(entries, dict):
        raise CheckpointError(f"{source} is not an nxd_smp index ({{'format': {INDEX_FORMAT!r}, 'entries': ...}}).")
    budget = Budget.linear(len(data), source, per_byte=16, floor=1 << 16, what="bytes of memory for its entries",
                           counted="the index")
    out: dict[str, StoredTensor] = {}
    for key, entry in entries.items():
        if not (isinstance(entry, list) and len(entry) == 6 and isinstance(entry[0], str)
                and all(is_size(v) for v in entry[1:4]) and entry[3] < 1 << 32 and dtype_named(entry[4])
                and isinstance(entry[5], list) and len(entry[5]) <= 64 and is_shape(entry[5], dtype_named(entry[4]))):
            raise CheckpointError(f"{source}: entry {key!r} is not [file, offset, length, CRC-32, dtype, shape] (a "
                                  f"shape's bytes below 2**63).")
        budget.charge(256 + 8 * len(entry[5]))
        file, offset, length, crc, dtype, shape = entry
        out[key] = StoredTensor(dtype_named(dtype), tuple(shape), file, offset, length, crc)
        if length != out[key].nbytes:
            raise CheckpointError(f"{source}: entry {key!r} claims {length} bytes for a {tuple(shape)} {dtype} tensor "
                                  f"of {out[key].nbytes}.")
    check_spans(folder, ((key, s.file, s.offset, s.length) for key, s in out.items()), source=source)
    return out


def check_spans(folder: Room, records: Iterable[tuple[str, Any, int, int]], *, source: str) -> None:
    """Every record ``(key, file name, offset, length)`` of an index (nxd_smp's JSON, a DCP ``.metadata``)
    in a regular file of ``folder`` (no link followed), within the file's size, and no two records of one
    file overlapping: what a reader of the records allocates and reads is then bounded by the folder.

    Raises:
        CheckpointError: naming ``source``, the entry and the file.
    """
    sizes: dict[str, tuple[tuple[int, int], int]] = {}
    spans: dict[Hashable, list[tuple[int, int, str]]] = {}  # by the file itself: "a" and "./a" are one
    for key, name, offset, length in records:
        if not (is_size(offset) and is_size(length)):
            raise CheckpointError(f"{source}: entry {key!r} has the offset {offset!r} and length {length!r}; refused.")
        if name not in sizes:
            check_name(name, f"{source}: entry {key!r}")
            st = folder.stat_file(name)
            if st is None:
                raise CheckpointError(f"{source}: entry {key!r} is in {name}, which is missing.")
            if not st.regular:
                raise CheckpointError(f"{source}: entry {key!r} is in {name}, which is not a regular file (a link, a "
                                      f"FIFO, a directory); refused.")
            sizes[name] = (st.identity, st.size)
        identity, size = sizes[name]
        if offset + length > size:
            raise CheckpointError(f"{source}: entry {key!r} claims bytes [{offset}, {offset + length}) of {name}, "
                                  f"which holds {size} (truncated, or a crafted index).")
        spans.setdefault(identity, []).append((offset, offset + length, key))
    for found in spans.values():
        pair = first_overlap(found)
        if pair is not None:
            raise CheckpointError(f"{source}: the entries {pair[0]!r} and {pair[1]!r} overlap in one file; refused "
                                  f"(each record's bytes are its own).")


def read_tensors(folder: Room, index: Mapping[str, StoredTensor], targets: Mapping[str, torch.Tensor], *,
                 verify: bool = True, threads: int = 2) -> None:
    """Read each ``targets[key]`` (a tensor of the stored shape) from the checkpoint in ``folder``: raw
    bytes straight into it where it is a contiguous CPU tensor of the stored dtype (else through a
    staging tensor, cast on the copy), checked against their CRC-32 when ``verify``.

    Raises:
        ChecksumError: bytes that are not those written, naming the tensor and the file.
        CheckpointError: a key the index lacks, a shape that differs.
    """
    missing = sorted(set(targets) - set(index))
    if missing:
        raise CheckpointError(f"the checkpoint at {folder.where()} lacks the tensors {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else "") + ".")
    per_file: dict[str, list[str]] = {}
    for key in targets:
        per_file.setdefault(index[key].file, []).append(key)

    def read_file(name: str, keys: Sequence[str]) -> None:
        with folder.open_file(name) as f:
            for key in sorted(keys, key=lambda k: index[k].offset):
                stored, target = index[key], targets[key]
                if tuple(target.shape) != stored.shape:
                    raise CheckpointError(f"{key}: stored with shape {stored.shape}, the target has "
                                          f"{tuple(target.shape)}.")
                if target.is_contiguous() and target.device.type == "cpu" and target.dtype == stored.dtype:
                    _read_raw(f, key, stored, target, verify)
                else:
                    staging = torch.empty(stored.shape, dtype=stored.dtype)
                    _read_raw(f, key, stored, staging, verify)
                    check_cast(staging, target.dtype, f"{key} in {stored.file}")
                    target.copy_(staging)

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


def crc32_of(folder: Room, name: str) -> int:
    """The CRC-32 of the file ``name`` of ``folder`` (a second read of every byte)."""
    crc = 0
    with folder.open_file(name) as f:
        while block := f.read(_CHUNK):
            crc = zlib.crc32(block, crc)
    return crc


def read_record(folder: Folder, file: str, offset: int, length: int, key: str) -> Any:
    """The ``torch.save`` record of ``key`` (a tensor, or a non-tensor entry of a DCP ``FileSystemWriter``
    checkpoint: numbers, strings, containers) at ``offset`` of the file ``file`` of ``folder``, loaded
    by the strict reader (``reader.load_bytes``) on the CPU.

    Raises:
        CheckpointError: the record asks for something the strict reader refuses, or the file ends
            before it.
    """
    with folder.open_file(file) as f:
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
