"""The bytes of a checkpoint on disk: a ``torch.distributed.checkpoint`` storage writer and
reader that move tensors as raw bytes.

``RawStorageWriter`` writes every tensor a rank saves straight from its memory (a view of
a flat shard is written as it is: no clone, no per-tensor pickle) into a few large files
per rank (``__<rank>_<k>.bin``, one per writer thread), computing CRC-32 of each tensor and
of each file on the bytes while it writes them, then fsyncs. The coordinator writes DCP's
``.metadata``, whose storage data say where each tensor's bytes are (file, offset, length,
CRC-32).

``RawStorageReader`` reads each requested tensor straight into the destination buffer the
load planner gives it and checks the tensor's CRC-32 on those bytes (``verify=True``).

Everything else (plans, resharding by name and offset, the coordinator) is DCP's own.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import (
    LoadPlan,
    LoadPlanner,
    Metadata,
    SavePlan,
    SavePlanner,
    StorageReader,
    StorageWriter,
)
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

__all__ = ["RawItem", "RawStorageWriter", "RawStorageReader", "ChecksumError", "METADATA_FILE"]

METADATA_FILE = ".metadata"
_CHUNK = 64 << 20  # bytes per write/read call: large, and the GIL is released for each


class ChecksumError(ValueError):
    """The bytes read back are not the bytes written (CRC-32 mismatch)."""


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


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


@dataclass
class _Prefix:
    prefix: str


class RawStorageWriter(StorageWriter):
    """Writes a rank's tensors as raw bytes into ``threads`` files in ``path``.

    After ``dcp.save`` returns, ``files`` maps each file this rank wrote to ``(size,
    crc32)``, for the caller's completion record.
    """

    def __init__(self, path: str | os.PathLike, *, threads: int = 2, sync_files: bool = True):
        super().__init__()
        self.path = Path(path)
        self.threads = max(1, int(threads))
        self.sync_files = sync_files
        self.files: dict[str, tuple[int, int]] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.files = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=_Prefix(f"__{rank}_")) for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        groups: list[list[WriteItem]] = [[] for _ in range(self.threads)]
        sizes = [0] * self.threads
        for item in sorted(plan.items, key=_item_bytes, reverse=True):  # balance the files
            k = sizes.index(min(sizes))
            groups[k].append(item)
            sizes[k] += _item_bytes(item)
        jobs = [(f"{prefix}{k}.bin", items) for k, items in enumerate(groups) if items]
        lock = threading.Lock()

        def write_file(name: str, items: list[WriteItem]) -> list[WriteResult]:
            results, offset, file_crc = [], 0, 0
            with open(self.path / name, "wb", buffering=0) as f:
                for item in items:
                    data = planner.resolve_data(item)
                    if item.type == WriteItemType.BYTE_IO:
                        raise TypeError(f"{item.index.fqn}: nxd_smp checkpoints hold tensors only.")
                    tensor = data.detach()
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
                    info = RawItem(name, offset, len(view), crc, tensor.dtype, tuple(tensor.shape))
                    results.append(WriteResult(index=item.index, size_in_bytes=len(view), storage_data=info))
                    offset += len(view)
                if self.sync_files:
                    os.fsync(f.fileno())
            with lock:
                self.files[name] = (offset, file_crc)
            return results

        if len(jobs) == 1:
            results = write_file(*jobs[0])
        else:
            with ThreadPoolExecutor(len(jobs)) as pool:
                results = [r for part in pool.map(lambda job: write_file(*job), jobs) for r in part]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for part in results for r in part}
        with open(self.path / METADATA_FILE, "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path))


def _item_bytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    n = 1
    for d in item.tensor_data.size:
        n *= d
    return n * item.tensor_data.properties.dtype.itemsize


class RawStorageReader(StorageReader):
    """Reads raw-byte tensors straight into the load planner's destination buffers,
    checking each one's CRC-32 when ``verify``. Raises ``ChecksumError`` naming the tensor
    and the file on a mismatch."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = True, threads: int = 2):
        super().__init__()
        self.path = Path(path)
        self.verify = verify
        self.threads = max(1, int(threads))
        self.storage_data: dict[MetadataIndex, RawItem] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(self.path / METADATA_FILE, "rb") as f:
            metadata = pickle.load(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)

        def read_file(name: str, items: Sequence[ReadItem]) -> None:
            with open(self.path / name, "rb", buffering=0) as f:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    info = self.storage_data[item.storage_index]
                    target = planner.resolve_tensor(item).detach()
                    whole = tuple(item.lengths) == info.shape and not any(item.storage_offsets)
                    if whole and target.is_contiguous() and target.device.type == "cpu" and target.dtype == info.dtype:
                        self._read_into(f, info, target, item)
                    else:
                        source = torch.empty(info.shape, dtype=info.dtype)
                        self._read_into(f, info, source, item)
                        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                            source = source.narrow(dim, start, length)
                        target.copy_(source)
                    planner.commit_tensor(item, target)

        jobs = list(per_file.items())
        if len(jobs) <= 1 or self.threads == 1:
            for job in jobs:
                read_file(*job)
        else:
            with ThreadPoolExecutor(min(self.threads, len(jobs))) as pool:
                list(pool.map(lambda job: read_file(*job), jobs))
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_into(self, f, info: RawItem, tensor: torch.Tensor, item: ReadItem) -> None:
        view = _byte_view(tensor)
        if len(view) != info.length:
            raise ChecksumError(
                f"{item.storage_index.fqn}: {info.length} bytes in {info.file}, the destination holds {len(view)}."
            )
        f.seek(info.offset)
        crc, done = 0, 0
        while done < len(view):
            n = f.readinto(view[done : done + _CHUNK])
            if not n:
                raise ChecksumError(f"{item.storage_index.fqn}: {info.file} ends before its bytes (truncated).")
            if self.verify:
                crc = zlib.crc32(view[done : done + n], crc)
            done += n
        if self.verify and crc != info.crc32:
            raise ChecksumError(f"{item.storage_index.fqn} in {info.file} is corrupted (CRC-32 mismatch).")
