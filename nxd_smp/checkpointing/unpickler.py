"""The strict reader's pickle machine: ``_Unpickler``, which reads a pickle (a ``torch.save``
archive's, handed over by ``reader``, or a DCP index's plain one) admitting what one kind of file
holds (``KINDS``) and nothing else: not what ``torch.serialization.add_safe_globals`` allows (what a
class of a user's own runs is not ours to vouch for):

- ``"state_dict"``: dicts, lists, tuples, sets, ``OrderedDict`` (with the ``_metadata`` module state
  dicts carry), numbers, strings, bytes, ``torch.Size``, dtypes, and dense CPU tensors and
  ``nn.Parameter``s (an XLA tensor's rebuild read as its CPU tensor) over storages whose record holds
  exactly the bytes the pickle claims, each tensor inside its storage and not overlapping itself;
- ``"xser"``: that, plus torch_xla's ``TensorReference``, read as an ``XserReference`` (its id);
- ``"dcp_metadata"`` (``load_pickle``): a plain pickle without persistent ids, of the classes
  ``torch.distributed.checkpoint`` writes into its ``.metadata`` and the classes the caller names.

A pickle may call only this module's own checked functions (``REDUCE``), construct only those
classes, without arguments (``NEWOBJ``, as ``pickle`` writes a dataclass), and set state (``BUILD``)
only as those files do. No call allocates by a number the file gives (``bytearray(n)``,
``torch.Tensor(n)``, a storage class).

What the parse spends is bounded while it runs, not measured after (``budget.Budget``):

- memory and work, linear in the pickle's size (``PARSE_BUDGET_PER_BYTE`` units a byte plus
  ``PARSE_BUDGET_FLOOR``): every opcode is charged what it allocates (a container, an item put into
  one, a string or bytes by length, a memo entry, a tensor), and what a call copies is charged by
  its length before it copies (``set``, ``frozenset``, ``OrderedDict``, ``torch.Size``,
  ``_codecs.encode`` or a DCP index's ``PosixPath`` of a memoised list or string: five or six bytes
  of pickle each);
- the bytes of the tensors rebuilt, each view of a storage counted whole, linear in the bytes of the
  archive's storages (``reader.TENSOR_BYTES_PER_STORAGE_BYTE`` plus ``reader.TENSOR_BYTES_FLOOR``,
  the budget ``tensor_bytes`` the reader passes): tied weights and slices are views of one storage,
  thousands of whole views are not a checkpoint;
- a key put into a dict or an item into a set is checked before it is hashed (``_Unpickler.key``):
  a string, bytes, a bool, None, a dtype or an integer of magnitude below 2**61 - 1, whose hashes a
  file cannot make collide; a float or a DCP index's ``MetadataIndex`` (a name and a ``torch.Size``
  of offsets, a tuple whose hash a file can choose), at most ``MAX_EQUAL_HASHES`` of one hash in one
  container; nothing else (a tuple, a ``torch.Size``, a larger integer): a dict or set of n keys of
  one hash takes time in n**2 to build, and ``hash`` of a tuple of shared tuples walks all of them.
- a value in a message is written short (``_show``): ``repr`` of shared tuples is exponential too.

The first overrun or refusal stops the parse. The value is then measured as a tree (a container
reached twice counts twice; ``check_tree``): more than four nodes per byte of pickle (a few
bytes of shared references can stand for 2**30, which a deepcopy or JSON dump would make), a cycle,
or nesting deeper than ``MAX_DEPTH`` is refused. Every refusal is a ``CheckpointError`` naming the
file, where in it, and what it asked for.

What real files use of the budgets (torch 2.9, CPython 3.11; parse units a byte of pickle, of the
80 allowed; bytes of tensors rebuilt a byte of storage, of the 8 allowed), measured on files
``torch.save`` and ``dcp.save`` wrote:

====================================================  ========  ==========  ==============
file                                                  pickle    units/byte  tensor/storage
====================================================  ========  ==========  ==============
GPT-2 (6 layers) ``state_dict()``, tied ``lm_head``   12 KB     20.5        1.21
Llama (8 layers, tied embeddings) ``state_dict()``    14 KB     18.7        1.18
``nn.Transformer`` ``state_dict()``                   14 KB     20.2        1.00
50 ``Linear(64, 64)`` ``state_dict()``                10 KB     28.4        1.00
Llama AdamW ``state_dict()`` after 2 steps            17 KB     31.7        1.00
{model, AdamW, OneCycleLR} of that Llama              34 KB     24.4        1.06
SGD (momentum) and StepLR states                      9 KB      32.6        1.00
AdamW and SequentialLR states                         23 KB     31.6        1.00
AdamW of 2,000 parameters (0-dim steps)               448 KB    31.3        1.00
NxD ZeRO-1 optimizer file (int keys, sizes)           24 KB     31.2        1.00
a fused qkv weight, its 3 slices, a tied copy         0.4 KB    29.9        2.00
DCP ``.metadata`` of that Llama and its AdamW         73 KB     31.4
DCP ``Metadata`` of 32 ranks' 6,400 chunks            1.0 MB    32.0
====================================================  ========  ==========  ==============

(A pickle of nothing but empty containers uses more: ``torch.save`` of 20,000 empty dicts 56 a
byte, of empty lists 34; ``pickle.dumps`` of empty dicts, memoised by one byte each, 168, and is
refused. No checkpoint is that.)
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pathlib
import pickle
import reprlib
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..core.errors import BudgetError, CheckpointError, UnsafeFileError
from .budget import Budget
from .typed_json import DTYPES

KINDS = ("state_dict", "xser", "dcp_metadata")
MAX_DEPTH = 64
_NODES_PER_BYTE = 4
_MIN_NODES = 10_000

#: The parse budget, in units of about a byte of memory allocated (a step of work that allocates
#: nothing, as hashing a key or passing an argument, is ``_STEP`` units), per byte of pickle: what
#: torch and DCP write uses 19 to 34 (the module's table), a flood of one-byte empty containers 96 to
#: 232, a memoised list copied by five bytes tens of thousands.
PARSE_BUDGET_PER_BYTE = 80
#: What the parse of any pickle may use, however small (a pickle of one tensor uses about 2,000).
PARSE_BUDGET_FLOOR = 1 << 20
_STEP = 8
#: At most this many keys of one hash in one dict or set (floats, a DCP ``MetadataIndex``): a
#: chance collision of two 64-bit hashes never reaches it, a crafted run of them would be quadratic.
MAX_EQUAL_HASHES = 8
_HASH_MODULUS = sys.hash_info.modulus  # 2**61 - 1: an int's hash is itself modulo this
_MAX_INT64 = 1 << 63

# What an opcode allocates before it runs, in bytes (CPython 3.11, 64-bit), each with its stack
# slot (8): a container as it is once it holds its first item (a list of four slots, a dict or set
# of its first table: an empty one is less, and a file of a million empty ones is no checkpoint;
# ``MARK`` makes the list its items are pushed onto), a tuple of its items, an int object, a
# float, a memo entry (the dict's slot and its int key). Items added are charged by the opcodes that
# add them (``_Unpickler``), strings, bytes and long integers by their size once read.
_COSTS = {op[0]: cost for op, cost in {
    pickle.MARK: 96, pickle.EMPTY_LIST: 96, pickle.EMPTY_DICT: 232, pickle.EMPTY_SET: 224,
    pickle.TUPLE1: 56, pickle.TUPLE2: 64, pickle.TUPLE3: 72, pickle.BININT: 40, pickle.BININT2: 40,
    pickle.BINFLOAT: 32, pickle.BINPUT: 96, pickle.LONG_BINPUT: 96, pickle.PUT: 96, pickle.MEMOIZE: 96,
    pickle.NEWOBJ: 64, pickle.BUILD: 64, pickle.BINPERSID: 256,
}.items()}
_MEASURED = {op[0] for op in (pickle.BINUNICODE, pickle.SHORT_BINUNICODE, pickle.BINUNICODE8, pickle.UNICODE,
                              pickle.STRING, pickle.BINSTRING, pickle.SHORT_BINSTRING, pickle.BINBYTES,
                              pickle.SHORT_BINBYTES, pickle.BINBYTES8, pickle.LONG, pickle.LONG1, pickle.LONG4,
                              pickle.INT, pickle.FLOAT)}
_DICT_ITEM, _SET_ITEM, _LIST_ITEM = 48, 64, 8  # a set keeps its table at most half full, and grows it 4x
_TENSOR, _PARAMETER = 400, 600  # a tensor's (a parameter's) Python object and TensorImpl: measured 330 (540)


class XserReference:
    """torch_xla's ``torch_xla.utils.serialization.TensorReference`` as the ``"xser"`` kind reads
    it: only ``tid``, the id of the tensor file (``<name>.pt.tensors/tensor_<tid>.pt``)."""

    tid: int = -1  # until the file's state sets it (checked there: an integer in [0, 2**62))


class _Refused(Exception):
    """What a file asked for that the reader does not build; the loader names the file."""


class _Short(reprlib.Repr):
    """A file's value in a message: a few items of a few levels (a value of shared references can
    stand for 2**60 items, which ``repr`` would write out), no integer of more than 128 bits (whose
    decimal form is quadratic to write), anything but plain values by its type."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, 60, 60
        self.maxtuple = self.maxlist = self.maxdict = self.maxset = self.maxfrozenset = 4

    def repr_int(self, x: int, level: int) -> str:
        return repr(x) if x.bit_length() <= 128 else f"<an integer of {x.bit_length()} bits>"

    def repr_instance(self, x: Any, level: int) -> str:
        if isinstance(x, _StorageType):
            return f"torch.{x.name}"
        if isinstance(x, _Call):
            return x.name
        if isinstance(x, (torch.dtype, bool, float, type(None))):
            return repr(x)
        if isinstance(x, type):
            return x.__qualname__
        if isinstance(x, bytes):
            return repr(x[:self.maxstring]) + ("..." if len(x) > self.maxstring else "")
        if isinstance(x, torch.Size):
            return f"torch.Size({self.repr_tuple(tuple(x[:self.maxtuple + 1]), level)})"
        if isinstance(x, torch.Tensor):
            return f"<{type(x).__name__} of {x.dtype} and size {tuple(x.shape)[:8]}>"
        return f"<{type(x).__name__}>"


