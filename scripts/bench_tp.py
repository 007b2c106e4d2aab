#!/usr/bin/env python
"""Tensor parallelism + ZeRO-1 (nxd_smp) against FSDP2, on 4 gloo ranks on this machine's CPU.

A measurement, with no target. Both sides train the same bf16 MLP (``--layers`` blocks of Linear
width -> 4 width, GELU (tanh), Linear 4 width -> width; block i seeded with i), AdamW, the global
gradient norm clipped at 1.0, ``--micro`` micro-batches of 16 x width per iteration:

* nxd_smp: the blocks parallelized with DTensor over the mesh's ``tp`` dimension (the first
  Linear ``ColwiseParallel``, the second ``RowwiseParallel``), ``Zero1Optimizer(...,
  device_mesh=mesh)`` on the mesh ``("dp", "tp") = (2, 2)``: ZeRO-1 over ``dp``, its defaults
  (fp32 master weights, fp32 Adam states, fp32 gradient accumulation in ``main_grad`` buffers).
* FSDP2 (``--fsdp 2d``, the default): the same tensor parallelism over ``tp``, then
  ``fully_shard`` per block and at the root over ``dp``, ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``, fp32 parameters held sharded, ``torch.optim.AdamW(foreach=True)`` and
  ``clip_grad_norm_(max_norm=1.0)``. This is the fair pairing: both sides run the same
  tensor-parallel forward and backward on the same 16 rows per rank and differ only in how they
  shard over ``dp`` (ZeRO-1 against ZeRO-3) and in the optimizer. ``--fsdp 1d`` shards the plain
  model over all 4 ranks instead, each rank taking 8 of its data-parallel rank's 16 rows (the same
  global batch, the same loss).

Each rank's data: micro-batch m of iteration i is drawn from seed ``(i, dp rank, m)``.

Measured, per side:
* time: every iteration runs both sides, A/B then B/A, in the same 4 processes; forward + backward
  of the micro-batches and the step (FSDP2: clip, step; both: zero_grad) timed apart, each after a
  ``dist.barrier()``, as the slowest rank saw them; medians after ``--warmup`` iterations, and the
  median and quartiles of the per-iteration ratios nxd_smp / FSDP2;
* held bytes: after the last backward of an iteration (before the step) and after the step, every
  tensor the side's model and optimizer hold, found by walking them (parameters and their
  gradients, the optimizer's state, nxd_smp's buffers and masters, FSDP2's parameter states),
  counted once per storage (``untyped_storage().nbytes()``, deduplicated by ``data_ptr``), per rank
  (the largest), over the model's parameter count;
* peak bytes (unless ``--no-peak``): VmHWM per rank (the largest) as a slope over ``--layers`` and
  twice as many, each depth and side in 4 ranks of their own;
* bytes sent: one iteration (forward, backward, step) under a ``TorchDispatchMode`` that sees every
  collective at the dispatcher, both ``torch.distributed``'s (the ``c10d::*`` ops behind
  ``all_reduce``, ``reduce_scatter_tensor``, ``all_gather_into_tensor``, ... ) and the functional
  ones DTensor issues (``_c10d_functional::*``); converted to a ring's bytes sent per rank:
  (N-1)/N of the buffer for all-gather and reduce-scatter, 2(N-1)/N for all-reduce.

    python scripts/bench_tp.py --out docs/bench_tp.json
    python scripts/bench_tp.py --width 64 --layers 2 --iters 2 --warmup 1 --no-peak   # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
import types
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from memory_slope import check_sizes, rss_bytes, slope  # noqa: E402

DP, TP, WORLD = 2, 2, 4
ROWS = 16  # rows of a micro-batch per data-parallel rank
LR, WEIGHT_DECAY, MAX_NORM = 1e-4, 0.01, 1.0
SIDES = ("nxd_smp", "fsdp2")


def params_of(width: int, layers: int) -> int:
    return layers * (2 * 4 * width * width + 4 * width + width)


# ---------------------------------------------------------------------------- the model, both sides
def block(width: int, index: int) -> nn.Sequential:
    """Block ``index`` in fp32, the same on both sides and every rank."""
    torch.manual_seed(index)
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def build_nxd_smp(mesh, a: dict):
    """A block at a time (the full fp32 block is freed once parallelized: no whole-model transient)."""
    from torch.distributed.tensor.parallel import parallelize_module

    import nxd_smp

    model = nn.Sequential(*[parallelize_module(block(a["width"], i).to(torch.bfloat16), mesh["tp"], tp_plan())
                            for i in range(a["layers"])])
    opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY,
                                 max_norm=MAX_NORM, device_mesh=mesh)

    def step() -> torch.Tensor:
        opt.step()
        opt.zero_grad()
        return opt.grad_norm

    return model, opt, step


def build_fsdp2(mesh, a: dict):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_mesh = mesh["dp"] if a["fsdp"] == "2d" else init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    blocks = []
    for i in range(a["layers"]):
        b = block(a["width"], i)
        if a["fsdp"] == "2d":
            b = parallelize_module(b, mesh["tp"], tp_plan())
        blocks.append(fully_shard(b, mesh=shard_mesh, mp_policy=policy))
    model = fully_shard(nn.Sequential(*blocks), mesh=shard_mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)

    def step() -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        return norm

    return model, opt, step


BUILDERS = {"nxd_smp": build_nxd_smp, "fsdp2": build_fsdp2}


def batches(a: dict, side: str, it: int, rank: int) -> list[torch.Tensor]:
    """This rank's micro-batches of iteration ``it``: its data-parallel rank's 16 rows (FSDP2 over all
    4 ranks: half of them, so that the global batch is the same)."""
    dp, tp = divmod(rank, TP)
    out = []
    for m in range(a["micro"]):
        g = torch.Generator().manual_seed(1_000_000 * it + 1000 * dp + m)
        x = torch.randn(ROWS, a["width"], generator=g).bfloat16()
        if side == "fsdp2" and a["fsdp"] == "1d":
            x = x[tp * ROWS // TP:(tp + 1) * ROWS // TP].contiguous()
        out.append(x)
    return out


def as_float(norm: torch.Tensor) -> float:
    """A step's gradient norm, read after the timed region (FSDP2's is a DTensor: a collective)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def forward_backward(model: nn.Module, xs: list[torch.Tensor]) -> None:
    for x in xs:
        model(x).float().pow(2).mean().backward()


