"""Budgets while parsing (``checkpointing.budget``, the strict reader): a small crafted pickle whose
parse would grow far past its size (a memoised list copied by every five bytes, a flood of one-byte
empty containers, keys chosen to share one hash, thousands of whole views of one storage, values of
shared references that ``hash`` or ``repr`` would walk 2**64 times) is refused at the first overrun,
having grown the process by no more than its size allows; and what torch writes still reads back as
torch reads it, well inside the budgets.

Each attack is built at several sizes, up to a few hundred kilobytes, and parsed by each entry point
that reads its kind of file (``load_bytes`` and ``load_file`` for a torch.save archive,
``load_pickle`` for a plain pickle) in one child process per entry point (forked from the tests'
preloaded server, tests/distributed.py: what it loaded is frozen out of the collector and below the
meter's zero), which reports for every
case whether it was refused with a ``CheckpointError``, the growth of its peak resident memory
(``VmHWM``, reset before each case) and its time. Without the budgets (the reader of 6b45e11), the
largest of the copying attacks (about 250 KB) grew the process by 2.5 to over 5.8 GB, the floods by
up to 90 MB, keys of one hash took 3 to 11 s (growing as n**2), 50,000 whole views of a 64 KiB
storage (3.2 GB of tensors) were accepted, and a key of 2**64 shared tuples never finished hashing.
"""

from __future__ import annotations

import dataclasses
import io
import math
import json
import pickle
import struct
import sys
import time
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_smp import CheckpointError
from nxd_smp.checkpointing import reader, unpickler
from nxd_smp.checkpointing.budget import Budget
from nxd_smp.core.errors import BudgetError
from nxd_smp.checkpointing.reader import load_bytes, load_pickle
from tests.distributed import run_python

REPO = Path(__file__).resolve().parents[3]
SOURCE = "crafted.pt"
GROWTH_BOUND_MB = 64  # what no crafted case may grow the process by, at any size
NOISE_MB = 8  # the meter's noise: allocator pages, the interpreter's own
PEAK_OVER_UNITS = 1.5  # the budget charges what stays allocated; a dict doubling its table holds both a moment
TIME_BOUND_S = 10.0  # a refusal takes at most ~2 s (a 240 KB flood read to its end); a busy machine's margin
PARSERS = ("load_bytes", "load_file", "load_pickle")


# ---------------------------------------------------------------- files and the oracle
def saved(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def archive(pickled: bytes, records: dict[str, bytes] | None = None) -> bytes:
    """A torch.save-shaped zip: ``archive/data.pkl`` holding ``pickled``, ``archive/data/<key>`` for
    each record."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickled)
        z.writestr("archive/byteorder", b"little")
        for key, data in (records or {}).items():
            z.writestr(f"archive/data/{key}", data)
    return out.getvalue()


def same(a: Any, b: Any, where: str = "") -> None:
    """``a`` (the strict reader's) is ``b`` (torch's): types, tensors' layouts and bytes, keys in order."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad) == (
            b.dtype, b.shape, b.stride(), b.storage_offset(), b.requires_grad), where
        assert bytes(a.untyped_storage()) == bytes(b.untyped_storage()), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}/{i}")
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), (where, a, b)


def adamw_after_steps() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.1}])
    for _ in range(3):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    return opt.state_dict()


