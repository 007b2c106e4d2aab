"""The strict reader: every pickled file nxd_smp reads (NxD's plain and xser folders and NxD Training's
state-dict tags, torch_xla's per-rank dicts, the loops' optimizer files, DCP indexes and records) is
read here and nowhere else; none of torch's own loaders is used.

A ``torch.save`` file (``load_file`` / ``load_bytes``) is a zip archive parsed once, by one
``zipfile.ZipFile``, which both checks it (no two records of one name, none compressed, overlapping
another or reaching past the file, one pickle) and builds its tensors: each storage a persistent id
names is its record ``data/<key>``, read once (CRC-checked) and holding exactly the bytes the pickle
claims, and the tensors rebuilt over them may total ``TENSOR_BYTES_PER_STORAGE_BYTE`` bytes a byte of
the archive's storages plus ``TENSOR_BYTES_FLOOR``. A DCP index (``load_pickle``) is a plain pickle.
Either pickle is read by the pickle machine of ``unpickler`` (what each kind admits, the calls a
pickle may make, the parse budgets, the tree check of the value); every refusal is a
``CheckpointError`` naming the file, where in it, and what it asked for.
"""

from __future__ import annotations

import collections
import ctypes
import io
import struct
import zipfile
import zlib
from typing import Any, Hashable

import torch

from ..core.errors import CheckpointError, UnsafeFileError
from .budget import Budget
from .room import Room
from .unpickler import (
    _MAX_INT64,
    XserReference,
    _dcp_globals,
    _Refused,
    _show,
    _state_dict_globals,
    _Storage,
    _StorageType,
    _unpickle,
)

_CHUNK = 1 << 24  # a storage's record is copied into its tensor this many bytes at a time
#: The bytes of all tensors rebuilt from an archive (each view counted whole), per byte of its
#: storages' records: a real state dict's views (tied weights, the slices of a fused weight saved
#: beside it) sum to one to three times its storages.
TENSOR_BYTES_PER_STORAGE_BYTE = 8
#: ...plus this many bytes whatever the storages: what a later copy of every tensor may cost.
TENSOR_BYTES_FLOOR = 64 << 20