# ---------------------------------------------------------------------------- held bytes
_WALKED_PREFIXES = ("nxd_smp", "torch.nn", "torch.optim", "torch.distributed")
_SKIPPED = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
            types.CodeType, types.FrameType)


def held_bytes(*roots) -> dict:
    """The bytes of every tensor reachable from ``roots`` through containers and the attributes of
    torch's and nxd_smp's objects (functions, hooks and modules not followed), each storage once."""
    from torch.distributed._composable_state import _get_module_state
    from torch.distributed.tensor import DTensor

    seen, storages = set(), {}
    stack = list(roots)
    while stack:
        o = stack.pop()
        if o is None or isinstance(o, (str, bytes, int, float, bool, torch.dtype, torch.device)) or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if isinstance(o, DTensor):
                stack.append(o._local_tensor)
            elif o.device.type != "meta":
                s = o.untyped_storage()
                storages.setdefault(s.data_ptr() or id(s), (s.nbytes(), o.dtype))
            stack.append(o.grad)
            stack.extend(getattr(o, "__dict__", {}).values())  # (main_grad and the like)
            continue
        if isinstance(o, _SKIPPED) or callable(o) and not isinstance(o, (nn.Module, torch.optim.Optimizer)):
            continue
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)) or type(o).__name__ == "deque":
            stack.extend(o)
        elif type(o).__module__.startswith(_WALKED_PREFIXES):
            stack.extend(getattr(o, "__dict__", {}).values())
            for cls in type(o).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    stack.append(getattr(o, name, None))
            if isinstance(o, nn.Module):
                stack.append(_get_module_state(o))
    by_dtype: dict[str, int] = defaultdict(int)
    for nbytes, dtype in storages.values():
        by_dtype[str(dtype).replace("torch.", "")] += nbytes
    return {"bytes": sum(by_dtype.values()), "by_dtype": dict(by_dtype), "storages": len(storages)}


