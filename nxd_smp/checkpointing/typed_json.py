"""The typed JSON of nxd_smp's own checkpoints (format 3): every value that is not a tensor's bytes
(the metadata, hyperparameters, the scheduler's and other objects' states, the loss scaler, RNG
states, the caller's ``extra``) is JSON, and reading it runs no code and builds nothing but the
values below.

JSON alone would lose types a state needs back exactly, so each is one tagged object
``{"$<tag>": payload}``:

=============================  ======================================================
value                          written as
=============================  ======================================================
``None``, bool, int, str       itself
float                          itself if finite, else ``{"$float": "nan" | "inf" | "-inf"}``
list                           a JSON list
tuple                          ``{"$tuple": [items]}`` (``betas``, RNG states)
dict of strings                a JSON object (no key starting with ``$``)
any other dict                 ``{"$dict": [[key, value], ...]}`` (integer keys, ...)
``collections.OrderedDict``    ``{"$odict": [[key, value], ...]}``
bytes                          ``{"$bytes": base64}``
``torch.dtype``                ``{"$dtype": "bfloat16"}``
``torch.Size``                 ``{"$size": [sizes]}``
``torch.Tensor``               ``{"$tensor": key}``: a raw entry of the checkpoint's index
=============================  ======================================================

Anything else is refused when it is saved (``encode``), naming where it is and what to do. A file
decodes into a tree: every tensor entry is referred to once, nesting is bounded, and a tag, key or
dtype outside this table is a ``CheckpointError`` naming the file and the place (``decode``).

Reading costs time and memory linear in the file: ``json.loads`` (C) builds at most one object per
byte of input, each object's keys given once (a key repeated in one object is refused: ``loads``),
and ``decode`` charges every node it builds to a budget linear in the file's size (``budget.Budget``),
stopping at the first overrun. A key of a ``$dict`` is one whose hash an
attacker cannot make collide (Python's int hashes are not randomised: ``hash(k * (2**61 - 1)) == 0``,
so colliding keys would make building the dict quadratic): a string, bytes, bool, None, a float, a
dtype, or an int below ``2**61 - 1`` in size (``hash_safe_key``); of any other key (a tuple) one dict
holds at most ``MAX_COLLIDABLE_KEYS``, when it is written and when it is read.
"""

from __future__ import annotations

import base64
import binascii
import collections
import json
import math
from collections.abc import Callable
from typing import Any

import torch

from ..core.errors import CheckpointError
from .budget import Budget

MAX_DEPTH = 100
#: Budget units (about bytes of memory) ``decode`` may spend per byte of its file: a node of the parsed
#: JSON is at least 2 bytes of it and becomes one Python object of at most ~100 bytes.
_DECODE_PER_BYTE = 64
_DECODE_FLOOR = 1 << 16
_INT_HASH_LIMIT = (1 << 61) - 1


#: The most keys of one dict whose hashes an attacker could make collide (tuples, ints of 2**61 and
#: more): a few keys of a user's own are such, and their dict costs at most this many squared steps.
MAX_COLLIDABLE_KEYS = 1024


def hash_safe_key(key: Any) -> bool:
    """Whether ``key`` is a dict key whose hash an attacker cannot make collide with others': strings and
    bytes (hashed with a random seed), ints below ``2**61 - 1`` in size (they hash to themselves, so
    distinct ones differ), floats (they collide only in a handful of classes), bools, None, dtypes (hashed
    by identity). Other keys (tuples, bigger ints) count against ``MAX_COLLIDABLE_KEYS`` per dict."""
    if isinstance(key, (str, bytes, float, torch.dtype)) or key is None or isinstance(key, bool):
        return True
    return type(key) is int and -_INT_HASH_LIMIT < key < _INT_HASH_LIMIT


def _collidable(keys: Any) -> int:
    return sum(1 for key in keys if not hash_safe_key(key))
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_TAGS = frozenset({"$float", "$tuple", "$dict", "$odict", "$bytes", "$dtype", "$size", "$tensor"})


#: The dense dtypes that are not floating point (every floating one is admitted but packed ones).
_DENSE = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
          torch.uint64, torch.complex32, torch.complex64, torch.complex128)
#: Every dense torch dtype by its name, read from the module's own names (``getattr(torch, name)`` with a
#: name from a file could import one of torch's lazily loaded submodules); no quantized, bit-packed or
#: sub-byte dtype, which nxd_smp never writes.
DTYPES: dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
    and (value in _DENSE or value.is_floating_point and not name.endswith("_x2"))}