# ---------------------------------------------------------------------------- the archive
class _Archive:
    """A ``torch.save`` zip archive, checked whole when opened; its storages then read through the
    same ``ZipFile``. ``storage_bytes``: the bytes of its storages' records (``data/...``)."""

    def __init__(self, file: Any, size: int, source: str):
        self.source = source
        self.zip = zipfile.ZipFile(file)
        records = self.zip.infolist()
        names = [r.filename for r in records]
        counts = collections.Counter(names)
        if len(counts) != len(names):
            raise self._refuse(f"holds two records named {_show(min(n for n, c in counts.items() if c > 1))}")
        spans = []
        for record in records:
            if record.compress_type != zipfile.ZIP_STORED or record.flag_bits & 1 or record.compress_size != record.file_size:
                raise self._refuse(f"holds the record {_show(record.filename)} compressed or encrypted")
            file.seek(record.header_offset)
            header = file.read(30)
            if len(header) != 30 or header[:4] != b"PK\x03\x04":
                raise self._refuse(f"has no local header for the record {_show(record.filename)}")
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            end = record.header_offset + 30 + name_length + extra_length + record.file_size
            if end > min(size, self.zip.start_dir):
                raise self._refuse(f"holds the record {_show(record.filename)}, which reaches past the file's records")
            spans.append((record.header_offset, end, record.filename))
        spans.sort()
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise self._refuse(f"holds the records {_show(first)} and {_show(second)}, which overlap")
        pickles = [n for n in names if n.endswith("data.pkl")]
        if len(pickles) != 1 or pickles[0].count("/") != 1:
            raise CheckpointError(f"{source} is not a torch.save archive (it holds {len(pickles)} data.pkl records).")
        self.prefix = pickles[0][: -len("data.pkl")]
        self.records = dict(zip(names, records))
        self.storage_bytes = sum(r.file_size for r in records if r.filename.startswith(f"{self.prefix}data/"))
        order = self.records.get(f"{self.prefix}byteorder")
        if order is not None and (order.file_size > 8 or self.zip.read(order) != b"little"):
            raise CheckpointError(f"{source} was written big-endian; nxd_smp reads little-endian files.")
        self.pickle = self.zip.read(self.records[pickles[0]])
        self.loaded: dict[str, _Storage] = {}

    def _refuse(self, what: str) -> UnsafeFileError:
        return UnsafeFileError(f"{self.source} {what}; torch.save writes no such archive. Refused.")

    def storage(self, pid: Any) -> _Storage:
        """The persistent id ``("storage", type, key, location, numel)``: the record ``data/<key>``,
        which must hold exactly ``numel`` elements of the type's dtype, read on the CPU."""
        if not (type(pid) is tuple and len(pid) == 5 and type(pid[0]) is str and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and type(pid[2]) is str and type(pid[3]) is str
                and type(pid[4]) is int and 0 <= pid[4] < _MAX_INT64):
            raise _Refused(f"holds the persistent reference {_show(pid)}, which is no torch.save storage")
        _, kind, key, _, numel = pid
        nbytes = numel * kind.dtype.itemsize
        found = self.loaded.get(key)
        if found is not None:
            if (found.dtype, found.nbytes) != (kind.dtype, nbytes):
                raise _Refused(f"refers to the storage data/{_show(key)} as {found.dtype} and as {kind.dtype}")
            return found
        record = self.records.get(f"{self.prefix}data/{key}")
        if record is None or record.file_size != nbytes:
            held = "no record" if record is None else f"a record of {record.file_size} bytes"
            raise _Refused(f"claims {nbytes} bytes ({numel} x {kind.name}) from data/{_show(key)}, which is {held}")
        return self.loaded.setdefault(key, _Storage(self._read(record), kind.dtype, nbytes))

    def _read(self, record: zipfile.ZipInfo) -> torch.UntypedStorage:
        """The record's bytes (CRC-checked by ``zipfile``) copied into a new CPU storage, a chunk
        at a time: no second copy of the whole record."""
        out = torch.empty(record.file_size, dtype=torch.uint8)
        if record.file_size:
            view = memoryview((ctypes.c_ubyte * record.file_size).from_address(out.data_ptr())).cast("B")
            with self.zip.open(record) as stream:
                done = 0
                while done < record.file_size:
                    chunk = stream.read(min(_CHUNK, record.file_size - done))
                    if not chunk:
                        raise CheckpointError(f"{self.source}: the record {record.filename!r} ends early.")
                    view[done:done + len(chunk)] = chunk
                    done += len(chunk)
                stream.read(1)  # at the end: zipfile compares the CRC-32
        return out.untyped_storage()