# ---------------------------------------------------------------------------- bytes sent
def _collective_table() -> dict:
    """Dispatcher op -> (kind, where its tensors are, how the group is named)."""
    c10d, funcol = torch.ops.c10d, torch.ops._c10d_functional
    table = {}
    for name, kind in (("allreduce_", "all_reduce"), ("allreduce_coalesced_", "all_reduce"),
                       ("_allgather_base_", "all_gather"), ("allgather_", "all_gather"),
                       ("allgather_coalesced_", "all_gather"), ("allgather_into_tensor_coalesced_", "all_gather"),
                       ("_reduce_scatter_base_", "reduce_scatter"), ("reduce_scatter_", "reduce_scatter"),
                       ("reduce_scatter_tensor_coalesced_", "reduce_scatter"), ("broadcast_", "broadcast"),
                       ("alltoall_", "all_to_all"), ("alltoall_base_", "all_to_all")):
        if hasattr(c10d, name):
            table[getattr(c10d, name)] = (kind, "c10d")
    for name, kind in (("all_reduce", "all_reduce"), ("all_reduce_", "all_reduce"),
                       ("all_reduce_coalesced", "all_reduce"), ("all_reduce_coalesced_", "all_reduce"),
                       ("all_gather_into_tensor", "all_gather"), ("all_gather_into_tensor_out", "all_gather"),
                       ("all_gather_into_tensor_coalesced", "all_gather"),
                       ("reduce_scatter_tensor", "reduce_scatter"), ("reduce_scatter_tensor_coalesced", "reduce_scatter"),
                       ("broadcast", "broadcast"), ("broadcast_", "broadcast"), ("all_to_all_single", "all_to_all")):
        if hasattr(funcol, name):
            table[getattr(funcol, name)] = (kind, "funcol")
    return table


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


