"""The strict reader: every pickled file nxd_smp reads (NxD's plain and xser folders, torch_xla's
per-rank dicts, the loops' optimizer files, nxd_smp's formats 1 and 2, DCP indexes) is unpickled
here and nowhere else; none of torch's own loaders is used.

A ``torch.save`` file (``load_file`` / ``load_bytes``) is a zip archive parsed once, by one
``zipfile.ZipFile``, which both checks it (no two records of one name, none compressed, overlapping
another or reaching past the file, one pickle) and builds its tensors. Its pickle is read by
``_Unpickler``, which admits what one kind of file holds (``KINDS``) and nothing else: not what
``torch.serialization.add_safe_globals`` allows (what a class of a user's own runs is not ours to
vouch for):

- ``"state_dict"``: dicts, lists, tuples, sets, ``OrderedDict`` (with the ``_metadata`` module state
  dicts carry), numbers, strings, bytes, ``torch.Size``, dtypes, and dense CPU tensors and
  ``nn.Parameter``s (an XLA tensor's rebuild read as its CPU tensor) over storages whose record holds
  exactly the bytes the pickle claims, each tensor inside its storage and not overlapping itself;
- ``"xser"``: that, plus torch_xla's ``TensorReference``, read as an ``XserReference`` (its id);
- ``"dcp_metadata"`` (``load_pickle``): a plain pickle without persistent ids, of the classes
  ``torch.distributed.checkpoint`` writes into its ``.metadata`` and the classes the caller names.

No call allocates by a number the file gives (``bytearray(n)``, ``torch.Tensor(n)``, a storage
class), so a load allocates no more than the file holds. The value is then measured as a tree (a
container reached twice counts twice): more than four nodes per byte of pickle (a few bytes of
shared references can stand for 2**30, which a deepcopy or JSON dump would make), a cycle, or
nesting deeper than ``MAX_DEPTH`` is refused. Every refusal is a ``CheckpointError`` naming the file,
where in it, and what it asked for.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import io
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from typing import Any

import torch

from ..core.errors import CheckpointError
from .paths import inside, open_regular
from .typed_json import DTYPES
from .values import check_tree

KINDS = ("state_dict", "xser", "dcp_metadata")
MAX_DEPTH = 64
_NODES_PER_BYTE = 4
_MIN_NODES = 10_000
_CHUNK = 1 << 24  # a storage's record is copied into its tensor this many bytes at a time


class UnsafeFileError(CheckpointError):
    """A file asks to build an object that loading must not build (it could run code or allocate
    more than the file holds)."""


class XserReference:
    """torch_xla's ``torch_xla.utils.serialization.TensorReference`` as the ``"xser"`` kind reads
    it: only ``tid``, the id of the tensor file (``<name>.pt.tensors/tensor_<tid>.pt``)."""

    tid: int = -1  # until the file's state sets it (checked there: an integer in [0, 2**62))


class _Refused(Exception):
    """What a file asked for that the reader does not build; the loader names the file."""


# ---------------------------------------------------------------------------- what a pickle may name
@dataclasses.dataclass(frozen=True)
class _StorageType:
    """A storage class a persistent id names (``torch.FloatStorage``, ``torch.UntypedStorage``):
    only its dtype, so that no storage class ever reaches the pickle's stack to be called."""

    name: str
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class _Storage:
    """One record's bytes, as the pickle's persistent id claimed them."""

    untyped: torch.UntypedStorage
    dtype: torch.dtype  # torch.uint8 for an untyped storage
    nbytes: int


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is not tuple or not all(type(v) is int and v >= 0 for v in value):
        raise _Refused(f"asks for a tensor whose {what} is {value!r}, not a tuple of non-negative integers")
    return value