_show = _Short().repr


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

    untyped: torch.UntypedStorage = dataclasses.field(repr=False)
    dtype: torch.dtype  # torch.uint8 for an untyped storage
    nbytes: int


@dataclasses.dataclass(frozen=True)
class _Call:
    """A function a pickle may call (``REDUCE``), under the name it is pickled by: ``fn(unpickler,
    *args)``, which checks its arguments and charges the unpickler's budget before it allocates."""

    name: str
    fn: Callable[..., Any] = dataclasses.field(repr=False)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is not tuple or not all(type(v) is int and 0 <= v < _MAX_INT64 for v in value):
        raise _Refused(f"asks for a tensor whose {what} is {_show(value)}, not a tuple of non-negative 64-bit "
                       f"integers")
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


def _tensor(u: _Unpickler, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
            backward_hooks: Any, dtype: torch.dtype, metadata: Any) -> torch.Tensor:
    """A dense CPU tensor viewing ``storage``, checked: inside it and not overlapping itself; its
    object charged to the parse budget, its bytes to the tensor budget."""
    if (not isinstance(storage, _Storage) or type(offset) is not int or not 0 <= offset < _MAX_INT64
            or type(requires_grad) is not bool):
        raise _Refused(f"asks for a tensor of {type(storage).__name__} at offset {_show(offset)}")
    if type(size) is tuple and type(stride) is tuple:
        u.charge(_TENSOR + 2 * _STEP * (len(size) + len(stride)))
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride) or _overlaps_itself(size, stride):
        raise _Refused(f"asks for an expanded tensor of size {_show(size)} and strides {_show(stride)} (elements "
                       f"shared: more than its storage holds when copied)")
    end = 0 if 0 in size else offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))
    if max(end, offset) * dtype.itemsize > storage.nbytes:
        raise _Refused(f"asks for a tensor of size {_show(size)}, strides {_show(stride)} at offset {offset} in a "
                       f"storage of {storage.nbytes} bytes, past its end")
    _hooks(backward_hooks)
    if metadata is not None and (type(metadata) is not dict or len(metadata) > 2 or not set(metadata) <= {"conj", "neg"}
                                 or not all(type(v) is bool for v in metadata.values())):
        raise _Refused(f"asks for a tensor with the metadata {_show(metadata)}")
    if u.tensor_bytes is not None:  # (inside its storage and not overlapping itself: at most the storage)
        u.tensor_bytes.charge(functools.reduce(int.__mul__, size, 1) * dtype.itemsize)
    tensor = torch.empty((0,), dtype=dtype).set_(storage.untyped, offset, size, stride)
    if metadata:
        torch._utils.set_tensor_metadata(tensor, metadata)
    return tensor.requires_grad_(requires_grad)