class SendCounter:
    """Ring bytes each collective sends from this rank, by kind; see ``__torch_dispatch__``."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        table, counter = _collective_table(), self
        self.sent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.buffer: dict[str, int] = defaultdict(int)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
                if any(t is not torch.Tensor and issubclass(t, torch.Tensor) for t in types_):
                    return NotImplemented  # (a DTensor: its local ops, funcols included, come back here)
                kwargs = kwargs or {}
                entry = table.get(func._overloadpacket)
                if entry is not None:
                    counter.record(func, entry, args, kwargs)
                return func(*args, **kwargs)

        self.mode = Mode()

    def record(self, func, entry, args, kwargs) -> None:
        from torch.distributed.distributed_c10d import _resolve_process_group

        kind, family = entry
        schema = [a.name for a in func._schema.arguments]
        named = dict(zip(schema, args)) | kwargs
        if family == "c10d":
            n = dist.ProcessGroup.unbox(named["process_group"]).size()
            # the full buffer: all-gather's outputs, reduce-scatter's inputs, all-reduce's tensors
            full = sum(t.nbytes for t in _tensors(args[1] if kind == "reduce_scatter" else args[0]))
        else:
            n = _resolve_process_group(named["group_name"]).size()
            local = sum(t.nbytes for t in _tensors(args[0]))
            full = local * n if kind == "all_gather" else local
        factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}.get(
            kind, (n - 1) / n)
        label = f"{kind}/{n}"
        self.sent[label] += factor * full
        self.buffer[label] += full
        self.calls[label] += 1

    def total(self) -> float:
        return sum(self.sent.values())

    def snapshot(self) -> dict:
        return {"sent": dict(self.sent), "buffer_bytes": dict(self.buffer), "calls": dict(self.calls),
                "total": self.total()}


# ---------------------------------------------------------------------------- rank bodies
def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


def timing_rank(rank: int, a: dict) -> dict:
    mesh = _mesh()
    built = {side: BUILDERS[side](mesh, a) for side in SIDES}
    times = {side: {"fwd_bwd": [], "step": []} for side in SIDES}
    norms = {side: [] for side in SIDES}
    for it in range(a["warmup"] + a["iters"]):
        order = SIDES if it % 2 == 0 else SIDES[::-1]
        for side in order:
            model, _, step = built[side]
            xs = batches(a, side, it, rank)
            dist.barrier()
            t0 = time.perf_counter()
            forward_backward(model, xs)
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            norm = step()
            t3 = time.perf_counter()
            norms[side].append(as_float(norm))
            if it >= a["warmup"]:
                times[side]["fwd_bwd"].append(t1 - t0)
                times[side]["step"].append(t3 - t2)
    # one more iteration of each side, not timed: the bytes sent, and the bytes held at the step and after
    sends, held = {}, {}
    for side in SIDES:
        model, opt, step = built[side]
        xs = batches(a, side, a["warmup"] + a["iters"], rank)
        gc.collect()
        dist.barrier()
        fb, st = SendCounter(), SendCounter()
        with fb.mode:
            forward_backward(model, xs)
        held_at_step = held_bytes(model, opt)
        with st.mode:
            step()
        gc.collect()
        held[side] = {"at_step": held_at_step, "after_step": held_bytes(model, opt)}
        sends[side] = {"fwd_bwd": fb.snapshot(), "step": st.snapshot(), "total": fb.total() + st.total()}
    return {"times_s": times, "grad_norms": norms, "sent": sends, "held": held,
            "local_params": {side: sum(p.numel() for p in built[side][0].parameters()) for side in SIDES}}


def peak_rank(rank: int, a: dict) -> dict:
    """One side alone, in ranks of its own: VmHWM after two iterations (the second runs forward and
    backward with every state allocated, and steps)."""
    model, _, step = BUILDERS[a["side"]](_mesh(), a)
    for it in range(2):
        forward_backward(model, batches(a, a["side"], it, rank))
        step()
    gc.collect()
    return {"peak_bytes": rss_bytes("VmHWM"), "params": params_of(a["width"], a["layers"])}


def _entry(rank: int, port: int, body: str, a: dict, out_dir: str) -> None:
    torch.set_num_threads(1)  # 4 ranks on a few cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    try:
        result = {"result": globals()[body](rank, a)}
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    if "error" in result:
        raise RuntimeError(result["error"])
    dist.barrier()  # (nobody tears the group down under another rank's last collective)
    dist.destroy_process_group()


def launch(body: str, a: dict) -> list[dict]:
    """``body(rank, a)`` on 4 freshly spawned gloo ranks; their results, by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_entry, args=(port, body, a, out_dir), nprocs=WORLD, join=True, start_method="spawn")
        except mp.ProcessRaisedException:
            pass  # (the rank's own traceback is read below)
        results = []
        for rank in range(WORLD):
            path = os.path.join(out_dir, f"{rank}.pt")
            saved = torch.load(path, weights_only=False) if os.path.exists(path) else {"error": "no result"}
            if "error" in saved:
                raise SystemExit(f"rank {rank} of {body} failed:\n{saved['error']}")
            results.append(saved["result"])
        return results


# ---------------------------------------------------------------------------- the report
def quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0]] * 3
    return statistics.quantiles(values, n=4)


