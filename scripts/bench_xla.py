#!/usr/bin/env python
"""nxd_smp against torch_xla's ZeroRedundancyOptimizer as NxD ships it, on the XLA CPU device
at DP 1 and on 2 and 4 (or 8) CPU replicas, in one run.

Both optimizers train the same bf16 MLP (tanh) with AdamW and ``max_norm=1.0`` under the same
replica harness (``tests/xla_replicas.py``: one process, a thread per replica). nxd_smp has the
README's defaults; torch_xla's optimizer gets the settings NxD's ``initialize_parallel_optimizer``
passes for SMP: fp32 optimizer dtype, ``use_grad_acc_hook``, ``higher_cc_precision``,
``save_master_weights``, ``pin_layout=False``, bucket caps 130 MB (reduce-scatter) and
``max(1, 130 // dp)`` MB (all-gather).

At DP 1 torch_xla's optimizer runs untouched. At DP > 1 the XLA CPU device forces one change:
its replicas meet in a collective only by the collective's channel id, which torch-xla 2.9's
coalesced collectives (and ``xm.all_reduce``) cannot carry. So there, and only there, the
baseline's collectives are issued one tensor at a time with a channel id (torch_xla's own
single-tensor ``xm.reduce_scatter`` / ``xm.all_gather``; its norm's all-reduce as an all-gather
and a sum), each after the previous one (XLA:CPU replicas otherwise run them in orders of their
own); nothing else changes. Every DP > 1 figure of the baseline carries that change.

**Time** (one process per DP size): each replica builds both optimizers, each over its own copy
of the model (``--time-layers`` deep), and times whole iterations (``--micro`` micro-batches of
16 rows, then ``step()`` and ``zero_grad()``) in two loop shapes:

* ``nxd_loop``: ``torch_xla.sync()`` after each micro-batch, the step in the last micro-batch's
  graph (NxD's training scripts);
* ``one_graph``: no sync between micro-batches: forward, backward and step in one graph.

After ``--warmup`` iterations of each, ``--pairs`` pairs alternate nxd_smp/torch_xla and
torch_xla/nxd_smp (every replica waits at a barrier before each iteration); the ratio is the
median of the per-pair ratios nxd_smp / torch_xla, with their quartiles. The last graph of each
iteration (the step's) is hashed on every replica: one program for every rank means one hash;
its HLO instruction count is reported at DP 1 (at DP > 1 the baseline's collectives are split).

**Memory** (separate processes): peak resident memory per parameter on each rank, as a slope
over two model depths (``--layers``) run in separate processes (docs/design.md, "How
performance is measured"): (peak_b - peak_a) / (params_b - params_a) / dp, for torch_xla and
nxd_smp with each memory option; each of those runs syncs forward+backward and the step apart,
and counts graph compilations after warm-up.

Prints the tables and writes JSON (``--out``).

    python scripts/bench_xla.py --out docs/bench_xla.json        # DP 1 2 4
    python scripts/bench_xla.py --dp 1 --pairs 20                 # DP 1, more pairs
    python scripts/bench_xla.py --width 64 --layers 2 4 --time-layers 2 --dp 1 2 --pairs 2 --iters 2 --warmup 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from memory_slope import check_depths, slope  # noqa: E402

TARGETS = {"nxd_loop": 0.7, "one_graph": 0.7, "memory_ratio": 0.8}
#: The memory options' targets against torch_xla as shipped: DP 1 with the settings the README
#: recommends for Trainium (sharded accumulation), DP 4 with sharded accumulation and remainders.
OPTION_TARGETS = {"dp1_memory_ratio": 0.55, "dp4_memory_ratio": 0.6}
TRAINIUM = "nxd_smp_sharded_acc"
#: nxd_smp's memory options per kind (mixed_precision_config keys beyond NxD's three).
OPTIONS = {
    "nxd_smp": {},
    "nxd_smp_sharded_acc": {"use_sharded_grad_acc": True},
    "nxd_smp_remainders": {"use_param_remainders": True},
    "nxd_smp_both": {"use_sharded_grad_acc": True, "use_param_remainders": True},
}
KINDS = ("torch_xla", *OPTIONS)


def theory(kind: str, world: int) -> float:
    """Bytes per parameter per rank the kind must hold at its peak: the bf16 parameter (2) and
    the bf16 gradient backward produces (2), the fp32 accumulation (4, or 4/N sharded), and
    the sharded master and Adam states (12/N, or 10/N with 2-byte remainders for masters)."""
    options = OPTIONS.get(kind, {})
    accumulation = 4 / world if options.get("use_sharded_grad_acc") else 4
    state = (10 if options.get("use_param_remainders") else 12) / world
    return 2 + 2 + accumulation + state
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%\S+ = ", re.M)


def hlo_instructions(hlo: str) -> int:
    """Instructions in an HLO module's text, every computation included."""
    return len(_INSTRUCTION.findall(hlo))


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class MatmulLayer(torch.nn.Module):
    """``tanh(x @ W + b)`` with ``W`` stored ``[in, out]``: its weight gradient leaves the dot
    untransposed (``nn.Linear``'s reaches the optimizer through a transpose: docs/trainium.md)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, width) / width**0.5)
        self.bias = torch.nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight + self.bias)


#: The models the time can be measured on: ``nn.Linear`` layers, or the same MLP as ``x @ W``.
MODELS = ("linear", "matmul")


def make_model(width: int, layers: int, model: str = "linear") -> torch.nn.Module:
    torch.manual_seed(0)
    if model == "matmul":
        return torch.nn.Sequential(*(MatmulLayer(width) for _ in range(layers))).to(torch.bfloat16)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(layers)]
    return torch.nn.Sequential(*blocks).to(torch.bfloat16)


def build(kind: str, model: torch.nn.Module, world: int):
    if kind == "torch_xla":
        from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

        if world > 1:
            from tests.xla_replicas import split_torch_xla_collectives_per_tensor

            split_torch_xla_collectives_per_tensor()  # forced by XLA:CPU replicas; untouched at DP 1
        cap = 130  # NxD's bucket caps
        return ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, optimizer_dtype=torch.float32, grad_clipping=True,
            max_norm=1.0, pin_layout=False, bucket_cap_mb_reduce_scatter=cap,
            bucket_cap_mb_all_gather=max(1, cap // world), use_grad_acc_hook=True,
            higher_cc_precision=True, save_master_weights=True, lr=1e-4,
        )
    import nxd_smp

    cfg = nxd_smp.neuronx_distributed_config(
        optimizer_config={"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0},
        mixed_precision_config={"use_master_weights": True, "use_fp32_grad_acc": True, **OPTIONS[kind]},
    )
    return nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.AdamW, model.parameters(), lr=1e-4)


def replica(rank: int, world: int, kind: str, width: int, layers: int, iters: int, warmup: int,
            micro: int = 1) -> dict[str, Any]:
    """One replica's run (called by tests/xla_replicas.py in the benchmark's child process)."""
    import torch_xla
    import torch_xla.debug.metrics as met

    from nxd_smp.backend.xla import restart_channel_ids
    from tests.xla_replicas import barrier, serial, sync, wait_for_device

    device = torch_xla.device()
    with serial:
        model = make_model(width, layers)
    model = model.to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = build(kind, model, world)
    sync()
    g = torch.Generator().manual_seed(rank)
    data = [[torch.randn(16, width, generator=g).bfloat16() for _ in range(micro)] for _ in range(warmup + iters)]
    times, hlo, marks = [], None, {}
    for i, batches in enumerate(data):
        barrier()
        start = time.perf_counter()
        for x in batches:  # the micro-batches' forward+backward: one graph
            model(x.to(device)).float().pow(2).mean().backward()
        sync()
        restart_channel_ids()  # nxd_smp does this in step(); the same for torch_xla's optimizer
        opt.step()
        opt.zero_grad()
        if i == warmup:
            hlo = torch_xla._XLAC._get_xla_tensors_hlo(
                [p for p in model.parameters()] + [t for t in _optimizer_tensors(opt)])
        sync()
        wait_for_device()
        barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if i + 1 == warmup:
            marks = {"compiles": (met.metric_data("CompileTime") or [0])[0]}
    compile_data = met.metric_data("CompileTime") or [0, 0]
    barrier()
    return {
        "params": params,
        "iter_ms": statistics.median(times) * 1e3,
        "compiles": compile_data[0],
        "compiles_after_warmup": compile_data[0] - marks["compiles"],
        "compile_s": compile_data[1] / 1e9,
        "step_hlo_instructions": hlo_instructions(hlo),
        "step_hlo_sha": hashlib.sha256(hlo.encode()).hexdigest(),
        "peak_rss": peak_rss(),
    }


#: The loop shapes the time is measured in (``paired``): what is synced within an iteration.
SHAPES = {
    "nxd_loop": "torch_xla.sync() after each micro-batch, the step in the last one's graph (NxD's scripts)",
    "one_graph": "no sync between micro-batches: forward, backward and step in one graph",
}
PAIRED = ("nxd_smp", "torch_xla")  # the ratio's numerator, then its denominator


def paired(rank: int, world: int, width: int, layers: int, pairs: int, warmup: int, micro: int,
           shapes: list[str], model_kind: str = "linear") -> dict[str, Any]:
    """One replica's timing run (called by tests/xla_replicas.py): both optimizers in this
    process, alternating, in each loop shape."""
    import torch_xla
    import torch_xla.debug.metrics as met

    from nxd_smp.backend.xla import restart_channel_ids
    from tests.xla_replicas import barrier, serial, sync, wait_for_device

    device = torch_xla.device()
    runs = {}
    for kind in PAIRED:
        with serial:
            model = make_model(width, layers, model_kind)
        model = model.to(device)
        runs[kind] = (model, build(kind, model, world))
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(16, width, generator=g).bfloat16().to(device) for _ in range(micro)]
    sync()

    def iteration(kind: str, shape: str, hlo: dict | None = None) -> float:
        model, opt = runs[kind]
        barrier()
        start = time.perf_counter()
        for i, x in enumerate(batches):
            model(x).float().pow(2).mean().backward()
            if shape == "nxd_loop" and i + 1 < len(batches):
                sync()
        restart_channel_ids()  # nxd_smp does this in step(); the same for torch_xla's optimizer
        opt.step()
        opt.zero_grad()
        if hlo is not None:  # the iteration's last graph, the step's
            hlo[kind] = torch_xla._XLAC._get_xla_tensors_hlo(list(model.parameters()) + _optimizer_tensors(opt))
        sync()
        wait_for_device()
        elapsed = time.perf_counter() - start
        barrier()
        return elapsed

    out: dict[str, Any] = {"params": sum(p.numel() for p in runs["nxd_smp"][0].parameters())}
    for shape in shapes:
        for kind in PAIRED:
            for _ in range(warmup):
                iteration(kind, shape)
        hlo: dict[str, str] = {}
        for kind in PAIRED:
            iteration(kind, shape, hlo)
        compiles = (met.metric_data("CompileTime") or [0])[0]
        times: dict[str, list[float]] = {kind: [] for kind in PAIRED}
        for p in range(pairs):
            for kind in (PAIRED if p % 2 == 0 else PAIRED[::-1]):
                times[kind].append(iteration(kind, shape))
        out[shape] = {
            "times_s": times,
            "compiles_after_warmup": (met.metric_data("CompileTime") or [0])[0] - compiles,
            "step_hlo_sha": {k: hashlib.sha256(v.encode()).hexdigest() for k, v in hlo.items()},
            "step_hlo_instructions": {k: hlo_instructions(v) for k, v in hlo.items()},
        }
    barrier()
    return out


def time_pairs(world: int, width: int, layers: int, pairs: int, warmup: int, micro: int,
               shapes: list[str], model: str = "linear") -> dict[str, Any]:
    """Both optimizers timed in one process on ``world`` replicas: per loop shape, each one's
    median iteration, the median and quartiles of the per-pair ratio, and whether every rank ran
    the same step program."""
    from tests.xla_replicas import run_replicas

    ranks = run_replicas(world, "scripts.bench_xla:paired", width, layers, pairs, warmup, micro, shapes, model,
                         timeout=3600, compile_in_turn=False)  # each replica syncs as its own process would
    result: dict[str, Any] = {"params": ranks[0]["params"]}
    for shape in shapes:
        mine = ranks[0][shape]
        times = mine["times_s"]
        ratios = [a / b for a, b in zip(times[PAIRED[0]], times[PAIRED[1]])]
        quartiles = statistics.quantiles(ratios, n=4, method="inclusive")
        result[shape] = {
            "iter_ms": {kind: statistics.median(t) * 1e3 for kind, t in times.items()},
            "ratio": statistics.median(ratios),
            "ratio_quartiles": [quartiles[0], quartiles[-1]],
            "pair_ratios": ratios,
            "compiles_after_warmup": max(r[shape]["compiles_after_warmup"] for r in ranks),
            "one_program_for_all_ranks": {
                kind: len({r[shape]["step_hlo_sha"][kind] for r in ranks}) == 1 for kind in PAIRED},
            "step_hlo_instructions": mine["step_hlo_instructions"],
        }
    return result


def _optimizer_tensors(opt) -> list[torch.Tensor]:
    """What the step writes besides the parameters: master shards and optimizer states."""
    inner = getattr(opt, "base_optimizer", None) or opt.inner_optimizer
    out = []
    for group in inner.param_groups:
        for shard in group["params"]:
            out.append(shard)
            out.extend(v for v in inner.state.get(shard, {}).values() if isinstance(v, torch.Tensor))
    return out


def run(kind: str, world: int, width: int, layers: int, iters: int, warmup: int, micro: int = 1) -> dict[str, Any]:
    from tests.xla_replicas import run_replicas

    ranks = run_replicas(world, "scripts.bench_xla:replica", kind, width, layers, iters, warmup, micro, timeout=1800,
                         compile_in_turn=False)  # each replica syncs as its own process would
    result = dict(ranks[0])
    result["one_graph_for_all_ranks"] = len({r["step_hlo_sha"] for r in ranks}) == 1
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, nargs=2, default=[8, 16], help="two depths for the memory slope")
    p.add_argument("--time-layers", type=int, default=12, help="the depth the time is measured at (default 12)")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--pairs", type=int, default=12, help="timed pairs per loop shape (default 12)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations of each memory run (default 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro", type=int, default=2, help="micro-batches per iteration (default 2)")
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES), help="loop shapes to time")
    p.add_argument("--model", choices=MODELS, default="linear",
                   help="the timed MLP's layers: nn.Linear (default) or x @ W with W stored [in, out]")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--time-only", action="store_true", help="time both optimizers; measure no memory")
    only.add_argument("--memory-only", action="store_true", help="measure memory (and compilations); time nothing")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                   help="optimizers whose memory is measured (default: torch_xla and nxd_smp with each memory option)")
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_xla.json"))
    a = p.parse_args()
    if a.layers[0] >= a.layers[1] or min(a.layers) < 1:
        p.error("--layers needs two increasing positive depths")
    if min(a.dp) < 1 or a.width < 1 or a.iters < 1 or a.warmup < 2 or a.micro < 1 or a.time_layers < 1:
        p.error("--dp, --width, --micro and --time-layers must be positive, --iters >= 1, --warmup >= 2")
    if a.pairs < 2:
        p.error("--pairs must be at least 2 (the ratio's quartiles)")
    if "torch_xla" not in a.kinds or "nxd_smp" not in a.kinds:
        p.error("--kinds must include torch_xla and nxd_smp (the baseline and the default)")
    if not a.time_only:  # (the memory slope's two depths)
        check_depths(p, a.width, a.layers)
    kinds = [k for k in KINDS if k in a.kinds]
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # glibc returns large frees

    timing = {}
    for world in ([] if a.memory_only else a.dp):
        timing[f"dp{world}"] = t = time_pairs(world, a.width, a.time_layers, a.pairs, a.warmup, a.micro, a.shapes,
                                              a.model)
        print(f"  time DP={world}: " + ", ".join(f"{shape} {t[shape]['ratio']:.2f}" for shape in a.shapes), flush=True)
    results = {}
    for world in ([] if a.time_only else a.dp):
        for kind in kinds:
            small = run(kind, world, a.width, a.layers[0], a.iters, a.warmup, 1)
            large = run(kind, world, a.width, a.layers[1], a.iters, a.warmup, 1)
            per_param = slope(small["peak_rss"], small["params"], large["peak_rss"], large["params"], per=world)
            results[f"{kind}_dp{world}"] = {"small": small, "large": large, "bytes_per_param": per_param,
                                            "theory_bytes_per_param": theory(kind, world)}
            print(f"  memory {kind} DP={world}: {per_param:.1f} bytes/param", flush=True)

    ratios: dict[str, dict[str, Any]] = {f"dp{world}": {} for world in a.dp}
    for world in a.dp:
        for kind in ([] if a.time_only else kinds[1:]):
            key = f"dp{world}" if kind == "nxd_smp" else f"{kind}_dp{world}"
            ratios.setdefault(key, {})["memory"] = (results[f"{kind}_dp{world}"]["bytes_per_param"]
                                                    / results[f"torch_xla_dp{world}"]["bytes_per_param"])
        for shape in ([] if a.memory_only else a.shapes):
            ratios[f"dp{world}"][shape] = timing[f"dp{world}"][shape]["ratio"]
            ratios[f"dp{world}"][f"{shape}_quartiles"] = timing[f"dp{world}"][shape]["ratio_quartiles"]

    split = "; torch_xla's collectives split per tensor, as XLA:CPU replicas force"
    report: list[str] = []
    if not a.memory_only:
        n = timing[f"dp{a.dp[0]}"]["params"]
        layer = "nn.Linear" if a.model == "linear" else "x @ W (W stored [in, out])"
        report += [f"Time: bf16 MLP {a.time_layers} x {a.width} of {layer} + tanh ({n / 1e6:.1f}M parameters), AdamW, "
                  f"max_norm 1.0, "
                  f"{a.micro} micro-batches of 16 x {a.width} per iteration; both optimizers in one process, "
                  f"{a.pairs} pairs alternating after {a.warmup} warm-up iterations each; XLA CPU replicas", "",
                  "| DP | loop shape | nxd_smp ms | torch_xla ms | nxd_smp / torch_xla, median of pairs (quartiles) "
                  "| target | step HLO instructions (nxd_smp / torch_xla) | one step program for all ranks | "
                  "compilations after warm-up |", "|---|---|---|---|---|---|---|---|---|"]
        for world in a.dp:
            for shape in a.shapes:
                t = timing[f"dp{world}"][shape]
                hlo = t["step_hlo_instructions"]
                report.append(
                    f"| {world} | {shape} | {t['iter_ms']['nxd_smp']:.1f} | {t['iter_ms']['torch_xla']:.1f} | "
                    f"{t['ratio']:.2f} ({t['ratio_quartiles'][0]:.2f}-{t['ratio_quartiles'][1]:.2f}) | "
                    f"<= {TARGETS[shape]} | "
                    + (f"{hlo['nxd_smp']} / {hlo['torch_xla']}" if world == 1 else f"{hlo['nxd_smp']} / n/a (split)")
                    + f" | {'yes' if all(t['one_program_for_all_ranks'].values()) else 'NO'} | "
                    f"{t['compiles_after_warmup']} |")
        report += ["", *(f"{shape}: {what}" for shape, what in SHAPES.items() if shape in a.shapes), ""]
    if not a.time_only:
        report += [f"Memory: bf16 MLP {a.layers[1]} x {a.width} against {a.layers[0]} layers, each run in its own "
                   f"process, forward+backward and step synced apart, median of {a.iters} iterations after "
                   f"{a.warmup} warm-up", "",
                   "| optimizer | bytes/param/rank | floor bytes/param | / torch_xla | iteration ms (synced apart) | "
                   "compilations (after warm-up) | compile s | one step graph for all ranks |",
                   "|---|---|---|---|---|---|---|---|"]
        for world in a.dp:
            theirs = results[f"torch_xla_dp{world}"]
            for kind in kinds:
                r = results[f"{kind}_dp{world}"]
                against = "" if kind == "torch_xla" else f"{r['bytes_per_param'] / theirs['bytes_per_param']:.2f}"
                report.append(f"| {kind} DP={world} | {r['bytes_per_param']:.1f} | {r['theory_bytes_per_param']:.1f} | "
                              f"{against} | {r['large']['iter_ms']:.1f} | {r['large']['compiles']} "
                              f"({r['large']['compiles_after_warmup']}) | {r['large']['compile_s']:.1f} | "
                              f"{'yes' if r['large']['one_graph_for_all_ranks'] else 'NO'} |")
    report.append("")
    for world in a.dp:
        r = ratios[f"dp{world}"]
        parts = [f"{', '.join(f'{shape} {r[shape]:.2f}' for shape in a.shapes)} (targets <= {TARGETS['one_graph']})"
                 ] if not a.memory_only else []
        if "memory" in r:
            parts.append(f"memory {r['memory']:.2f} (target <= {TARGETS['memory_ratio']})")
        report.append(f"DP={world}: nxd_smp / torch_xla: {'; '.join(parts)}{'' if world == 1 else split}")
    for world, kind, what, target in (
            (1, TRAINIUM, "the README's Trainium settings (sharded accumulation)", OPTION_TARGETS["dp1_memory_ratio"]),
            (4, "nxd_smp_both", "sharded accumulation + remainders", OPTION_TARGETS["dp4_memory_ratio"])):
        r = ratios.get(f"{kind}_dp{world}")
        if r is not None:
            report.append(f"DP={world}, {what}: memory / torch_xla {r['memory']:.2f} (target <= {target})")
    print("\n" + "\n".join(report))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"timing": timing, "results": results, "ratios": ratios, "targets": TARGETS,
                                 "shapes": SHAPES, "option_targets": OPTION_TARGETS, "options": OPTIONS,
                                 "trainium_kind": TRAINIUM,
                                 "baseline": "torch_xla as NxD ships it at DP 1; at DP > 1 its collectives split "
                                             "per tensor with channel ids (forced by XLA:CPU replicas)",
                                 "command": " ".join(sys.argv), "report": report,
                                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}},
                                indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