def dtype_named(name: Any) -> torch.dtype | None:
    """The torch dtype called ``name`` (``"bfloat16"``, ``"torch.bfloat16"``), None for anything else."""
    return DTYPES.get(name.removeprefix("torch.")) if isinstance(name, str) else None


def _where(at: tuple) -> str:
    return "".join(f"[{key!r}]" for key in at) or " (the top level)"


def encode(value: Any, tensor: Callable[[torch.Tensor], str], *, what: str = "extra") -> Any:
    """``value`` as a JSON value of the table above; each tensor is handed to ``tensor``, which
    stores it as a raw entry and returns the entry's key.

    Raises:
        TypeError: a value of another type, naming ``what`` and where in it, and the fix.
    """

    def walk(item: Any, at: tuple) -> Any:
        if len(at) > MAX_DEPTH:
            raise TypeError(f"{what}{_where(at[:4])}... nests containers more than {MAX_DEPTH} deep.")
        if item is None or isinstance(item, (bool, str)) or type(item) is int:
            return item
        if type(item) is float:
            return item if math.isfinite(item) else {"$float": "nan" if item != item else
                                                     "inf" if item > 0 else "-inf"}
        if type(item) is list:
            return [walk(v, (*at, i)) for i, v in enumerate(item)]
        if type(item) is tuple:
            return {"$tuple": [walk(v, (*at, i)) for i, v in enumerate(item)]}
        if type(item) is dict and all(isinstance(k, str) and not k.startswith("$") for k in item):
            return {k: walk(v, (*at, k)) for k, v in item.items()}
        if type(item) in (dict, collections.OrderedDict):
            if _collidable(item) > MAX_COLLIDABLE_KEYS:
                raise TypeError(f"{what}{_where(at)} has more than {MAX_COLLIDABLE_KEYS} keys that are tuples or ints "
                                f"of 2**61 and more, whose hashes a file could make collide; checkpoints keep at most "
                                f"that many in one dict. Use string keys.")
            tag = "$dict" if type(item) is dict else "$odict"
            return {tag: [[walk(k, (*at, "<key>")), walk(v, (*at, k))] for k, v in item.items()]}
        if type(item) is bytes:
            return {"$bytes": base64.b64encode(item).decode("ascii")}
        if isinstance(item, torch.dtype):
            return {"$dtype": str(item).removeprefix("torch.")}
        if type(item) is torch.Size:
            return {"$size": list(item)}
        if type(item) is torch.Tensor:
            if item.layout != torch.strided or item.is_quantized or item.is_nested:
                raise TypeError(f"{what}{_where(at)} is a {item.layout} tensor; checkpoints hold dense tensors. "
                                f"Save it as dense tensors (e.g. .to_dense()).")
            return {"$tensor": tensor(item)}
        kind = type(item).__module__ + "." + type(item).__qualname__
        raise TypeError(
            f"{what}{_where(at)} is a {kind}; nxd_smp's checkpoints hold JSON values (None, bool, int, float, str, "
            f"list, tuple, dict, bytes), torch dtypes, sizes and plain tensors only, and never a pickle. Convert it "
            f"(a parameter: .detach(); a numpy array: torch.from_numpy; an object: its state_dict() through "
            f"stateful=), or save it yourself beside the checkpoint.")

    return walk(value, ())