def summarize(ranks: list[dict], a: dict) -> dict:
    n = params_of(a["width"], a["layers"])
    out = {}
    slowest = {side: {part: [max(r["times_s"][side][part][i] for r in ranks) * 1e3 for i in range(a["iters"])]
                      for part in ("fwd_bwd", "step")} for side in SIDES}
    for side in SIDES:
        fb, st = slowest[side]["fwd_bwd"], slowest[side]["step"]
        it = [x + y for x, y in zip(fb, st)]
        held = {when: max(r["held"][side][when]["bytes"] for r in ranks) for when in ("at_step", "after_step")}
        out[side] = {
            "iter_ms_median": statistics.median(it), "step_ms_median": statistics.median(st),
            "fwd_bwd_ms_median": statistics.median(fb), "iter_ms": it, "step_ms": st, "fwd_bwd_ms": fb,
            "held_bytes_per_param": held["at_step"] / n, "held_bytes_per_param_after_step": held["after_step"] / n,
            "held_by_dtype_rank0": ranks[0]["held"][side],
            "sent_bytes_per_iteration": max(r["sent"][side]["total"] for r in ranks),
            "sent_fwd_bwd_bytes": max(r["sent"][side]["fwd_bwd"]["total"] for r in ranks),
            "sent_step_bytes": max(r["sent"][side]["step"]["total"] for r in ranks),
            "sent_by_kind_rank0": ranks[0]["sent"][side],
            "first_grad_norm": ranks[0]["grad_norms"][side][0],
            "local_params_rank0": ranks[0]["local_params"][side],
        }
        out[side]["sent_bytes_per_param"] = out[side]["sent_bytes_per_iteration"] / n
    ratios = {}
    for key in ("iter_ms", "step_ms", "fwd_bwd_ms"):
        per_pair = [x / y for x, y in zip(out["nxd_smp"][key], out["fsdp2"][key])]
        q1, med, q3 = quartiles(per_pair)
        ratios[key] = {"median": statistics.median(per_pair), "quartiles": [q1, q3], "per_pair": per_pair}
    return {"sides": out, "ratios": ratios, "params": n}