def _rebuild_tensor_v2(u, storage, offset, size, stride, requires_grad, backward_hooks, metadata=None):
    """``torch._utils._rebuild_tensor_v2``, checked: a tensor of its typed storage's dtype."""
    dtype = storage.dtype if isinstance(storage, _Storage) else torch.uint8
    return _tensor(u, storage, offset, size, stride, requires_grad, backward_hooks, dtype, metadata)


def _rebuild_tensor_v3(u, storage, offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    """``torch._utils._rebuild_tensor_v3``, checked: the dtypes without a typed storage (float8,
    uint16...) over an untyped one."""
    if (not isinstance(storage, _Storage) or storage.dtype != torch.uint8 or type(dtype) is not torch.dtype
            or dtype not in torch.storage._new_dtypes()):
        raise _Refused(f"asks for a {_show(dtype)} tensor over a typed storage")
    return _tensor(u, storage, offset, size, stride, requires_grad, backward_hooks, dtype, metadata)


def _rebuild_parameter(u, data, requires_grad, backward_hooks):
    """``torch._utils._rebuild_parameter`` (``nn.Parameter``), checked: over a tensor rebuilt here."""
    if type(data) is not torch.Tensor or type(requires_grad) is not bool:
        raise _Refused(f"asks for a parameter of {type(data).__name__}")
    _hooks(backward_hooks)
    u.charge(_PARAMETER)
    return torch.nn.Parameter(data, requires_grad)


def _rebuild_device_tensor_from_cpu_tensor(u, data, dtype, device, requires_grad):
    """``torch._utils._rebuild_device_tensor_from_cpu_tensor``, which ``torch.save`` writes for an
    XLA tensor (torch_xla's optimizer state saved as it is), read on the CPU: ``data`` itself, a
    tensor rebuilt here (checked, so never the expanded view torch would copy to the device), of
    the dtype named; nothing is copied or converted."""
    if (type(data) is not torch.Tensor or type(dtype) is not torch.dtype or data.dtype != dtype
            or type(device) is not str or type(requires_grad) is not bool):
        raise _Refused(f"asks for a device tensor of {type(data).__name__} as {_show(dtype)}")
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


def _sequence(items: Any, what: str) -> list | tuple:
    if type(items) not in (list, tuple):
        raise _Refused(f"asks for {what} of a {type(items).__name__} (a pickle passes a list or a tuple)")
    return items


def _set(u: _Unpickler, items: Any = ()) -> set:
    """``set(items)``, which protocol 2 pickles a set as: charged by its length, each item checked
    (``_Unpickler.key``) before it is hashed."""
    items = _sequence(items, "set(...)")
    u.charge(224 + _SET_ITEM * len(items))
    out: set = set()
    for item in items:
        u.key(out, item, "an item of a set")
        out.add(item)
    return out


def _frozenset(u: _Unpickler, items: Any = ()) -> frozenset:
    """``frozenset(items)``: as ``_set``."""
    built = _set(u, items)
    u.charge(224 + _SET_ITEM * len(built))
    return frozenset(built)


def _ordered_dict(u: _Unpickler, items: Any = ()) -> OrderedDict:
    """``OrderedDict(items)`` (``torch.save`` writes ``OrderedDict()`` and then its items): charged by
    its length, each key checked (``_Unpickler.key``) before it is hashed."""
    pairs = items.items() if type(items) in (dict, OrderedDict) else _sequence(items, "OrderedDict(...)")
    u.charge(128 + 2 * _DICT_ITEM * len(pairs))  # (an OrderedDict keeps a linked node per key too)
    out: OrderedDict = OrderedDict()
    for pair in pairs:
        if type(pair) not in (tuple, list) or len(pair) != 2:
            raise _Refused(f"asks for OrderedDict(...) of {_show(pair)}, not a (key, value) pair")
        u.key(out, pair[0], "a key of an OrderedDict")
        out[pair[0]] = pair[1]
    return out


def _size(u: _Unpickler, items: Any = ()) -> torch.Size:
    """``torch.Size(items)``: charged by its length, 64-bit integers only."""
    items = _sequence(items, "torch.Size(...)")
    u.charge(72 + _LIST_ITEM * len(items))
    if not all(type(v) is int and -_MAX_INT64 <= v < _MAX_INT64 for v in items):
        raise _Refused(f"asks for torch.Size({_show(items)}), not of 64-bit integers")
    return torch.Size(items)


def _latin1(u: _Unpickler, text: Any, encoding: Any) -> bytes:
    """``_codecs.encode``, which protocol 2 pickles bytes as: ``encode(str, "latin1")`` only,
    charged by its length."""
    if type(text) is not str or type(encoding) is not str or encoding != "latin1":
        raise _Refused(f"asks for _codecs.encode({type(text).__name__}, {_show(encoding)})")
    u.charge(33 + len(text))
    return text.encode("latin1")


@functools.cache
def _state_dict_globals() -> dict[tuple[str, str], Any]:
    """What a ``torch.save`` state dict names: its rebuild functions, containers and dtypes."""
    calls = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"): _rebuild_device_tensor_from_cpu_tensor,
        ("collections", "OrderedDict"): _ordered_dict,
        ("torch", "Size"): _size,
        ("builtins", "set"): _set,
        ("builtins", "frozenset"): _frozenset,
        ("_codecs", "encode"): _latin1,
    }
    allowed: dict[tuple[str, str], Any] = {key: _Call(f"{key[0]}.{key[1]}", fn) for key, fn in calls.items()}
    allowed[("torch", "UntypedStorage")] = _StorageType("UntypedStorage", torch.uint8)
    allowed[("torch.storage", "UntypedStorage")] = _StorageType("UntypedStorage", torch.uint8)
    for dtype, name in torch.storage._dtype_to_storage_type_map().items():
        if not name.startswith("Q"):  # (no quantized tensor is rebuilt)
            allowed[("torch", name)] = _StorageType(name, dtype)
    allowed.update({("torch", name): dtype for name, dtype in DTYPES.items()})
    return allowed