# ---------------------------------------------------------------- pickle opcodes
def pint(v: int) -> bytes:
    """The shortest pickle of the integer ``v``."""
    if 0 <= v < 256:
        return b"K" + bytes([v])
    if 0 <= v < 65536:
        return b"M" + struct.pack("<H", v)
    if -(2**31) <= v < 2**31:
        return b"J" + struct.pack("<i", v)
    raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def pstr(s: str) -> bytes:
    data = s.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def glob(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def put(i: int) -> bytes:
    return b"r" + struct.pack("<I", i)


def get(i: int) -> bytes:
    return b"h" + bytes([i]) if i < 256 else b"j" + struct.pack("<I", i)


def memoised_list(items: list[bytes], slot: int) -> bytes:
    """A list of the pickled ``items`` in memo slot ``slot``, popped from the stack."""
    return b"]" + put(slot) + b"(" + b"".join(items) + b"e0"


def repeated_call(func: bytes, arg: bytes, n: int) -> bytes:
    """``func(arg)`` ``n`` times, each of six bytes (``func`` in memo 0, ``arg`` in memo 1), all kept."""
    return b"\x80\x02" + func + put(0) + b"0" + arg + b"(" + (get(0) + get(1) + b"\x85R") * n + b"t."


def flood(op: bytes, n: int) -> bytes:
    return b"\x80\x04(" + op * n + b"t."


# ---------------------------------------------------------------- keys of one hash
HASH_MODULUS = sys.hash_info.modulus  # 2**61 - 1: every multiple of it hashes to 0
_M64 = (1 << 64) - 1
_P1, _P2, _P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261  # CPython's tuplehash (xxHash)


def _lane(acc: int, lane: int) -> int:
    acc = (acc + lane * _P2) & _M64
    acc = ((acc << 31) | (acc >> 33)) & _M64
    return (acc * _P1) & _M64


def colliding_pairs(n: int) -> list[tuple[int, int]]:
    """``n`` pairs of non-negative integers below 2**61 - 1 (each its own hash) whose tuples all hash
    alike: for each ``a``, the ``b`` that brings CPython's tuple hash accumulator to that of (0, 0)."""
    before = (_lane(_lane(_P5, 0), 0) * pow(_P1, -1, 1 << 64)) & _M64
    before = ((before >> 31) | (before << 33)) & _M64
    inverse = pow(_P2, -1, 1 << 64)
    pairs: list[tuple[int, int]] = []
    a = 0
    while len(pairs) < n:
        b = ((before - _lane(_P5, a)) * inverse) & _M64
        if b < HASH_MODULUS:
            pairs.append((a, b))
        a += 1
    assert len({hash(p) for p in pairs[:100]}) == 1, "this Python's tuple hash is not the one these pairs invert"
    return pairs


# ---------------------------------------------------------------- the attacks
def set_over_list(n: int, kind: str = "set") -> bytes:
    """``set(L)`` (or ``frozenset(L)``) ``n`` times, ``L`` one memoised list of 2,048 integers: six bytes,
    a 64 KiB table each."""
    return repeated_call(glob("__builtin__", kind), memoised_list([pint(i) for i in range(256, 2304)], 1), n)


def ordered_dict_over_list(n: int) -> bytes:
    """``OrderedDict(L)`` ``n`` times, ``L`` one memoised list of 2,048 (key, value) pairs."""
    pairs = [pint(i) + pint(i) + b"\x86" for i in range(256, 2304)]
    return repeated_call(glob("collections", "OrderedDict"), memoised_list(pairs, 1), n)


def size_over_list(n: int) -> bytes:
    """``torch.Size(L)`` ``n`` times, ``L`` one memoised list of 8,192 integers: 64 KiB each."""
    return repeated_call(glob("torch", "Size"), memoised_list([b"K\x01"] * 8192, 1), n)


def encode_over_string(n: int) -> bytes:
    """``_codecs.encode(S, "latin1")`` ``n`` times (five bytes each), ``S`` one memoised 64 KiB string."""
    return (b"\x80\x02" + glob("_codecs", "encode") + put(0) + b"0" + pstr("a" * 65536) + pstr("latin1") + b"\x86"
            + put(1) + b"0(" + (get(0) + get(1) + b"R") * n + b"t.")


def path_over_string(n: int) -> bytes:
    """``PosixPath(S)`` ``n`` times, ``S`` one memoised string of 16,384 parts (a DCP index's
    ``checkpoint_id``): a list of the parts and a joined copy each."""
    return (b"\x80\x02" + glob("pathlib", "PosixPath") + put(0) + b"0" + pstr("a/" * 16384) + b"\x85" + put(1)
            + b"0(" + (get(0) + get(1) + b"R") * n + b"t.")


def colliding_ints(n: int, container: str) -> bytes:
    """``n`` integer keys ``k * (2**61 - 1)`` (all hash to 0) in a dict (``SETITEMS``), a set
    (``ADDITEMS``) or ``set(list)``."""
    keys = [pint(k * HASH_MODULUS) for k in range(1, n + 1)]
    if container == "dict":
        return b"\x80\x02}(" + b"".join(k + b"N" for k in keys) + b"u."
    if container == "additems":
        return b"\x80\x04\x8f(" + b"".join(keys) + b"\x90."
    return b"\x80\x02" + glob("__builtin__", "set") + b"](" + b"".join(keys) + b"e\x85R."


def colliding_tuples(n: int) -> bytes:
    """``n`` keys ``(a, b)`` of small integers whose tuple hashes are all one, in a dict."""
    return b"\x80\x02}(" + b"".join(pint(a) + pint(b) + b"\x86N" for a, b in colliding_pairs(n)) + b"u."


def colliding_metadata_indexes(n: int) -> bytes:
    """A DCP ``storage_data``-like dict of ``n`` ``MetadataIndex("w", torch.Size([a, b]))`` keys, the
    sizes' tuple hashes (and so the keys') all one."""
    head = (b"\x80\x02" + glob("torch.distributed.checkpoint.metadata", "MetadataIndex") + put(0) + b"0"
            + glob("torch", "Size") + put(1) + b"0" + pstr("fqn") + put(2) + b"0" + pstr("offset") + put(3) + b"0"
            + pstr("w") + put(4) + b"0")
    key = lambda a, b: (get(0) + b")\x81}(" + get(2) + get(4) + get(3) + get(1) + pint(a) + pint(b) + b"\x86\x85Rub")
    return head + b"}(" + b"".join(key(a, b) + b"N" for a, b in colliding_pairs(n)) + b"u."


STORAGE_FLOATS = 16384  # the storage the views share: 64 KiB


def views_of_one_storage(n: int) -> bytes:
    """``n`` tensors, each a whole view of one 64 KiB storage, of five bytes each (one memoised call)."""
    args = (b"(" + b"(" + pstr("storage") + glob("torch", "FloatStorage") + pstr("0") + pstr("cpu")
            + pint(STORAGE_FLOATS) + b"tQ" + b"K\x00" + pint(STORAGE_FLOATS) + b"\x85K\x01\x85\x89"
            + glob("collections", "OrderedDict") + b")Rt")
    return (b"\x80\x02" + glob("torch._utils", "_rebuild_tensor_v2") + put(0) + b"0" + args + put(1) + b"0("
            + (get(0) + get(1) + b"R") * n + b"t.")


def shared_tuples(depth: int) -> bytes:
    """Pushes ``t[depth]``, ``t[i] = (t[i-1], t[i-1])``: seven bytes a level, 2**depth leaves, which
    ``hash`` and ``repr`` walk all of."""
    out = b"K\x01\x85" + put(0)
    for i in range(1, depth + 1):
        out += b"0" + get(i - 1) + get(i - 1) + b"\x86" + put(i)
    return out


def shared_tuple_key(depth: int) -> bytes:
    return b"\x80\x02}" + shared_tuples(depth) + b"Ns."


def shared_tuple_layout(depth: int) -> bytes:
    return b"\x80\x02" + glob("torch.serialization", "_get_layout") + shared_tuples(depth) + b"\x85R."


def shared_tuple_size(depth: int) -> bytes:
    """A tensor whose size is the shared tuple: refused, and the message must not write it out."""
    return (b"\x80\x02" + glob("torch._utils", "_rebuild_tensor_v2") + b"(" + b"(" + pstr("storage")
            + glob("torch", "FloatStorage") + pstr("0") + pstr("cpu") + b"K\x04tQK\x00" + shared_tuples(depth)
            + b"K\x01\x85\x89" + glob("collections", "OrderedDict") + b")RtR.")


@dataclasses.dataclass(frozen=True)
class Attack:
    name: str
    build: Callable[[int], bytes]
    sizes: tuple[int, ...]
    parsers: tuple[str, ...]
    says: str  # what the refusal names (the budget's "crafted", or the check that stopped it)
    records: dict[str, bytes] | None = None


ARCHIVE, PLAIN, BOTH = ("load_bytes", "load_file"), ("load_pickle",), PARSERS
BUDGET = "crafted or damaged file"
ATTACKS = [
    Attack("set over a memoised list", set_over_list, (1_000, 8_000, 40_000), ARCHIVE, BUDGET),
    Attack("frozenset over a memoised list", lambda n: set_over_list(n, "frozenset"), (1_000, 8_000, 40_000),
           ARCHIVE, BUDGET),
    Attack("OrderedDict over a memoised list", ordered_dict_over_list, (1_000, 8_000, 40_000), BOTH, BUDGET),
    Attack("torch.Size over a memoised list", size_over_list, (1_000, 8_000, 40_000), BOTH, BUDGET),
    Attack("_codecs.encode over a memoised string", encode_over_string, (1_000, 8_000, 40_000), ARCHIVE, BUDGET),
    Attack("PosixPath over a memoised string", path_over_string, (1_000, 8_000, 40_000), PLAIN, BUDGET),
    Attack("EMPTY_SET flood", lambda n: flood(b"\x8f", n), (20_000, 80_000, 240_000), BOTH, BUDGET),
    Attack("EMPTY_DICT flood", lambda n: flood(b"}", n), (20_000, 80_000, 240_000), BOTH, BUDGET),
    # (one byte, a list of 64 bytes or a memo entry of 74, each charged 96: refused from about 70,000 on)
    Attack("EMPTY_LIST flood", lambda n: flood(b"]", n), (80_000, 160_000, 240_000), BOTH, BUDGET),
    Attack("MARK flood", lambda n: b"\x80\x04" + b"(" * n + b"N.", (80_000, 160_000, 240_000), BOTH, BUDGET),
    Attack("MEMOIZE flood", lambda n: b"\x80\x04N" + b"\x94" * n + b".", (80_000, 160_000, 240_000), BOTH, BUDGET),
    Attack("int keys of one hash in SETITEMS", lambda n: colliding_ints(n, "dict"), (1_000, 4_000, 16_000), BOTH,
           "2**61 - 1"),
    Attack("int items of one hash in ADDITEMS", lambda n: colliding_ints(n, "additems"), (1_000, 4_000, 16_000), BOTH,
           "2**61 - 1"),
    Attack("int items of one hash in set(list)", lambda n: colliding_ints(n, "set"), (1_000, 4_000, 16_000), ARCHIVE,
           "2**61 - 1"),
    Attack("tuple keys of one hash in SETITEMS", colliding_tuples, (1_000, 4_000, 16_000), BOTH, "hash"),
    Attack("MetadataIndex keys of one hash", colliding_metadata_indexes, (500, 2_000, 8_000), PLAIN,
           f"more than {unpickler.MAX_EQUAL_HASHES} MetadataIndex keys of one hash"),
    Attack("whole views of one storage", views_of_one_storage, (2_000, 16_000, 50_000), ARCHIVE,
           "bytes of tensors", records={"0": bytes(4 * STORAGE_FLOATS)}),
    Attack("a key of 2**64 shared tuples", shared_tuple_key, (64,), BOTH, "tuple"),
    Attack("a layout named by 2**64 shared tuples", shared_tuple_layout, (64,), PLAIN, "layout"),
    Attack("a tensor sized by 2**64 shared tuples", shared_tuple_size, (64,), ARCHIVE, "size",
           records={"0": bytes(16)}),
]


# ---------------------------------------------------------------- the child process
CHILD = r"""
import ctypes, gc, json, os, sys, threading, time
import torch
from nxd_smp.checkpointing import reader
from nxd_smp.checkpointing.files import Folder
from nxd_smp.core.errors import CheckpointError

parser, spec = sys.argv[1], json.loads(open(sys.argv[2]).read())
trim = ctypes.CDLL("libc.so.6").malloc_trim

def kib(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))

def reader_of(case):
    path = case["path"]
    if parser == "load_file":
        folder = Folder.open(os.path.dirname(path))
        case["source"] = str(folder.where(os.path.basename(path)))
        return lambda: reader.load_file(folder, os.path.basename(path))
    data = open(path, "rb").read()
    source = case["source"]
    if parser == "load_bytes":
        return lambda: reader.load_bytes(data, source)
    return lambda: reader.load_pickle(data, source)

current = {}
def watchdog():  # a case past 1.5 GB or 60 s: reported, and the child ends (one stuck in a C call, the parent ends)
    while True:
        time.sleep(0.02)
        case = current.get("case")
        if case and (kib("VmRSS") - current["before"] > 1_500_000 or time.perf_counter() - current["t"] > 60):
            print(json.dumps({**case, "outcome": "runaway", "growth_mb": (kib("VmHWM") - current["before"]) / 1024,
                              "seconds": time.perf_counter() - current["t"], "message": ""}), flush=True)
            os._exit(3)
threading.Thread(target=watchdog, daemon=True).start()

for i, case in enumerate(spec["warmup"] + spec["cases"]):
    run = reader_of(case)
    if i == len(spec["warmup"]):
        gc.collect()
        gc.freeze()  # (what is loaded by now stays: the collections below then see only the cases' objects)
    gc.collect()
    trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    current.update(before=kib("VmRSS"), t=time.perf_counter(), case=case)
    try:
        run()
        outcome, message = "accepted", ""
    except CheckpointError as e:
        outcome, message = "refused", str(e)
    except BaseException as e:
        outcome, message = type(e).__name__, str(e)
    seconds = time.perf_counter() - current["t"]
    current["case"] = None
    growth = (kib("VmHWM") - current["before"]) / 1024
    print(json.dumps({**case, "outcome": outcome, "message": message[:600], "growth_mb": growth, "seconds": seconds}),
          flush=True)
"""


def write_cases(folder: Path, parser: str, attacks: list[Attack]) -> dict[str, list[dict]]:
    """Each attack ``parser`` reads, at each size, as the file it reads (an archive or a plain
    pickle), and one healthy file to read first (the libraries' first allocations are not a case's):
    the child's spec."""
    folder.mkdir(parents=True, exist_ok=True)
    if parser == "load_pickle":
        warmup = folder / "healthy.metadata"
        warmup.write_bytes(dcp_metadata(folder / "dcp"))
    else:
        warmup = folder / "healthy.pt"
        warmup.write_bytes(saved({"w": torch.ones(4), "opt": adamw_after_steps(), "s": {1, 2}}))
    spec: dict[str, list[dict]] = {"warmup": [{"attack": "warm-up", "n": 0, "path": str(warmup),
                                               "source": str(warmup), "pickle_bytes": 0, "file_bytes": 0}],
                                   "cases": []}
    for i, attack in enumerate(attacks):
        for n in attack.sizes:
            pickled = attack.build(n)
            path = folder / f"{i}_{n}.{'pkl' if parser == 'load_pickle' else 'pt'}"
            path.write_bytes(pickled if parser == "load_pickle" else archive(pickled, attack.records))
            spec["cases"].append({"attack": attack.name, "n": n, "path": str(path),
                                  "source": f"{SOURCE} {i}_{n}",  # (load_file's: the path, as its folder names it)
                                  "pickle_bytes": len(pickled), "file_bytes": path.stat().st_size})
    return spec


def run_child(folder: Path, parser: str, spec: dict[str, list[dict]], timeout: float = 300) -> list[dict]:
    """The child's report: one row a case, in order (a case that ran away ends the list)."""
    (folder / "spec.json").write_text(json.dumps(spec))
    child = run_python(["-c", CHILD, parser, str(folder / "spec.json")], cwd=REPO, timeout=timeout)
    rows = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    assert rows, f"{parser}'s child failed (exit {child.returncode}):\n{child.stderr[-3000:]}"
    return rows


def dcp_metadata(folder: Path) -> bytes:
    """The ``.metadata`` ``dcp.save`` writes for a model, an AdamW state and a step."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    state = {"model": model.state_dict(), "optim": adamw_after_steps(), "step": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    return (folder / ".metadata").read_bytes()


def allowed_mb(row: dict) -> float:
    """What the budget lets a case grow the process by: its parse budget (linear in its pickle) times
    ``PEAK_OVER_UNITS``, the file's own bytes (the storages are read), and the meter's noise."""
    units = unpickler.PARSE_BUDGET_PER_BYTE * row["pickle_bytes"] + unpickler.PARSE_BUDGET_FLOOR
    return (PEAK_OVER_UNITS * units + row["file_bytes"]) / 2**20 + NOISE_MB


def misses(attack: Attack, rows: list[dict]) -> list[str]:
    """What is wrong with one attack's rows: a size not reported (the child ran away or crashed
    there), or a case not refused with a CheckpointError naming its file and the check that stopped
    it, or one that grew the process by ``GROWTH_BOUND_MB`` or more, or by more than its size allows
    (the budget a byte times its size, plus the floor: no slope with n beyond that), or was slow."""
    if [r["n"] for r in rows] != list(attack.sizes):
        return [f"{attack.name}: the child reported the sizes {[r['n'] for r in rows]} of {attack.sizes}"]
    found = []
    for r in rows:
        say = f"{attack.name} at n={r['n']} ({r['pickle_bytes']:,} bytes of pickle)"
        if r["outcome"] != "refused" or r["source"] not in r["message"] or attack.says not in r["message"]:
            found.append(f"{say}: {r['outcome']}, {r['message'][:300]!r}")
        if not r["growth_mb"] < min(GROWTH_BOUND_MB, allowed_mb(r)):
            found.append(f"{say}: grew by {r['growth_mb']:.1f} MB (allowed {min(GROWTH_BOUND_MB, allowed_mb(r)):.1f})")
        if not r["seconds"] < TIME_BOUND_S:
            found.append(f"{say}: took {r['seconds']:.1f} s")
    return found


@pytest.mark.parametrize("parser", PARSERS)
def test_crafted_files_are_refused_before_they_grow(parser, tmp_path):
    """Every attack this entry point reads, at every size, in one child process: refused, and
    within its memory and time (``misses``); the healthy file read first is accepted."""
    attacks = [a for a in ATTACKS if parser in a.parsers]
    rows = run_child(tmp_path, parser, write_cases(tmp_path, parser, attacks))
    assert rows[0]["attack"] == "warm-up" and rows[0]["outcome"] == "accepted", rows[0]
    found = [m for a in attacks for m in misses(a, [r for r in rows if r["attack"] == a.name])]
    assert not found, "\n".join(found)


# ---------------------------------------------------------------- what real files use
def training_checkpoint() -> dict[str, Any]:
    """A model (a tied weight, a LayerNorm), its AdamW state after steps and a OneCycleLR's state."""
    torch.manual_seed(0)
    embed = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = embed.weight
    model = torch.nn.Sequential(embed, torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=100)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randint(0, 50, (4, 8))).square().mean().backward()
        opt.step()
        scheduler.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": scheduler.state_dict(),
            "epoch": 3}


