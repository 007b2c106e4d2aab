#!/usr/bin/env python
"""nxd_smp against its peers as they ship, in one run on one machine.

(a) torch's ``ZeroRedundancyOptimizer`` over a DDP model with AdamW (gloo, DP=2, CPU). It has no
    master weights, so it trains the model in fp32 to get fp32 results; nxd_smp trains the bf16
    model with fp32 masters. Optimizer-step time (torch ZeRO's step: the local AdamW and the
    parameter broadcast; nxd_smp's: reduce-scatter, norm, clip, AdamW, all-gather) and whole
    iterations (DDP all-reduces gradients inside backward).
(b) torch_xla's ``ZeroRedundancyOptimizer`` as NxD ships it (fp32 optimizer dtype,
    ``use_grad_acc_hook``, ``higher_cc_precision``, ``save_master_weights``, ``pin_layout=False``,
    NxD's 130 MB bucket caps) on the XLA CPU device at DP=1, untouched: the same code as
    ``scripts/bench_xla.py`` (its DP > 1 rows are there). On XLA a step cannot be timed apart from
    the graph it is part of, so both are timed per iteration.

Memory is a slope: peak resident bytes at two model depths, each run in a process of its own,
difference over difference (a single size would count the compiler and library pages as
per-parameter memory). The CPU roofline is ``scripts/bench_step.py``'s. Prints a table and
writes JSON.

    python scripts/bench_peers.py --out docs/bench_peers.json       # 4 and 8 layers of 1024
    python scripts/bench_peers.py --width 256 --layers 2 4 --iters 3   # a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

TARGETS = {"vs_torch_xla": 0.8, "vs_torch_zero_ddp": 0.8}
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from memory_slope import check_depths, slope  # noqa: E402


def rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def make_model(width: int, layers: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width, dtype=dtype), nn.Tanh()) for _ in range(layers)])


def batch(width: int, step: int, rank: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, width, generator=g).to(dtype)


# ---------------------------------------------------------------------------- gloo DP=2
def _gloo_worker(rank: int, world: int, port: int, kind: str, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import nxd_smp
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    dtype = torch.float32 if kind == "torch_zero_ddp" else torch.bfloat16
    model = make_model(args["width"], args["layers"], dtype)
    n = sum(p.numel() for p in model.parameters())
    if kind == "torch_zero_ddp":
        model = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
    else:
        opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
    steps, iters = [], []
    for i in range(args["warmup"] + args["iters"]):
        t0 = time.perf_counter()
        model(batch(args["width"], i, rank, dtype)).float().pow(2).mean().backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad()
        if i >= args["warmup"]:
            steps.append(t2 - t1)
            iters.append(t2 - t0)
    peak = rss("VmHWM")
    if rank == 0:
        Path(out).write_text(json.dumps({
            "step_ms": statistics.median(steps) * 1e3, "iter_ms": statistics.median(iters) * 1e3,
            "peak_rss": peak, "params": n,
        }))
    # Let DDP's reducer and ZeRO's broadcasts finish before the group goes away: tearing it
    # down under them aborts the process ("terminate called without an active exception").
    dist.barrier()
    del opt, model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def run_gloo(kind: str, args: dict) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    mp.start_processes(_gloo_worker, args=(2, port, kind, args, out), nprocs=2, join=True, start_method="spawn")
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


# ---------------------------------------------------------------------------- XLA DP=1
def run_xla(kind: str, args: dict) -> dict:
    """One model size on the XLA CPU device at DP=1, under bench_xla's harness and settings."""
    from scripts.bench_xla import run

    return run(kind, 1, args["width"], args["layers"], args["iters"], args["warmup"])