def floors(a: dict) -> dict:
    """Bytes per parameter per rank each side must hold at the step (gradients present)."""
    fsdp = (4 + 4 + 8) / WORLD  # fp32 parameters, fp32 gradients, Adam states: all sharded over 4 ranks
    return {"nxd_smp": (2 + 4) / TP + (4 + 8) / (TP * DP), "fsdp2": fsdp}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4, help="blocks (the peak's slope also runs twice as many)")
    p.add_argument("--micro", type=int, default=2, help="micro-batches per iteration")
    p.add_argument("--iters", type=int, default=8, help="timed iterations (pairs)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--fsdp", choices=("2d", "1d"), default="2d",
                   help="2d: FSDP2 over dp with the same TP over tp (default); 1d: FSDP2 over all 4 ranks, no TP")
    p.add_argument("--no-peak", action="store_true", help="skip the VmHWM slope (4 more launches)")
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_tp.json"))
    a = p.parse_args()
    if min(a.width, a.layers, a.micro, a.iters) < 1 or a.warmup < 1:
        p.error("--width, --layers, --micro and --iters must be positive, --warmup >= 1")
    if not a.no_peak:
        try:
            check_sizes(params_of(a.width, a.layers), params_of(a.width, 2 * a.layers))
        except ValueError as e:
            p.error(f"{e} Or pass --no-peak.")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # glibc returns large frees (the peak's meter)
    settings = {"width": a.width, "layers": a.layers, "micro": a.micro, "iters": a.iters, "warmup": a.warmup,
                "fsdp": a.fsdp}

    started = time.perf_counter()
    summary = summarize(launch("timing_rank", settings), settings)
    print(f"  timing: {time.perf_counter() - started:.0f} s", flush=True)
    sides = summary["sides"]
    peak = {}
    if not a.no_peak:
        for side in SIDES:
            small, large = (max(launch("peak_rank", {**settings, "layers": layers, "side": side}),
                                key=lambda r: r["peak_bytes"]) for layers in (a.layers, 2 * a.layers))
            peak[side] = {"small": small, "large": large,
                          "bytes_per_param": slope(small["peak_bytes"], small["params"], large["peak_bytes"],
                                                   large["params"])}
            sides[side]["peak_bytes_per_param"] = peak[side]["bytes_per_param"]
            print(f"  {side} peak: {peak[side]['bytes_per_param']:.2f} bytes/param ({time.perf_counter() - started:.0f} s)",
                  flush=True)
    floor = floors(settings)
    n = summary["params"]
    fsdp_label = ("FSDP2 over dp=2 + the same TP over tp=2 (2-D)" if a.fsdp == "2d"
                  else "FSDP2 over all 4 ranks, no TP (1-D)")
    report = [
        f"bf16 MLP {a.layers} x ({a.width} -> {4 * a.width} -> {a.width}), {n / 1e6:.1f}M parameters, {a.micro} "
        f"micro-batch(es) of {ROWS} x {a.width} per data-parallel rank, AdamW, clip 1.0; 4 gloo ranks on "
        f"{os.cpu_count()} CPU cores (1 thread each), torch {torch.__version__}; medians of {a.iters} iterations "
        f"after {a.warmup} warm-up, both sides alternating A/B, B/A in the same ranks, slowest rank per iteration",
        f"nxd_smp: DTensor TP over tp=2, Zero1Optimizer over dp=2 (fp32 masters, states, accumulation); FSDP2: "
        f"{fsdp_label}, MixedPrecisionPolicy(bf16, fp32 reduce), fp32 sharded parameters, AdamW(foreach), "
        f"clip_grad_norm_",
        "",
        "| side | iteration ms | step ms | fwd+bwd ms | held bytes/param/rank at the step (after) [floor] | "
        "peak bytes/param/rank (VmHWM slope) | MB sent per iteration per rank (fwd+bwd / step) | "
        "sent bytes/param | first grad norm |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for side, label in (("nxd_smp", "nxd_smp TP2 x ZeRO-1 DP2"), ("fsdp2", f"FSDP2 {a.fsdp}")):
        s = sides[side]
        peak_cell = f"{s['peak_bytes_per_param']:.2f}" if "peak_bytes_per_param" in s else "not measured (--no-peak)"
        report.append(
            f"| {label} | {s['iter_ms_median']:.1f} | {s['step_ms_median']:.1f} | {s['fwd_bwd_ms_median']:.1f} | "
            f"{s['held_bytes_per_param']:.2f} ({s['held_bytes_per_param_after_step']:.2f}) [{floor[side]:.1f}] | "
            f"{peak_cell} | {s['sent_bytes_per_iteration'] / 1e6:.1f} ({s['sent_fwd_bwd_bytes'] / 1e6:.1f} / "
            f"{s['sent_step_bytes'] / 1e6:.1f}) | {s['sent_bytes_per_param']:.2f} | {s['first_grad_norm']:.4f} |")
    r = summary["ratios"]
    report += [
        "",
        "nxd_smp / FSDP2 per iteration pair, median [quartiles]: "
        + ", ".join(f"{name} {r[key]['median']:.2f} [{r[key]['quartiles'][0]:.2f}, {r[key]['quartiles'][1]:.2f}]"
                    for name, key in (("iteration", "iter_ms"), ("step", "step_ms"), ("fwd+bwd", "fwd_bwd_ms"))),
        "step ms: nxd_smp's step reduce-scatters the fp32 accumulation, clips and all-gathers; FSDP2's reduce-scatters "
        "ran in each backward, its step is clip + AdamW: compare iterations",
        "held: every tensor reachable from each side's model and optimizer, each storage once, largest rank, over "
        f"{n / 1e6:.1f}M parameters; floor nxd_smp (2 + 4)/TP + 12/(TP x DP), FSDP2 16/4"
        + ("" if peak else "; peak not measured (--no-peak): held bytes only"),
        "sent: every c10d and functional collective seen at the dispatcher in one iteration (forward, backward, "
        "step), as ring bytes: (N-1)/N of the buffer (all-gather, reduce-scatter), 2(N-1)/N (all-reduce)",
    ]
    print("\n".join(report))
    result = {"command": " ".join(sys.argv), "report": report, "results": sides, "ratios": summary["ratios"],
              "peak": peak, "floors": floor, "params": n, "wall_s": time.perf_counter() - started,
              "cpus": os.cpu_count(), "torch": torch.__version__,
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