def nxd_optimizer_file() -> dict[str, Any]:
    """torch_xla's ZeRO-1 optimizer file as NxD saves it: state and shapes by parameter number."""
    torch.manual_seed(0)
    shapes = [torch.Size([64, 32]), torch.Size([64]), torch.Size([32, 64]), torch.Size([32])] * 8
    return {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                              "params": list(range(len(shapes)))}],
            "base_state": {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(s.numel() // 4),
                               "exp_avg_sq": torch.rand(s.numel() // 4)} for i, s in enumerate(shapes)},
            "shape_info": dict(enumerate(shapes)),
            "sharded_master_weights": {i: torch.randn(s.numel() // 4) for i, s in enumerate(shapes)}}


def fused_and_slices() -> dict[str, torch.Tensor]:
    """A fused qkv weight saved beside its three slices and a tied copy: its storage viewed twice."""
    fused = torch.randn(96, 32)
    return {"qkv": fused, "q": fused[:32], "k": fused[32:64], "v": fused[64:], "tied": fused}


def sharded_dcp_metadata() -> bytes:
    """A DCP index as 32 ranks' ``dcp.save`` writes it: each tensor in 32 chunks, each chunk's
    ``MetadataIndex`` (a name and a ``torch.Size`` of offsets) a key of ``storage_data``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    tensors, storage = {}, {}
    for t in range(64):
        chunks = [ChunkStorageMetadata(offsets=torch.Size([r * 64, 0]), sizes=torch.Size([64, 128])) for r in range(32)]
        tensors[f"layers.{t}.weight"] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16),
                                                              torch.Size([2048, 128]), chunks)
        for r, chunk in enumerate(chunks):
            storage[MetadataIndex(f"layers.{t}.weight", chunk.offsets, r)] = _StorageInfo(f"__{r}_0.distcp", t * 16384,
                                                                                        16384)
    return pickle.dumps(Metadata(tensors, planner_data={f"layers.{t}.weight": ("layers", str(t)) for t in range(64)},
                                 storage_data=storage))


HEALTHY = {"model + AdamW + OneCycleLR": training_checkpoint, "NxD optimizer file": nxd_optimizer_file,
           "fused weight and its slices": fused_and_slices}


@pytest.mark.parametrize("name", list(HEALTHY))
def test_what_torch_save_writes_reads_as_torch_load_reads_it(name):
    data = saved(HEALTHY[name]())
    same(load_bytes(data, SOURCE), torch.load(io.BytesIO(data), weights_only=True))


def test_dcp_indexes_read_as_pickle_reads_them(tmp_path):
    for data in (dcp_metadata(tmp_path), sharded_dcp_metadata()):
        assert load_pickle(data, SOURCE) == pickle.loads(data)


def test_real_files_use_less_than_half_of_the_parse_budget(monkeypatch, tmp_path):
    """At half the parse budget a byte and no floor, every real file still reads (so each uses less
    than half of it); at a fifth, each is refused (so real files are charged, and this can fail)."""
    archives = [saved(make()) for make in HEALTHY.values()]
    plain = [dcp_metadata(tmp_path), sharded_dcp_metadata()]
    per_byte = unpickler.PARSE_BUDGET_PER_BYTE
    monkeypatch.setattr(unpickler, "PARSE_BUDGET_FLOOR", 0)
    for share, refused in ((2, False), (5, True)):
        monkeypatch.setattr(unpickler, "PARSE_BUDGET_PER_BYTE", per_byte // share)
        for read, data in [(load_bytes, d) for d in archives] + [(load_pickle, d) for d in plain]:
            if refused:
                with pytest.raises(CheckpointError, match="crafted"):
                    read(data, SOURCE)
            else:
                read(data, SOURCE)


def test_views_up_to_their_budget_read_and_past_it_are_refused(monkeypatch):
    """The fused weight and its slices view their storage twice over: they read with two bytes of
    tensors a byte of storage (no floor), not with one."""
    data = saved(fused_and_slices())
    monkeypatch.setattr(reader, "TENSOR_BYTES_FLOOR", 0)
    monkeypatch.setattr(reader, "TENSOR_BYTES_PER_STORAGE_BYTE", 2)
    load_bytes(data, SOURCE)
    monkeypatch.setattr(reader, "TENSOR_BYTES_PER_STORAGE_BYTE", 1)
    with pytest.raises(CheckpointError, match="bytes of tensors"):
        load_bytes(data, SOURCE)


# ---------------------------------------------------------------- keys
@pytest.mark.parametrize("key", [b"K\x01K\x02\x86", glob("torch", "Size") + b"]K\x01a\x85R", pint(HASH_MODULUS),
                                 pint(-HASH_MODULUS), pint(2**64)],
                         ids=["tuple", "torch.Size", "2**61 - 1", "-(2**61 - 1)", "2**64"])
@pytest.mark.parametrize("container", ["SETITEM", "DICT", "ADDITEMS", "FROZENSET", "set()", "OrderedDict()"])
def test_a_key_whose_hash_a_file_can_choose_is_refused_before_insertion(key, container):
    body = {"SETITEM": b"}" + key + b"Ns", "DICT": b"(" + key + b"Nd", "ADDITEMS": b"\x8f(" + key + b"\x90",
            "FROZENSET": b"(" + key + b"\x91", "set()": glob("__builtin__", "set") + b"]" + key + b"a\x85R",
            "OrderedDict()": glob("collections", "OrderedDict") + b"]" + key + b"N\x86a\x85R"}[container]
    with pytest.raises(CheckpointError, match=r"crafted\.pt.*(hash|2\*\*61)"):
        load_bytes(archive(b"\x80\x04" + body + b"."), SOURCE)


@pytest.mark.parametrize("key", [b"K\x05", b"J\xff\xff\xff\xff", pint(HASH_MODULUS - 1), pint(-HASH_MODULUS + 1),
                                 b"G" + struct.pack(">d", 2.5), b"X\x01\x00\x00\x00a", b"C\x01a", b"N", b"\x88",
                                 glob("torch", "bfloat16")],
                         ids=["5", "-1", "2**61 - 2", "-(2**61 - 2)", "2.5", "'a'", "b'a'", "None", "True", "bfloat16"])
def test_keys_of_hashes_a_file_cannot_choose_are_admitted(key):
    value = pickle.loads(b"\x80\x04}" + key + b"Ns.")
    assert load_bytes(archive(b"\x80\x04}" + key + b"Ns."), SOURCE) == value
    assert load_bytes(archive(b"\x80\x04\x8f(" + key + b"\x90."), SOURCE) == set(value)


def test_floats_of_one_hash_are_admitted_up_to_the_limit():
    """``2.0 ** (61 * k)`` all hash to 1: up to ``MAX_EQUAL_HASHES`` in one dict, not one more."""
    floats = [2.0 ** (61 * k) for k in range(-16, 17)]
    assert len({hash(f) for f in floats}) == 1
    keys = lambda n: b"".join(b"G" + struct.pack(">d", f) + b"N" for f in floats[:n])
    limit = unpickler.MAX_EQUAL_HASHES
    assert load_pickle(b"\x80\x04}(" + keys(limit) + b"u.", SOURCE) == dict.fromkeys(floats[:limit])
    with pytest.raises(CheckpointError, match=f"more than {limit} float keys of one hash"):
        load_pickle(b"\x80\x04}(" + keys(limit + 1) + b"u.", SOURCE)


# ---------------------------------------------------------------- numbers and names
@pytest.mark.parametrize("opcode", [b"I", b"L"], ids=["INT", "LONG"])
def test_an_integer_of_more_than_4300_digits_is_a_checkpoint_error(opcode):
    """``int()`` refuses more than 4300 decimal digits (``sys.get_int_max_str_digits``) with a
    ValueError: the reader ends it as a CheckpointError naming the file."""
    text = b"1" * 5000 + (b"L" if opcode == b"L" else b"")
    for load in (lambda d: load_pickle(d, SOURCE), lambda d: load_bytes(archive(d), SOURCE)):
        with pytest.raises(CheckpointError, match=r"crafted\.pt.*4300 digits"):
            load(b"\x80\x02" + opcode + text + b"\n.")
    assert load_pickle(b"\x80\x02I" + b"1" * 4000 + b"\n.", SOURCE) == int("1" * 4000)


def test_a_text_memo_index_is_below_2_32():
    """``PUT`` and ``GET`` with a text index: as the binary ones, below 2**32 (a larger integer key
    could share its hash with every other)."""
    assert load_pickle(b"\x80\x02Np4294967295\n0g4294967295\n.", SOURCE) is None
    for index in (b"4294967296", str(HASH_MODULUS * 3).encode(), b"1" * 5000, b"-1"):
        with pytest.raises(CheckpointError, match=r"crafted\.pt.*memo index"):
            load_pickle(b"\x80\x02Np" + index + b"\n.", SOURCE)


def test_many_records_with_one_name_twice_are_refused_at_once():
    """The duplicate-name scan is linear: 20,000 records and one twice."""
    out = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        warnings.simplefilter("ignore", UserWarning)
        z.writestr("archive/data.pkl", b"\x80\x02N.")
        for i in range(20_000):
            z.writestr(f"archive/data/{i}", b"")
        z.writestr("archive/data/7", b"")
    data = out.getvalue()
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="two records named 'archive/data/7'"):
        load_bytes(data, SOURCE)
    assert time.perf_counter() - start < 2.0


# ---------------------------------------------------------------- the budget itself
def test_a_budget_refuses_at_the_first_overrun_naming_its_source():
    budget = Budget(100, "f.pt", "bytes")
    budget.charge(60)
    budget.charge(40)
    assert (budget.used, budget.left) == (100, 0)
    with pytest.raises(BudgetError, match=r"f\.pt asks for more than 100 bytes .*crafted") as error:
        budget.charge(1)
    assert isinstance(error.value, CheckpointError)
    linear = Budget.linear(1000, "g.pkl", per_byte=3, floor=7, counted="its pickle")
    assert linear.limit == 3007
    linear.charge(3007)
    with pytest.raises(BudgetError, match=r"g\.pkl .*3 per byte of its pickle, 1,000 bytes, plus 7"):
        linear.charge(1)
    with pytest.raises(ValueError):
        Budget(-1, "f.pt")


# ---------------------------------------------------------------- the typed JSON
def _typed_dict(keys: list) -> bytes:
    import json

    from nxd_smp.checkpointing.typed_json import encode

    return json.dumps({"$dict": [[encode(k, lambda t: "x"), 0] for k in keys]}).encode()


@pytest.mark.parametrize("n", [2_000, 20_000])
def test_a_typed_json_dict_of_keys_whose_hashes_collide_is_refused_before_it_is_built(n):
    """Tuples of chosen ints, and ints of 2**61 and more, can be made to hash alike: one dict of a file
    holds at most 1024 such keys, refused in time linear in the file whatever ``n``."""
    import time

    from nxd_smp.checkpointing.typed_json import decode, loads

    colliding = [(k * ((1 << 61) - 1), 0) for k in range(n)]  # (every first item hashes to 0)
    data = _typed_dict(colliding)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="more than 1024 keys"):
        decode(loads(data, "f.json"), lambda key: None, "f.json", size=len(data))
    assert time.perf_counter() - start < 2.0
    safe = _typed_dict(list(range(n)))  # ints below 2**61: distinct hashes, any number of them
    assert len(decode(loads(safe, "g.json"), lambda key: None, "g.json", size=len(safe))) == n


def test_typed_json_decoding_is_charged_to_its_budget():
    """The decoder charges every node to a budget linear in the file: a file that could decode into more
    than its budget (as a forged size argument makes it) stops at the first overrun."""
    import json

    from nxd_smp.checkpointing.typed_json import decode, loads

    data = json.dumps([[0] * 100 for _ in range(1000)]).encode()
    assert len(decode(loads(data, "f.json"), lambda key: None, "f.json", size=len(data))) == 1000
    with pytest.raises(CheckpointError, match="f.json asks for more than"):
        decode(loads(data, "f.json"), lambda key: None, "f.json", size=len(data) // 100)