def _overlaps_itself(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether two indices of a tensor of these sizes and strides reach one element (an expanded,
    stride-0 tensor does): copying it then allocates more than its storage holds."""
    reach = 0
    for stride, size in sorted((st, sz) for st, sz in zip(strides, sizes) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _hooks(backward_hooks: Any) -> None:
    if type(backward_hooks) is not OrderedDict or backward_hooks or vars(backward_hooks):
        raise _Refused("asks for a tensor with backward hooks (torch.save writes none)")


def _tensor(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, backward_hooks: Any,
            dtype: torch.dtype, metadata: Any) -> torch.Tensor:
    """A dense CPU tensor viewing ``storage``, checked: inside it and not overlapping itself."""
    if not isinstance(storage, _Storage) or type(offset) is not int or offset < 0 or type(requires_grad) is not bool:
        raise _Refused(f"asks for a tensor of {type(storage).__name__} at offset {offset!r}")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride) or _overlaps_itself(size, stride):
        raise _Refused(f"asks for an expanded tensor of size {size} and strides {stride} (elements shared: "
                       f"more than its storage holds when copied)")
    end = 0 if 0 in size else offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))
    if max(end, offset) * dtype.itemsize > storage.nbytes:
        raise _Refused(f"asks for a tensor of size {size}, strides {stride} at offset {offset} in a storage of "
                       f"{storage.nbytes} bytes, past its end")
    _hooks(backward_hooks)
    if metadata is not None and (type(metadata) is not dict or not set(metadata) <= {"conj", "neg"}
                                 or not all(type(v) is bool for v in metadata.values())):
        raise _Refused(f"asks for a tensor with the metadata {metadata!r}")
    tensor = torch.empty((0,), dtype=dtype).set_(storage.untyped, offset, size, stride)
    if metadata:
        torch._utils.set_tensor_metadata(tensor, metadata)
    return tensor.requires_grad_(requires_grad)


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, backward_hooks, metadata=None):
    """``torch._utils._rebuild_tensor_v2``, checked: a tensor of its typed storage's dtype."""
    dtype = storage.dtype if isinstance(storage, _Storage) else torch.uint8
    return _tensor(storage, offset, size, stride, requires_grad, backward_hooks, dtype, metadata)


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    """``torch._utils._rebuild_tensor_v3``, checked: the dtypes without a typed storage (float8,
    uint16...) over an untyped one."""
    if not isinstance(storage, _Storage) or storage.dtype != torch.uint8 or dtype not in torch.storage._new_dtypes():
        raise _Refused(f"asks for a {dtype!r} tensor over a typed storage")
    return _tensor(storage, offset, size, stride, requires_grad, backward_hooks, dtype, metadata)


def _rebuild_parameter(data, requires_grad, backward_hooks):
    """``torch._utils._rebuild_parameter`` (``nn.Parameter``), checked: over a tensor rebuilt here."""
    if type(data) is not torch.Tensor or type(requires_grad) is not bool:
        raise _Refused(f"asks for a parameter of {type(data).__name__}")
    _hooks(backward_hooks)
    return torch.nn.Parameter(data, requires_grad)


def _rebuild_device_tensor_from_cpu_tensor(data, dtype, device, requires_grad):
    """``torch._utils._rebuild_device_tensor_from_cpu_tensor``, which ``torch.save`` writes for an
    XLA tensor (torch_xla's optimizer state saved as it is), read on the CPU: ``data`` itself, a
    tensor rebuilt here (checked, so never the expanded view torch would copy to the device), of
    the dtype named; nothing is copied or converted."""
    if type(data) is not torch.Tensor or data.dtype != dtype or type(device) is not str or type(requires_grad) is not bool:
        raise _Refused(f"asks for a device tensor of {type(data).__name__} as {dtype!r}")
    return data.requires_grad_(requires_grad)


def _module_versions(metadata: Any) -> Any:
    """A module state dict's ``_metadata``, checked as ``torch.save`` writes it and ``load_state_dict``
    reads it: a dict of module prefixes, each a dict of string keys to plain values, ``version`` an
    integer (anything else fails inside ``load_state_dict``, after the ranks agreed)."""
    plain = (type(None), bool, int, float, str)
    if type(metadata) not in (dict, OrderedDict) or not all(
            type(prefix) is str and type(entry) is dict and all(type(k) is str and type(v) in plain for k, v in entry.items())
            and type(entry.get("version", 0)) is int for prefix, entry in metadata.items()):
        raise _Refused("holds a state dict's _metadata that is not {module: {'version': int, ...}}")
    return metadata


def _latin1(text, encoding):
    """``_codecs.encode``, which protocol 2 pickles bytes as: ``encode(str, "latin1")`` only."""
    if type(text) is not str or encoding != "latin1":
        raise _Refused(f"asks for _codecs.encode({type(text).__name__}, {encoding!r})")
    return text.encode("latin1")


@functools.cache
def _state_dict_globals() -> dict[tuple[str, str], Any]:
    """What a ``torch.save`` state dict names: its rebuild functions, containers and dtypes."""
    allowed: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"): _rebuild_device_tensor_from_cpu_tensor,
        ("collections", "OrderedDict"): OrderedDict,
        ("torch", "Size"): torch.Size,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("_codecs", "encode"): _latin1,
        ("torch", "UntypedStorage"): _StorageType("UntypedStorage", torch.uint8),
        ("torch.storage", "UntypedStorage"): _StorageType("UntypedStorage", torch.uint8),
    }
    for dtype, name in torch.storage._dtype_to_storage_type_map().items():
        if not name.startswith("Q"):  # (no quantized tensor is rebuilt)
            allowed[("torch", name)] = _StorageType(name, dtype)
    allowed.update({("torch", name): dtype for name, dtype in DTYPES.items()})
    return allowed


