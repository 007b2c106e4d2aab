#!/usr/bin/env python
"""nxd_smp against torch_xla's ZeroRedundancyOptimizer as NxD ships it, on the XLA CPU device
at DP 1 and on 2 and 4 (or 8) CPU replicas, in one run.

Both optimizers train the same bf16 MLP with AdamW under the same replica harness
(``tests/xla_replicas.py``: one process, a thread per replica). torch_xla's optimizer gets the
settings NxD's ``initialize_parallel_optimizer`` passes for SMP: fp32 optimizer dtype,
``use_grad_acc_hook``, ``higher_cc_precision``, ``save_master_weights``, ``pin_layout=False``,
bucket caps 130 MB (reduce-scatter) and ``max(1, 130 // dp)`` MB (all-gather).

At DP 1 torch_xla's optimizer runs untouched. At DP > 1 the XLA CPU device forces one change:
its replicas meet in a collective only by the collective's channel id, which torch-xla 2.9's
coalesced collectives (and ``xm.all_reduce``) cannot carry. So there, and only there, the
baseline's collectives are issued one tensor at a time with a channel id (torch_xla's own
single-tensor ``xm.reduce_scatter`` / ``xm.all_gather``; its norm's all-reduce as an all-gather
and a sum), each after the previous one (XLA:CPU replicas otherwise run them in orders of their
own); nothing else changes. Every DP > 1 figure of the baseline carries that change, and its HLO
instruction count is not comparable (N single ops against one coalesced op): the table leaves it
out. Every iteration is two graphs: forward + backward, then the optimizer step, so the step
graph can be read alone.

Per optimizer and DP size:
* iteration time (median after warm-up; every replica waits at a barrier before each graph);
* peak resident memory per parameter on each rank, as a slope over two model depths run in
  separate processes (docs/design.md, "How performance is measured"): (peak_b - peak_a) /
  (params_b - params_a) / dp (depths rather than widths, so that both sizes cut into buckets the
  same way);
* graph compilations (all replicas together), after warm-up, and compile time;
* HLO instructions of the step graph, and whether every rank's step graph is the same text.

Prints a table and writes JSON (``--out``).

    python scripts/bench_xla.py --out docs/bench_xla.json        # 8 and 16 layers of 1024, DP 1 2 4
    python scripts/bench_xla.py --dp 1 2 4 8
    python scripts/bench_xla.py --width 64 --layers 2 4 --dp 1 2 --iters 2 --warmup 2   # a quick look
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

TARGETS = {"iteration_ratio": 0.8, "memory_ratio": 0.8}
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


def make_model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
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


def _optimizer_tensors(opt) -> list[torch.Tensor]:
    """What the step writes besides the parameters: master shards and optimizer states."""
    inner = getattr(opt, "base_optimizer", None) or opt.inner_optimizer
    out = []
    for group in inner.param_groups:
        for shard in group["params"]:
            out.append(shard)
            out.extend(v for v in inner.state.get(shard, {}).values() if isinstance(v, torch.Tensor))
    return out


def run(kind: str, world: int, width: int, layers: int, iters: int, warmup: int, micro: int) -> dict[str, Any]:
    from tests.xla_replicas import run_replicas

    ranks = run_replicas(world, "scripts.bench_xla:replica", kind, width, layers, iters, warmup, micro, timeout=1800)
    result = dict(ranks[0])
    result["one_graph_for_all_ranks"] = len({r["step_hlo_sha"] for r in ranks}) == 1
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, nargs=2, default=[8, 16], help="two depths for the memory slope")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro", type=int, default=1, help="micro-batches per iteration (default 1)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                   help="optimizers to run (default: torch_xla and nxd_smp with each memory option)")
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_xla.json"))
    a = p.parse_args()
    if a.layers[0] >= a.layers[1] or min(a.layers) < 1:
        p.error("--layers needs two increasing positive depths")
    if min(a.dp) < 1 or a.width < 1 or a.iters < 1 or a.warmup < 2 or a.micro < 1:
        p.error("--dp, --width and --micro must be positive, --iters >= 1, --warmup >= 2")
    if "torch_xla" not in a.kinds or "nxd_smp" not in a.kinds:
        p.error("--kinds must include torch_xla and nxd_smp (the baseline and the default)")
    check_depths(p, a.width, a.layers)
    kinds = [k for k in KINDS if k in a.kinds]
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # glibc returns large frees

    rows, results = [], {}
    for world in a.dp:
        for kind in kinds:
            small = run(kind, world, a.width, a.layers[0], a.iters, a.warmup, a.micro)
            large = run(kind, world, a.width, a.layers[1], a.iters, a.warmup, a.micro)
            per_param = slope(small["peak_rss"], small["params"], large["peak_rss"], large["params"], per=world)
            results[f"{kind}_dp{world}"] = {"small": small, "large": large, "bytes_per_param": per_param,
                                            "theory_bytes_per_param": theory(kind, world)}
            print(f"  {kind} DP={world}: {large['iter_ms']:.1f} ms/iteration, {per_param:.1f} bytes/param", flush=True)
    ratios = {}
    for world in a.dp:
        theirs = results[f"torch_xla_dp{world}"]
        for kind in kinds[1:]:
            ours = results[f"{kind}_dp{world}"]
            key = f"dp{world}" if kind == "nxd_smp" else f"{kind}_dp{world}"
            ratios[key] = {
                "iteration": ours["large"]["iter_ms"] / theirs["large"]["iter_ms"],
                "memory": ours["bytes_per_param"] / theirs["bytes_per_param"],
            }
            if world == 1:  # at DP > 1 the baseline's collectives are split per tensor: not comparable
                ratios[key]["hlo_instructions"] = (
                    ours["large"]["step_hlo_instructions"] / theirs["large"]["step_hlo_instructions"])
        for kind in kinds:
            r = results[f"{kind}_dp{world}"]
            against = "" if kind == "torch_xla" else (
                f"{r['large']['iter_ms'] / theirs['large']['iter_ms']:.2f} / "
                f"{r['bytes_per_param'] / theirs['bytes_per_param']:.2f}")
            rows.append((f"{kind} DP={world}", f"{r['large']['iter_ms']:.1f}", f"{r['bytes_per_param']:.1f}",
                         f"{r['theory_bytes_per_param']:.1f}", against,
                         f"{r['large']['compiles']} ({r['large']['compiles_after_warmup']})",
                         f"{r['large']['compile_s']:.1f}",
                         str(r["large"]["step_hlo_instructions"]) if kind != "torch_xla" or world == 1 else "n/a (split)",
                         "yes" if r["large"]["one_graph_for_all_ranks"] else "NO"))
    n = results[f"nxd_smp_dp{a.dp[0]}"]["large"]["params"]
    header = ("optimizer", "iteration ms", "bytes/param/rank", "floor bytes/param", "/ torch_xla: iteration, memory",
              "compilations (after warm-up)", "compile s", "step HLO instructions", "one step graph for all ranks")
    report = [f"bf16 MLP {a.layers[1]} x {a.width} wide, {n / 1e6:.1f}M parameters (memory: slope against "
              f"{a.layers[0]} layers), AdamW, {a.micro} micro-batch(es) per iteration, median of {a.iters} "
              f"iterations after {a.warmup} warm-up; XLA CPU replicas in one process", "",
              "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    report += ["| " + " | ".join(row) + " |" for row in rows]
    report.append("")
    for world in a.dp:
        r = ratios[f"dp{world}"]
        split = "" if world == 1 else " [torch_xla's collectives split per tensor, as XLA:CPU replicas force]"
        hlo = f", step HLO instructions {r['hlo_instructions']:.2f} (<= 1)" if "hlo_instructions" in r else ""
        report.append(f"DP={world}: nxd_smp / torch_xla: iteration {r['iteration']:.2f}, memory {r['memory']:.2f} "
                      f"(targets <= {TARGETS['iteration_ratio']}){hlo}{split}")
    for world, kind, what, target in (
            (1, TRAINIUM, "the README's Trainium settings (sharded accumulation)", OPTION_TARGETS["dp1_memory_ratio"]),
            (4, "nxd_smp_both", "sharded accumulation + remainders", OPTION_TARGETS["dp4_memory_ratio"])):
        r = ratios.get(f"{kind}_dp{world}")
        if r is not None:
            report.append(f"DP={world}, {what}: memory / torch_xla {r['memory']:.2f} (target <= {target}), "
                          f"iteration {r['iteration']:.2f}")
    print("\n" + "\n".join(report))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"results": results, "ratios": ratios, "targets": TARGETS,
                                 "option_targets": OPTION_TARGETS, "options": OPTIONS, "trainium_kind": TRAINIUM,
                                 "baseline": "torch_xla as NxD ships it at DP 1; at DP > 1 its collectives split "
                                             "per tensor with channel ids (forced by XLA:CPU replicas)",
                                 "command": " ".join(sys.argv), "report": report,
                                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}},
                                indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