def _path(cls: type) -> Callable[..., Any]:
    """``cls(*parts)`` (``StorageMeta.checkpoint_id``, pickled as its parts): strings only, charged by
    their length (a path splits them at each ``/``, into lists of new strings: up to about 40 bytes a
    character of ``"\u0101/\u0101/..."``; a real one is a hundred characters once a file)."""
    def build(u: _Unpickler, *parts: Any) -> Any:
        if not all(type(p) is str for p in parts):
            raise _Refused(f"asks for a {cls.__name__} of {_show(parts)}, not of strings")
        u.charge(64 + sum(64 * len(p) + 64 for p in parts))
        return cls(*parts)
    return build


@functools.cache
def _dcp_globals() -> dict[tuple[str, str], Any]:
    """What a DCP ``.metadata`` names, besides nxd_smp's own classes the caller passes: DCP's
    dataclasses (constructed without arguments, then given their state), and checked calls."""
    from torch.distributed.checkpoint import filesystem, metadata
    from torch.serialization import _get_layout

    def layout(u: _Unpickler, name: Any) -> torch.layout:
        if type(name) is not str:
            raise _Refused(f"asks for the layout {_show(name)}, not a layout's name")
        return _get_layout(name)

    def memory_format(u: _Unpickler, value: Any) -> metadata._MEM_FORMAT_ENCODING:
        if type(value) is not int:
            raise _Refused(f"asks for the memory format {_show(value)}, not a number")
        return metadata._MEM_FORMAT_ENCODING(value)

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
        for name in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                     "MetadataIndex", "StorageMeta", "BytesStorageMetadata")}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo  # format 1
    calls = {
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): memory_format,
        ("torch.serialization", "_get_layout"): layout,  # a layout by its name
        ("pathlib", "PosixPath"): _path(pathlib.PosixPath),  # StorageMeta.checkpoint_id
        ("pathlib", "PurePosixPath"): _path(pathlib.PurePosixPath),
        ("collections", "OrderedDict"): _ordered_dict,
        ("torch", "Size"): _size,
    }
    allowed.update({key: _Call(f"{key[0]}.{key[1]}", fn) for key, fn in calls.items()})
    allowed.update({key: value for key, value in _state_dict_globals().items() if isinstance(value, torch.dtype)})
    return allowed