@functools.cache
def _dcp_globals() -> dict[tuple[str, str], Any]:
    """What a DCP ``.metadata`` names, besides nxd_smp's own classes the caller passes."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata
    from torch.serialization import _get_layout

    allowed = {("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
               for name in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                            "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING", "BytesStorageMetadata")}
    allowed.update({
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,  # format 1, native
        ("torch.serialization", "_get_layout"): _get_layout,  # a layout by its name
        ("pathlib", "PosixPath"): pathlib.PosixPath,  # StorageMeta.checkpoint_id
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("collections", "OrderedDict"): OrderedDict,
        ("torch", "Size"): torch.Size,
    })
    allowed.update({key: value for key, value in _state_dict_globals().items() if isinstance(value, torch.dtype)})
    return allowed


# ---------------------------------------------------------------------------- the unpickler
def _refuse_opcode(name: str):
    def refuse(self: _Unpickler) -> None:
        raise _Refused(f"uses the pickle opcode {name}, which no file nxd_smp reads holds")
    return refuse


class _Unpickler(pickle._Unpickler):
    """Python's own unpickler (its memo a dict: the C one sizes its memo by an index the file gives,
    so nine bytes can allocate a gigabyte), admitting one kind's globals, calling only its functions
    and classes (``REDUCE``, ``NEWOBJ``), and setting state (``BUILD``) only as that kind's files do."""

    dispatch = dict(pickle._Unpickler.dispatch)
    for _name in ("INST", "OBJ", "EXT1", "EXT2", "EXT4", "PERSID", "NEWOBJ_EX", "NEXT_BUFFER", "READONLY_BUFFER",
                  "BYTEARRAY8"):
        dispatch[getattr(pickle, _name)[0]] = _refuse_opcode(_name)

    def __init__(self, data: bytes, kind: str, allowed: dict[tuple[str, str], Any], storage: Any = None):
        super().__init__(io.BytesIO(data))
        self._kind, self._allowed, self._storage = kind, allowed, storage
        self._calls = {id(v) for v in allowed.values() if callable(v) and not isinstance(v, _StorageType)}
        self._fields = {id(v): {f.name for f in dataclasses.fields(v)} for v in allowed.values()
                        if isinstance(v, type) and dataclasses.is_dataclass(v)}

    def where(self) -> str:
        """Where in the value the pickle stopped, as the keys being filled (the last string of
        each open frame, outermost first): ``" at state/exp_avg"``, or nothing at the top."""
        keys = [next((x for x in reversed(frame) if type(x) is str), None)
                for frame in [*getattr(self, "metastack", []), getattr(self, "stack", [])]]
        keys = [k[:80] for k in keys if k is not None]
        return f" at {'/'.join(keys)}" if keys else ""

    def find_class(self, module: str, name: str) -> Any:
        module = "builtins" if module == "__builtin__" else module
        found = self._allowed.get((module, name))
        if found is None:
            raise UnsafeFileError(f"asks for {module}.{name}, which a {self._kind} file does not hold; refused "
                                  f"(loading it could run code). nxd_smp's reader admits plain containers, numbers, "
                                  f"strings and tensors, and does not extend that by "
                                  f"torch.serialization.add_safe_globals.")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if self._storage is None:
            raise _Refused("holds a persistent reference, which a plain pickle does not")
        return self._storage(pid)

    def _call(self, func: Any, what: str) -> None:
        if id(func) not in self._calls:
            name = f"torch.{func.name}" if isinstance(func, _StorageType) else getattr(func, "__name__", repr(func)[:80])
            raise _Refused(f"asks to {what} {name}(...), which it may not (it could allocate what the file names)")

    def load_reduce(self) -> None:
        self._call(self.stack[-2], "call")
        super().load_reduce()

    def load_newobj(self) -> None:
        self._call(self.stack[-2], "construct")
        super().load_newobj()

    def _into(self, target: Any, kinds: tuple[type, ...], op: str) -> None:
        """The container opcodes call ``append``, ``add`` or ``__setitem__`` on whatever is below
        their items: only on a container of exactly these kinds (on a tensor, ``add`` broadcasts and
        ``__setitem__`` can too, allocating what the file never held)."""
        if type(target) not in kinds:
            raise _Refused(f"uses {op} on a {type(target).__name__}, which only a container takes")

    def load_append(self) -> None:
        self._into(self.stack[-2], (list,), "APPEND")
        super().load_append()

    def load_appends(self) -> None:
        self._into(self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None, (list,), "APPENDS")
        super().load_appends()

    def load_setitem(self) -> None:
        self._into(self.stack[-3], (dict, OrderedDict), "SETITEM")
        super().load_setitem()

    def load_setitems(self) -> None:
        self._into(self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None, (dict, OrderedDict),
                   "SETITEMS")
        super().load_setitems()

    def load_additems(self) -> None:
        self._into(self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None, (set,), "ADDITEMS")
        super().load_additems()

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if type(inst) is OrderedDict and type(state) is dict and set(state) == {"_metadata"}:
            inst._metadata = _module_versions(state["_metadata"])  # a module state dict's versions, by module
        elif type(inst) is XserReference and type(state) is dict and set(state) == {"tid"}:
            tid = state["tid"]
            if type(tid) is not int or not 0 <= tid < 1 << 62:
                raise _Refused(f"holds a tensor reference whose id is {tid!r}")
            inst.tid = tid
        elif id(type(inst)) in self._fields and (set(state) <= self._fields[id(type(inst))] if type(state) is dict
                                                 else "__setstate__" in vars(type(inst))):
            return super().load_build()  # a DCP dataclass: its own fields, or its own __setstate__
        else:
            raise _Refused(f"asks to set the state of a {type(inst).__name__}, which it may not")
        self.stack.pop()

    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.ADDITEMS[0]] = load_additems
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.BUILD[0]] = load_build