def decode(value: Any, tensor: Callable[[str], torch.Tensor], source: str, *, size: int = 0) -> Any:
    """The value ``encode`` wrote as ``value`` (parsed JSON), each ``{"$tensor": key}`` replaced by
    ``tensor(key)``, which reads that raw entry. ``source`` names the file in errors.

    Raises:
        CheckpointError: a tag, dtype or key outside the table, an entry referred to twice, nesting
            deeper than ``MAX_DEPTH``; naming ``source`` and the place.
    """
    used: set[str] = set()
    budget = Budget.linear(size, source, per_byte=_DECODE_PER_BYTE, floor=_DECODE_FLOOR,
                           what="bytes of memory to decode", counted="the file")

    def refuse(at: tuple, what: str) -> CheckpointError:
        return CheckpointError(f"{source}{_where(at)}: {what}; refused (nxd_smp writes no such value).")

    def pairs(payload: Any, at: tuple) -> list[tuple[Any, Any]]:
        if not isinstance(payload, list) or not all(isinstance(p, list) and len(p) == 2 for p in payload):
            raise refuse(at, "a dict that is not a list of [key, value] pairs")
        out, collidable = [], 0
        for k, v in payload:
            key = walk(k, (*at, "<key>"))
            try:
                hash(key)
            except TypeError:
                raise refuse(at, f"a key of type {type(key).__name__}, which cannot be a key") from None
            collidable += not hash_safe_key(key)
            if collidable > MAX_COLLIDABLE_KEYS:
                raise refuse(at, f"more than {MAX_COLLIDABLE_KEYS} keys that are tuples or ints of 2**61 and more "
                                 f"(their hashes can be made to collide, and the dict built in quadratic time)")
            out.append((key, walk(v, (*at, key))))
        return out

    def walk(item: Any, at: tuple) -> Any:
        budget.charge(64 + (len(item) if isinstance(item, str) else 8 * len(item) if isinstance(item, (list, dict))
                            else 0))
        if len(at) > MAX_DEPTH:
            raise refuse(at[:4], f"containers nested more than {MAX_DEPTH} deep")
        if item is None or isinstance(item, (bool, int, str)):
            return item
        if isinstance(item, float):
            return item  # (JSON has no non-finite numbers: json.loads is told to refuse them)
        if isinstance(item, list):
            return [walk(v, (*at, i)) for i, v in enumerate(item)]
        if not isinstance(item, dict):
            raise refuse(at, f"a {type(item).__name__}")
        tags = [k for k in item if k.startswith("$")]
        if not tags:
            return {k: walk(v, (*at, k)) for k, v in item.items()}
        if len(item) != 1 or tags[0] not in _TAGS:
            raise refuse(at, f"the object with keys {sorted(item)[:4]}")
        (tag, payload), = item.items()
        if tag == "$float":
            if not isinstance(payload, str) or payload not in _FLOATS:
                raise refuse(at, f"the float {payload!r}")
            return _FLOATS[payload]
        if tag == "$tuple":
            if not isinstance(payload, list):
                raise refuse(at, "a tuple that is not a list")
            return tuple(walk(v, (*at, i)) for i, v in enumerate(payload))
        if tag in ("$dict", "$odict"):
            found = pairs(payload, at)
            return dict(found) if tag == "$dict" else collections.OrderedDict(found)
        if tag == "$bytes":
            try:
                if isinstance(payload, str):
                    return base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                pass
            raise refuse(at, "bytes that are not base64")
        if tag == "$dtype":
            dtype = dtype_named(payload)
            if dtype is None:
                raise refuse(at, f"the dtype {payload!r}")
            return dtype
        if tag == "$size":
            if not isinstance(payload, list) or len(payload) > 64 or not all(type(d) is int and 0 <= d < 1 << 62
                                                                             for d in payload):
                raise refuse(at, "a size that is not a list of sizes")
            return torch.Size(payload)
        if not isinstance(payload, str) or payload in used:
            raise refuse(at, f"the tensor entry {payload!r} " + ("referred to twice" if payload in used else ""))
        used.add(payload)
        return tensor(payload)

    return walk(value, ())


def dumps(value: Any) -> bytes:
    """An encoded value as the bytes of a JSON file (ASCII: every control character escaped)."""
    return json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"the non-JSON number {name}")


class _RepeatedKey(ValueError):
    """A key given twice in one JSON object (``loads`` names the file)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """One JSON object as a dict, its keys each given once: JSON lets an object repeat a key and
    ``json.loads`` keeps the last value silently, where another reader may keep the first. Linear in
    the pairs (string keys: hashes a file cannot make collide)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)
    return out


def loads(data: bytes, source: str) -> Any:
    """The JSON value of a file's bytes (not yet decoded): every object's keys each given once.

    Raises:
        CheckpointError: not JSON (or nested too deep for the parser), or an object that gives a key
            twice; naming ``source`` (and the key).
    """
    try:
        return json.loads(data, parse_constant=_refuse_constant, object_pairs_hook=_object)
    except _RepeatedKey as e:
        key = e.key if len(e.key) <= 200 else e.key[:200] + "..."
        raise CheckpointError(f"{source} gives the key {key!r} twice in one object; nxd_smp writes each key once "
                              f"(JSON readers differ on which value a repeated key keeps). Refused.") from None
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{source} is not a JSON file nxd_smp wrote: {type(e).__name__}: {e}") from None