def bytes_per_param(small: dict, large: dict) -> float:
    """Peak resident bytes per parameter, as the slope over two sizes."""
    return slope(small["peak_rss"], small["params"], large["peak_rss"], large["params"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, nargs=2, default=[4, 8], help="two depths for the memory slope")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_peers.json"))
    p.add_argument("--only", choices=["gloo", "xla"], help="run one half: (a) gloo or (b) XLA")
    a = p.parse_args()
    if min(a.width, a.iters) < 1 or a.warmup < 2 or not 0 < a.layers[0] < a.layers[1]:
        p.error("--width and --iters must be positive, --warmup >= 2, --layers two increasing depths")
    check_depths(p, a.width, a.layers)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # glibc returns large frees

    results = {}
    runs = [("torch_zero_ddp", run_gloo, "torch_zero_ddp"), ("nxd_smp_gloo", run_gloo, "nxd_smp"),
            ("torch_xla_zero", run_xla, "torch_xla"), ("nxd_smp_xla", run_xla, "nxd_smp")]
    for name, runner, kind in runs:
        if a.only is not None and (runner is run_gloo) != (a.only == "gloo"):
            continue
        sizes = [runner(kind, {"width": a.width, "layers": layers, "iters": a.iters, "warmup": a.warmup})
                 for layers in a.layers]
        results[name] = {**sizes[1], "small": sizes[0], "bytes_per_param": bytes_per_param(*sizes)}
        print(f"  {name}: {results[name]['iter_ms']:.1f} ms/iteration, {results[name]['bytes_per_param']:.1f} "
              f"bytes/param", flush=True)
    r = results
    ratios, rows, summary = {}, [], []
    if "torch_zero_ddp" in r:
        ratios.update({
            "vs_torch_zero_ddp_step": r["nxd_smp_gloo"]["step_ms"] / r["torch_zero_ddp"]["step_ms"],
            "vs_torch_zero_ddp_iter": r["nxd_smp_gloo"]["iter_ms"] / r["torch_zero_ddp"]["iter_ms"],
            "vs_torch_zero_ddp_memory": r["nxd_smp_gloo"]["bytes_per_param"] / r["torch_zero_ddp"]["bytes_per_param"],
        })
        rows += [(label, f"{r[key]['step_ms']:.1f}", f"{r[key]['iter_ms']:.1f}", f"{r[key]['bytes_per_param']:.1f}", "-")
                 for label, key in (("torch ZeRO + DDP, fp32 model (gloo DP=2)", "torch_zero_ddp"),
                                    ("nxd_smp, bf16 + SMP (gloo DP=2)", "nxd_smp_gloo"))]
        summary.append(f"nxd_smp / torch ZeRO+DDP: step {ratios['vs_torch_zero_ddp_step']:.2f}, iteration "
                       f"{ratios['vs_torch_zero_ddp_iter']:.2f}, memory {ratios['vs_torch_zero_ddp_memory']:.2f} "
                       f"(targets <= {TARGETS['vs_torch_zero_ddp']})")
    if "torch_xla_zero" in r:
        ratios.update({
            "vs_torch_xla_iter": r["nxd_smp_xla"]["iter_ms"] / r["torch_xla_zero"]["iter_ms"],
            "vs_torch_xla_memory": r["nxd_smp_xla"]["bytes_per_param"] / r["torch_xla_zero"]["bytes_per_param"],
        })
        rows += [(label, "-", f"{r[key]['iter_ms']:.1f}", f"{r[key]['bytes_per_param']:.1f}",
                  f"{r[key]['compiles']} ({r[key]['compiles_after_warmup']} after warm-up)")
                 for label, key in (("torch_xla ZeRO as NxD ships it (XLA CPU DP=1)", "torch_xla_zero"),
                                    ("nxd_smp (XLA CPU DP=1)", "nxd_smp_xla"))]
        summary.append(f"nxd_smp / torch_xla ZeRO: iteration {ratios['vs_torch_xla_iter']:.2f}, memory "
                       f"{ratios['vs_torch_xla_memory']:.2f} (targets <= {TARGETS['vs_torch_xla']})")
    n = next(iter(r.values()))["params"]
    report = [f"MLP {a.layers[1]} x {a.width} ({n / 1e6:.1f}M parameters; memory: slope against {a.layers[0]} "
              f"layers), AdamW, medians of {a.iters} iterations after {a.warmup} warm-up", "",
              "| optimizer | step ms | iteration ms | bytes/param | XLA compilations |", "|---|---|---|---|---|"]
    report += ["| " + " | ".join(row) + " |" for row in rows] + [""] + summary
    print("\n".join(report))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"results": results, "ratios": ratios, "targets": TARGETS, "params": n,
                                 "command": " ".join(sys.argv), "report": report}, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