def _unpickle(data: bytes, source: str, kind: str, allowed: dict, storage: Any = None) -> Any:
    """``data`` unpickled by ``_Unpickler`` and measured (``values.check_tree``); every failure a
    ``CheckpointError`` naming ``source`` and where in the value the pickle was."""
    unpickler = _Unpickler(data, kind, allowed, storage)
    try:
        value = unpickler.load()
    except (UnsafeFileError, _Refused) as e:
        raise UnsafeFileError(f"{source}{unpickler.where()} {e}{'' if isinstance(e, UnsafeFileError) else '; refused.'}"
                              ) from None
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any way a damaged pickle fails
        raise CheckpointError(f"{source}{unpickler.where()} cannot be read (damaged): {type(e).__name__}: {e}") from None
    check_tree(value, source, max(_NODES_PER_BYTE * len(data), _MIN_NODES), MAX_DEPTH)
    return value


# ---------------------------------------------------------------------------- the archive
class _Archive:
    """A ``torch.save`` zip archive, checked whole when opened; its storages then read through the
    same ``ZipFile``."""

    def __init__(self, file: Any, size: int, source: str):
        self.source = source
        self.zip = zipfile.ZipFile(file)
        records = self.zip.infolist()
        names = [r.filename for r in records]
        if len(set(names)) != len(names):
            raise self._refuse(f"holds two records named {sorted(n for n in names if names.count(n) > 1)[0]!r}")
        spans = []
        for record in records:
            if record.compress_type != zipfile.ZIP_STORED or record.flag_bits & 1 or record.compress_size != record.file_size:
                raise self._refuse(f"holds the record {record.filename!r} compressed or encrypted")
            file.seek(record.header_offset)
            header = file.read(30)
            if len(header) != 30 or header[:4] != b"PK\x03\x04":
                raise self._refuse(f"has no local header for the record {record.filename!r}")
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            end = record.header_offset + 30 + name_length + extra_length + record.file_size
            if end > min(size, self.zip.start_dir):
                raise self._refuse(f"holds the record {record.filename!r}, which reaches past the file's records")
            spans.append((record.header_offset, end, record.filename))
        spans.sort()
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise self._refuse(f"holds the records {first!r} and {second!r}, which overlap")
        pickles = [n for n in names if n.endswith("data.pkl")]
        if len(pickles) != 1 or pickles[0].count("/") != 1:
            raise CheckpointError(f"{source} is not a torch.save archive (it holds {len(pickles)} data.pkl records).")
        self.prefix = pickles[0][: -len("data.pkl")]
        self.records = dict(zip(names, records))
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
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and type(pid[2]) is str and type(pid[3]) is str and type(pid[4]) is int and pid[4] >= 0):
            raise _Refused(f"holds the persistent reference {str(pid)[:200]}, which is no torch.save storage")
        _, kind, key, _, numel = pid
        nbytes = numel * kind.dtype.itemsize
        found = self.loaded.get(key)
        if found is not None:
            if (found.dtype, found.nbytes) != (kind.dtype, nbytes):
                raise _Refused(f"refers to the storage data/{key} as {found.dtype} and as {kind.dtype}")
            return found
        record = self.records.get(f"{self.prefix}data/{key}")
        if record is None or record.file_size != nbytes:
            held = "no record" if record is None else f"a record of {record.file_size} bytes"
            raise _Refused(f"claims {nbytes} bytes ({numel} x {kind.name}) from data/{key}, which is {held}")
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