# ---------------------------------------------------------------------------- the unpickler
def _refuse_opcode(name: str):
    def refuse(self: _Unpickler) -> None:
        raise _Refused(f"uses the pickle opcode {name}, which no file nxd_smp reads holds")
    return refuse


def _metered(load: Callable[[Any], None], code: int) -> Callable[[Any], None]:
    """``load`` (one opcode's loader), charging the parse budget what it allocates: a fixed cost
    before it runs (``_COSTS``; the stack slot alone for most), or, for a string, bytes or a long
    integer, the size of what it pushed once read (no more than the bytes it read from the file)."""
    if code in _MEASURED:
        def run(self: _Unpickler) -> None:
            load(self)
            self.charge(8 + sys.getsizeof(self.stack[-1]))
    else:
        cost = _COSTS.get(code, 8)

        def run(self: _Unpickler) -> None:
            self.charge(cost)
            load(self)
    return run


class _Unpickler(pickle._Unpickler):
    """Python's own unpickler (its memo a dict: the C one sizes its memo by an index the file gives,
    so nine bytes can allocate a gigabyte), admitting one kind's globals, calling only the reader's
    checked functions (``REDUCE``), constructing only that kind's classes (``NEWOBJ``), and setting
    state (``BUILD``) only as that kind's files do; every opcode charged to ``budget``, every tensor
    to ``tensor_bytes``, every key checked (``key``) before it is hashed."""

    def __init__(self, data: bytes, source: str, kind: str, allowed: dict[tuple[str, str], Any],
                 storage: Any = None, tensor_bytes: Budget | None = None):
        super().__init__(io.BytesIO(data))
        self._kind, self._allowed, self._storage = kind, allowed, storage
        self.budget = Budget.linear(len(data), source, per_byte=PARSE_BUDGET_PER_BYTE, floor=PARSE_BUDGET_FLOOR,
                                    what=f"bytes of memory (and steps of work, {_STEP} each)",
                                    counted="its pickle")
        self.charge = self.budget.charge
        self.tensor_bytes = tensor_bytes
        classes = [v for v in allowed.values() if isinstance(v, type)]
        self._constructs = {id(v) for v in classes if dataclasses.is_dataclass(v) or v is XserReference}
        self._fields = {id(v): {f.name for f in dataclasses.fields(v)} for v in classes if dataclasses.is_dataclass(v)}
        self._index = allowed.get(("torch.distributed.checkpoint.metadata", "MetadataIndex"))
        self._hashes: dict[int, tuple[Any, dict[int, int]]] = {}  # id(container): (container, {hash: keys})

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
            raise UnsafeFileError(f"asks for {module[:200]}.{name[:200]}, which a {self._kind} file does not hold; "
                                  f"refused (loading it could run code). nxd_smp's reader admits plain containers, "
                                  f"numbers, strings and tensors, and does not extend that by "
                                  f"torch.serialization.add_safe_globals.")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if self._storage is None:
            raise _Refused("holds a persistent reference, which a plain pickle does not")
        return self._storage(pid)

    # ---------------------------------------------------------------- keys
    def key(self, container: Any, key: Any, what: str) -> None:
        """Refuse ``key`` as ``what`` (a key of ``container``, a dict or a set, or an item of it)
        unless a file cannot make many such keys share one hash: a string or bytes (their hashes
        are salted per process), a bool, None, a dtype, an integer of magnitude below 2**61 - 1 (its
        own hash: every multiple of 2**61 - 1 hashes to 0, and ``hash(-1) == hash(-2)``), or a float
        or a DCP ``MetadataIndex`` (of a string and a ``torch.Size``: a tuple, whose hash a file can
        choose) with at most ``MAX_EQUAL_HASHES`` of one hash in ``container``. A dict or set of n
        keys of one hash takes time in n**2 to build."""
        kind = type(key)
        if kind is str or kind is bytes or kind is bool or key is None or kind is torch.dtype:
            return
        if kind is int:
            if -_HASH_MODULUS < key < _HASH_MODULUS:
                return
            raise _Refused(f"uses the integer {_show(key)} as {what}: Python's integer hashes repeat from 2**61 - 1 "
                           f"on (every multiple of it hashes to 0), so such keys can make building it quadratic; no "
                           f"file nxd_smp reads keys by an integer that large")
        if kind is float or (self._index is not None and kind is self._index and self._metadata_index(key)):
            self.charge(_STEP * (2 + len(getattr(key, "offset", None) or ())))
            if key in container:  # (given again: it replaces its value)
                return
            entry = self._hashes.get(id(container))
            if entry is None:
                entry = self._hashes[id(container)] = (container, {})
                self.charge(_DICT_ITEM + 232)
            counts, h = entry[1], hash(key)
            counts[h] = counts.get(h, 0) + 1
            if counts[h] > MAX_EQUAL_HASHES:
                raise _Refused(f"holds more than {MAX_EQUAL_HASHES} {kind.__name__} keys of one hash in one "
                               f"container ({_show(key)}): keys chosen to share a hash make building it quadratic")
            self.charge(_DICT_ITEM)
            return
        raise _Refused(f"uses a {kind.__name__} ({_show(key)}) as {what}: the files nxd_smp reads key their dicts "
                       f"and sets by strings, bytes, numbers, None and dtypes (and DCP's MetadataIndex); a tuple's "
                       f"hash (or that of any value of several) can be chosen to collide, making building it quadratic")

    def _metadata_index(self, key: Any) -> bool:
        """Whether ``key``, a ``MetadataIndex``, is one DCP writes: ``fqn`` a string, ``offset`` None
        or a ``torch.Size`` (made by ``_size``: integers); else it is refused as a key."""
        state = vars(key)
        offset = state.get("offset")
        if type(state.get("fqn")) is not str or not (offset is None or type(offset) is torch.Size):
            raise _Refused(f"uses a MetadataIndex of {_show(state.get('fqn'))} at {_show(offset)} as a key: DCP's "
                           f"are of a name and a torch.Size")
        return True

    # ---------------------------------------------------------------- calls
    def load_reduce(self) -> None:
        stack = self.stack
        func, args = stack[-2], stack[-1]
        if type(func) is not _Call:
            raise _Refused(f"asks to call {_show(func)}(...), which it may not (it could allocate what the file "
                           f"names)")
        if type(args) is not tuple:
            raise _Refused(f"calls {func.name} with arguments of a {type(args).__name__}, not a tuple")
        self.charge(_STEP * len(args))
        stack.pop()
        stack[-1] = func.fn(self, *args)

    def load_newobj(self) -> None:
        stack = self.stack
        cls, args = stack[-2], stack[-1]
        if id(cls) not in self._constructs:
            raise _Refused(f"asks to construct {_show(cls)}(...), which it may not (it could allocate what the file "
                           f"names)")
        if type(args) is not tuple or args:
            raise _Refused(f"asks to construct {cls.__qualname__} with arguments ({_show(args)}); pickle writes "
                           f"this class constructed without any and then sets its state")
        stack.pop()
        stack[-1] = cls.__new__(cls)

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if type(state) is dict:
            self.charge(_DICT_ITEM * len(state))
        if type(inst) is OrderedDict and type(state) is dict and set(state) == {"_metadata"}:
            metadata = state["_metadata"]
            if type(metadata) in (dict, OrderedDict):  # (checked item by item below: charged first)
                self.charge(_STEP * len(metadata))
                self.charge(_STEP * sum(len(entry) for entry in metadata.values() if type(entry) is dict))
            inst._metadata = _module_versions(metadata)  # a module state dict's versions, by module
        elif type(inst) is XserReference and type(state) is dict and set(state) == {"tid"}:
            tid = state["tid"]
            if type(tid) is not int or not 0 <= tid < 1 << 62:
                raise _Refused(f"holds a tensor reference whose id is {_show(tid)}")
            inst.tid = tid
        elif id(type(inst)) in self._fields and (set(state) <= self._fields[id(type(inst))] if type(state) is dict
                                                 else "__setstate__" in vars(type(inst))):
            return super().load_build()  # a DCP dataclass: its own fields, or its own __setstate__
        else:
            raise _Refused(f"asks to set the state of a {type(inst).__name__}, which it may not")
        self.stack.pop()

    # ---------------------------------------------------------------- containers
    def _into(self, target: Any, kinds: tuple[type, ...], op: str) -> None:
        """The container opcodes call ``append``, ``add`` or ``__setitem__`` on whatever is below
        their items: only on a container of exactly these kinds (on a tensor, ``add`` broadcasts and
        ``__setitem__`` can too, allocating what the file never held)."""
        if type(target) not in kinds:
            raise _Refused(f"uses {op} on a {type(target).__name__}, which only a container takes")

    def _marked(self, kinds: tuple[type, ...], op: str) -> tuple[list, Any]:
        """The items since the last ``MARK`` (popped) and the container below them, of ``kinds``."""
        self._into(self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None, kinds, op)
        items = self.pop_mark()
        return items, self.stack[-1]

    def _pairs(self, items: list, target: Any, what: str) -> None:
        """``target[key] = value`` for each pair of ``items``, each key checked before it is hashed."""
        if len(items) % 2:
            raise pickle.UnpicklingError(f"an odd number of items ({len(items)}) for a dict's keys and values")
        self.charge(_DICT_ITEM * (len(items) // 2))
        key = self.key
        for i in range(0, len(items), 2):
            key(target, items[i], what)
            target[items[i]] = items[i + 1]

    def _items(self, items: list, target: set) -> None:
        self.charge(_SET_ITEM * len(items))
        for item in items:
            self.key(target, item, "an item of a set")
            target.add(item)

    def load_append(self) -> None:
        self._into(self.stack[-2], (list,), "APPEND")
        super().load_append()

    def load_appends(self) -> None:
        items, target = self._marked((list,), "APPENDS")
        self.charge(_LIST_ITEM * len(items))
        target.extend(items)

    def load_setitem(self) -> None:
        stack = self.stack
        self._into(stack[-3], (dict, OrderedDict), "SETITEM")
        self._pairs(stack[-2:], stack[-3], "a key of a dict")
        del stack[-2:]

    def load_setitems(self) -> None:
        items, target = self._marked((dict, OrderedDict), "SETITEMS")
        self._pairs(items, target, "a key of a dict")

    def load_dict(self) -> None:
        items = self.pop_mark()
        self.charge(232)
        target: dict = {}
        self._pairs(items, target, "a key of a dict")
        self.append(target)

    def load_additems(self) -> None:
        items, target = self._marked((set,), "ADDITEMS")
        self._items(items, target)

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        target: set = set()
        self._items(items, target)
        self.charge(224 + _SET_ITEM * len(target))
        self.append(frozenset(target))

    def load_tuple(self) -> None:
        self.charge(48 + _LIST_ITEM * len(self.stack))
        super().load_tuple()

    def load_list(self) -> None:
        self.charge(56)  # (the items' list itself)
        super().load_list()

    # ---------------------------------------------------------------- the memo
    def _memo_index(self) -> int:
        """The memo index of a text ``PUT`` or ``GET``: as the binary ones, below 2**32 (a larger
        integer key could share its hash with others)."""
        text = self.readline()[:-1]
        if not text.isdigit() or len(text) > 10 or int(text) >= 1 << 32:
            raise _Refused(f"uses the memo index {_show(text[:40])}, not an integer below 2**32")
        return int(text)

    def load_put(self) -> None:
        self.memo[self._memo_index()] = self.stack[-1]

    def load_get(self) -> None:
        i = self._memo_index()
        if i not in self.memo:
            raise pickle.UnpicklingError(f"Memo value not found at index {i}")
        self.append(self.memo[i])

    _loaders = dict(pickle._Unpickler.dispatch)
    for _name in ("INST", "OBJ", "EXT1", "EXT2", "EXT4", "PERSID", "NEWOBJ_EX", "NEXT_BUFFER", "READONLY_BUFFER",
                  "BYTEARRAY8"):
        _loaders[getattr(pickle, _name)[0]] = _refuse_opcode(_name)
    _loaders.update({op[0]: fn for op, fn in (
        (pickle.APPEND, load_append), (pickle.APPENDS, load_appends), (pickle.SETITEM, load_setitem),
        (pickle.SETITEMS, load_setitems), (pickle.DICT, load_dict), (pickle.ADDITEMS, load_additems),
        (pickle.FROZENSET, load_frozenset), (pickle.TUPLE, load_tuple), (pickle.LIST, load_list),
        (pickle.PUT, load_put), (pickle.GET, load_get), (pickle.REDUCE, load_reduce),
        (pickle.NEWOBJ, load_newobj), (pickle.BUILD, load_build))})
    dispatch = {code: _metered(load, code) for code, load in _loaders.items()}
    del _loaders, _name


def _unpickle(data: bytes, source: str, kind: str, allowed: dict, storage: Any = None,
              tensor_bytes: Budget | None = None) -> Any:
    """``data`` unpickled by ``_Unpickler`` within its budgets, and measured (``check_tree``);
    every failure a ``CheckpointError`` naming ``source`` and where in the value the pickle was."""
    unpickler = _Unpickler(data, source, kind, allowed, storage, tensor_bytes)
    error: CheckpointError | None = None
    try:
        value = unpickler.load()
    except BudgetError as e:
        where = unpickler.where()
        error = UnsafeFileError(f"{e}{f' (It stopped{where}.)' if where else ''}")
    except (UnsafeFileError, _Refused) as e:
        error = UnsafeFileError(f"{source}{unpickler.where()} {e}"
                                f"{'' if isinstance(e, UnsafeFileError) else '; refused.'}")
    except CheckpointError as e:
        error = e.with_traceback(None)
    except Exception as e:  # noqa: BLE001 - any way a damaged pickle fails
        error = CheckpointError(f"{source}{unpickler.where()} cannot be read (damaged): {type(e).__name__}: "
                                f"{str(e)[:400]}")
    if error is not None:  # raised outside the handler, the unpickler dropped: the error keeps no part of the parse
        del unpickler
        raise error
    check_tree(value, source, max(_NODES_PER_BYTE * len(data), _MIN_NODES), MAX_DEPTH)
    return value


def check_tree(value: Any, source: str, bound: int, max_depth: int) -> None:
    """``value``'s size as a tree (a container reached twice counts each time; strings and bytes
    by their length too) is at most ``bound`` nodes, it nests no deeper than ``max_depth`` and holds
    no cycle (a pickle can make a few bytes stand for 2**30 values, which a deep copy or a JSON dump
    of the value would then write out). Each object is measured once (its size and height kept), so this is linear in the
    objects, not in the tree."""
    measured: dict[int, tuple[int, int]] = {}
    open_: set[int] = set()

    def measure(x: Any, depth: int) -> tuple[int, int]:
        if isinstance(x, (str, bytes)):
            return 1 + len(x) // 16, 0
        if isinstance(x, Mapping):
            children = [item for pair in x.items() for item in pair] + list(getattr(x, "__dict__", {}).values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            children = list(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            children = [getattr(x, f.name, None) for f in dataclasses.fields(x)]
        else:
            return 1, 0
        if id(x) in measured:
            size, height = measured[id(x)]
        else:
            if id(x) in open_:
                raise CheckpointError(f"{source} holds a container that contains itself; refused.")
            open_.add(id(x))
            size, height = 1, 0
            for child in children:
                if depth >= max_depth:
                    raise CheckpointError(f"{source} nests containers more than {max_depth} deep; refused.")
                child_size, child_height = measure(child, depth + 1)
                size, height = size + child_size, max(height, child_height + 1)
                if size > bound:
                    break
            open_.discard(id(x))
            measured[id(x)] = size, height
        if depth + height > max_depth:
            raise CheckpointError(f"{source} nests containers more than {max_depth} deep; refused.")
        if size > bound:
            raise CheckpointError(f"{source} refers to its containers so often that, written out, it holds more "
                                  f"than {bound} values (the bound its file's size gives); refused (a few "
                                  f"bytes of shared references can stand for 2**30 values).")
        return size, height

    measure(value, 0)