def _load_archive(file: Any, size: int, source: str, kind: str, checksums: list[int] | None = None) -> Any:
    if kind not in ("state_dict", "xser"):
        raise ValueError(f"a torch.save file is read as 'state_dict' or 'xser', not {kind!r}")
    allowed = _state_dict_globals()
    if kind == "xser":
        allowed = {**allowed, ("torch_xla.utils.serialization", "TensorReference"): XserReference}
    try:
        archive = _Archive(file, size, source)
        if checksums is not None:  # the zip's own CRC-32s of its records, in order: the file's checksum, free
            checksums.append(zlib.crc32(b"".join(r.CRC.to_bytes(4, "little") + r.file_size.to_bytes(8, "little")
                                                  for r in archive.records.values())))
        tensor_bytes = Budget.linear(archive.storage_bytes, source, per_byte=TENSOR_BYTES_PER_STORAGE_BYTE,
                                     floor=TENSOR_BYTES_FLOOR, counted="its storages",
                                     what="bytes of tensors (each view of a storage counted whole)")
        return _unpickle(archive.pickle, source, kind, allowed, archive.storage, tensor_bytes)
    except CheckpointError:
        raise
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{source} is not a readable torch.save zip archive (the format torch has written "
                              f"since 1.6; nxd_smp reads no other): {e}") from None
    except (OSError, ValueError, EOFError, struct.error, KeyError) as e:
        raise CheckpointError(f"{source} is a damaged archive: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------------------- entry points
def load_file(folder: Room, name: str, *, kind: str = "state_dict", checksums: list[int] | None = None,
              once: dict[Hashable, str] | None = None) -> Any:
    """The ``torch.save`` file ``name`` of ``folder`` (or, with ``kind="dcp_metadata"``, a DCP index) read
    on the CPU by the strict reader (see the module's docstring), without running code from it and
    without allocating more than it holds. The file is opened below ``folder`` without following a link,
    as a regular file, never blocking (``files.Folder.open_file``; in a bucket, an object read by ranged
    GETs). ``checksums``: a list the file's checksum is appended to (from the CRC-32s its zip records
    carry, which the read checks: what the ranks compare of a replicated file without reading it twice).
    ``once``: the files a load has read so far, by identity (device and inode; an object's key), which
    this one joins; one of them again (a file listed twice, or under a
    second name: a hard link) is refused, so that what a load builds is bounded by its files' bytes.

    Raises:
        CheckpointError: the file is a link, not a regular file, not a torch.save archive, holds anything
            the kind does not admit, or is one ``once`` holds; naming the file and what it asked for.
    """
    source = str(folder.where(name))
    with folder.open_file(name) as f:
        st = folder.opened_stat(f)
        size = st.size
        if once is not None:
            identity = st.identity
            if identity in once:
                raise CheckpointError(f"{source} is {once[identity]} again (one file listed twice, or under two names: "
                                      f"a hard link); each file of a checkpoint is its own record, read once. Refused.")
            once[identity] = source
        if kind == "dcp_metadata":
            data = f.read(size)
            if checksums is not None:
                checksums.append(zlib.crc32(data))
            return load_pickle(data, source, kind=kind)
        return _load_archive(f, size, source, kind, checksums)


def load_bytes(data: bytes | bytearray | memoryview, source: str, *, kind: str = "state_dict") -> Any:
    """``load_file`` for a ``torch.save`` record already read into memory (DCP's records)."""
    return _load_archive(io.BytesIO(data), len(data), source, kind)


def load_pickle(data: bytes, source: str, *, kind: str = "dcp_metadata") -> Any:
    """A plain pickle (no zip, no persistent ids) of the ``"dcp_metadata"`` kind: DCP's metadata classes
    and nothing else.

    Raises:
        UnsafeFileError: the pickle names anything else, or is too large as a tree; naming ``source``.
        CheckpointError: a damaged pickle.
    """
    if kind != "dcp_metadata":
        raise ValueError(f"a plain pickle is read as 'dcp_metadata', not {kind!r}")
    return _unpickle(bytes(data), source, kind, _dcp_globals())


def check_distinct(tensors: Any, source: str, what: str) -> None:
    """No two of ``tensors`` (``(field, tensor)`` pairs of one file, as the reader built them) reach one
    byte of a storage: the same tensor twice (pickle's memo, one xser tensor id), or views of one record
    that overlap. For state in which each entry is a tensor of its own (an optimizer's moments and
    masters): one record installed as two would be read once and allocated, joined and installed twice.
    Tensors of no bytes are left out. Linear in the tensors, and a sort.

    Raises:
        CheckpointError: naming ``source``, both fields and ``what`` should hold (a sentence).
    """
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for field, tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            continue
        itemsize = tensor.element_size()
        start = tensor.storage_offset() * itemsize
        end = start + (1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))) * itemsize
        spans.setdefault(tensor.untyped_storage().data_ptr(), []).append((start, end, field))
    for found in spans.values():
        pair = first_overlap(found)
        if pair is not None:
            raise CheckpointError(f"{source}: {pair[1]} is the record of {pair[0]} again (one tensor, or views of one "
                                  f"storage that overlap); {what}, each record used once. Refused.")


def first_overlap(spans: list[tuple[int, int, Any]]) -> tuple[Any, Any] | None:
    """The keys of the first two of ``spans`` (``(start, end, key)`` byte ranges of one file or storage)
    that overlap, in order; None where none do. Sorts ``spans`` in place: linear after the sort."""
    spans.sort(key=lambda span: span[:2])
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            return first, second
    return None