def _load_archive(file: Any, size: int, source: str, kind: str) -> Any:
    if kind not in ("state_dict", "xser"):
        raise ValueError(f"a torch.save file is read as 'state_dict' or 'xser', not {kind!r}")
    allowed = _state_dict_globals()
    if kind == "xser":
        allowed = {**allowed, ("torch_xla.utils.serialization", "TensorReference"): XserReference}
    try:
        archive = _Archive(file, size, source)
        return _unpickle(archive.pickle, source, kind, allowed, archive.storage)
    except CheckpointError:
        raise
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{source} is not a readable torch.save zip archive (the format torch has written "
                              f"since 1.6; nxd_smp reads no other): {e}") from None
    except (OSError, ValueError, EOFError, struct.error, KeyError) as e:
        raise CheckpointError(f"{source} is a damaged archive: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------------------- entry points
def load_file(path: str | os.PathLike, *, folder: str | os.PathLike | None = None, name: Any = None,
              kind: str = "state_dict") -> Any:
    """A ``torch.save`` file (or, with ``kind="dcp_metadata"``, a DCP index) read on the CPU by the
    strict reader (see the module's docstring), without running code from it and without allocating
    more than it holds. With ``folder`` and ``name``: the file ``name`` inside the checkpoint
    ``folder`` (``inside``); else ``path`` itself, which must be a regular file.

    Raises:
        CheckpointError: the file is outside the folder, not a regular file, not a torch.save archive,
            or holds anything the kind does not admit; naming the file and what it asked for.
    """
    if folder is not None:
        path = inside(folder, name, source=str(path))
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if kind == "dcp_metadata":
            return load_pickle(f.read(size), str(path), kind=kind)
        return _load_archive(f, size, str(path), kind)


def load_bytes(data: bytes | bytearray | memoryview, source: str, *, kind: str = "state_dict") -> Any:
    """``load_file`` for a ``torch.save`` record already read into memory (DCP's records)."""
    return _load_archive(io.BytesIO(data), len(data), source, kind)


def load_pickle(data: bytes, source: str, *, kind: str = "dcp_metadata", own: tuple[type, ...] = ()) -> Any:
    """A plain pickle (no zip, no persistent ids) of the ``"dcp_metadata"`` kind: DCP's metadata
    classes and ``own``, nxd_smp's classes admitted by their pickled name (``dcp_index`` passes its
    ``RawItem``: this module cannot import the module that imports it).

    Raises:
        UnsafeFileError: the pickle names anything else, or is too large as a tree; naming ``source``.
        CheckpointError: a damaged pickle.
    """
    if kind != "dcp_metadata":
        raise ValueError(f"a plain pickle is read as 'dcp_metadata', not {kind!r}")
    allowed = {**_dcp_globals(), **{(cls.__module__, cls.__qualname__): cls for cls in own}}
    return _unpickle(bytes(data), source, kind, allowed)

