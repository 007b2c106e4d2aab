#!/usr/bin/env python
"""nxd_smp against its peers, in one run on one machine.

(a) torch's ``ZeroRedundancyOptimizer`` over a DDP model with AdamW (gloo, DP=2, CPU). It has no
    master weights, so it trains the model in fp32 to get fp32 results; nxd_smp trains the bf16
    model with fp32 masters. Optimizer-step time (torch ZeRO's step: the local AdamW and the
    parameter broadcast; nxd_smp's: reduce-scatter, norm, clip, AdamW, all-gather) and whole
    iterations (DDP all-reduces gradients inside backward).
(b) torch_xla's ``ZeroRedundancyOptimizer`` with NxD's SMP settings (``save_master_weights``,
    ``use_grad_acc_hook``, ``higher_cc_precision``, fp32 optimizer dtype) on the XLA CPU device
    at DP=1. On XLA a step cannot be timed apart from the graph it is part of, so both are timed
    per iteration (forward, backward, step, sync); graph compilations are counted.
(c) The practical roofline: ``AdamW(fused=True)`` on one flat fp32 tensor plus the copy to bf16.

Memory: peak resident bytes per parameter during training beyond the model's parameters (each
optimizer in a process of its own). Prints a table and writes JSON.

    python scripts/bench_peers.py                    # ~8M parameters
    python scripts/bench_peers.py --width 512 --layers 2 --iters 5   # a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

TARGETS = {"vs_torch_xla": 0.8, "vs_torch_zero_ddp": 0.7}


def rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


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
    base = rss()
    reset_peak()
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
            "bytes_per_param": (peak - base) / n, "params": n,
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
def xla_worker(kind: str, args: dict, out: str) -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    import nxd_smp

    device = torch_xla.device()
    model = make_model(args["width"], args["layers"], torch.bfloat16).to(device)
    n = sum(p.numel() for p in model.parameters())
    torch_xla.sync()
    base = rss()
    reset_peak()
    if kind == "torch_xla_zero":
        from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, optimizer_dtype=torch.float32, grad_clipping=True,
            max_norm=1.0, pin_layout=False, use_grad_acc_hook=True, save_master_weights=True,
            higher_cc_precision=True, lr=1e-4,
        )
    else:
        opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, pin_layout=False)
    data = [batch(args["width"], i, 0, torch.bfloat16).to(device) for i in range(args["warmup"] + args["iters"])]
    torch_xla.sync()
    iters, compiles_after_warmup = [], None
    for i, x in enumerate(data):
        t0 = time.perf_counter()
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        xm.wait_device_ops()  # time the execution, not just the dispatch
        if i >= args["warmup"]:
            iters.append(time.perf_counter() - t0)
        if i + 1 == args["warmup"]:
            compiles_after_warmup = (met.metric_data("CompileTime") or [0])[0]
    compiles = (met.metric_data("CompileTime") or [0])[0]
    Path(out).write_text(json.dumps({
        "iter_ms": statistics.median(iters) * 1e3, "bytes_per_param": (rss("VmHWM") - base) / n,
        "params": n, "compilations": compiles, "compilations_after_warmup": compiles - compiles_after_warmup,
    }))


def run_xla(kind: str, args: dict) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    cmd = [sys.executable, __file__, "--xla-worker", kind, "--worker-out", out,
           "--width", str(args["width"]), "--layers", str(args["layers"]),
           "--iters", str(args["iters"]), "--warmup", str(args["warmup"])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"XLA worker {kind} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


# ---------------------------------------------------------------------------- roofline
def roofline(args: dict) -> dict:
    import nxd_smp

    model = make_model(args["width"], args["layers"], torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
    model(batch(args["width"], 0, 0, torch.bfloat16)).float().pow(2).mean().backward()
    flat = torch.randn(n) * 0.02
    flat.grad = torch.randn(n) * 1e-3
    bf16 = torch.empty(n, dtype=torch.bfloat16)
    roof = torch.optim.AdamW([flat], lr=1e-4, fused=True)
    ours, ref = [], []
    for i in range(args["warmup"] + args["iters"]):
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        roof.step()
        bf16.copy_(flat)
        t2 = time.perf_counter()
        if i >= args["warmup"]:
            ours.append(t1 - t0)
            ref.append(t2 - t1)
    return {"zero1_step_ms": statistics.median(ours) * 1e3, "roofline_step_ms": statistics.median(ref) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_peers.json"))
    p.add_argument("--xla-worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    a = p.parse_args()
    args = {"width": a.width, "layers": a.layers, "iters": a.iters, "warmup": a.warmup}
    if a.xla_worker:
        xla_worker(a.xla_worker, args, a.worker_out)
        return
    if min(a.width, a.layers, a.iters, a.warmup) < 1:
        p.error("--width, --layers, --iters and --warmup must be positive")

    results = {
        "torch_zero_ddp": run_gloo("torch_zero_ddp", args),
        "nxd_smp_gloo": run_gloo("nxd_smp", args),
        "torch_xla_zero": run_xla("torch_xla_zero", args),
        "nxd_smp_xla": run_xla("nxd_smp", args),
        "roofline": roofline(args),
    }
    r = results
    ratios = {
        "vs_torch_xla_iter": r["nxd_smp_xla"]["iter_ms"] / r["torch_xla_zero"]["iter_ms"],
        "vs_torch_zero_ddp_step": r["nxd_smp_gloo"]["step_ms"] / r["torch_zero_ddp"]["step_ms"],
        "vs_torch_zero_ddp_iter": r["nxd_smp_gloo"]["iter_ms"] / r["torch_zero_ddp"]["iter_ms"],
        "vs_roofline_step": r["roofline"]["zero1_step_ms"] / r["roofline"]["roofline_step_ms"],
    }
    n = r["nxd_smp_gloo"]["params"]
    rows = [
        ("torch ZeRO + DDP, fp32 model (gloo DP=2)", f"{r['torch_zero_ddp']['step_ms']:.1f}",
         f"{r['torch_zero_ddp']['iter_ms']:.1f}", f"{r['torch_zero_ddp']['bytes_per_param']:.1f}", "-"),
        ("nxd_smp, bf16 + SMP (gloo DP=2)", f"{r['nxd_smp_gloo']['step_ms']:.1f}",
         f"{r['nxd_smp_gloo']['iter_ms']:.1f}", f"{r['nxd_smp_gloo']['bytes_per_param']:.1f}", "-"),
        ("torch_xla ZeRO, NxD SMP settings (XLA CPU DP=1)", "-", f"{r['torch_xla_zero']['iter_ms']:.1f}",
         f"{r['torch_xla_zero']['bytes_per_param']:.1f}",
         f"{r['torch_xla_zero']['compilations']} ({r['torch_xla_zero']['compilations_after_warmup']} after warm-up)"),
        ("nxd_smp (XLA CPU DP=1)", "-", f"{r['nxd_smp_xla']['iter_ms']:.1f}",
         f"{r['nxd_smp_xla']['bytes_per_param']:.1f}",
         f"{r['nxd_smp_xla']['compilations']} ({r['nxd_smp_xla']['compilations_after_warmup']} after warm-up)"),
        ("roofline: fused AdamW fp32 + copy (CPU DP=1)", f"{r['roofline']['roofline_step_ms']:.1f}", "-", "-", "-"),
        ("nxd_smp (CPU DP=1)", f"{r['roofline']['zero1_step_ms']:.1f}", "-", "-", "-"),
    ]
    print(f"{n / 1e6:.1f}M parameters, AdamW, medians of {a.iters} iterations after {a.warmup} warm-up")
    print(f"| {'optimizer':<48} | step ms | iteration ms | bytes/param | XLA compilations |")
    print(f"|{'-' * 50}|---------|--------------|-------------|------------------|")
    for row in rows:
        print(f"| {row[0]:<48} | {row[1]:>7} | {row[2]:>12} | {row[3]:>11} | {row[4]:>16} |")
    print(f"nxd_smp / torch_xla ZeRO (iteration): {ratios['vs_torch_xla_iter']:.2f} (target <= 0.8)")
    print(f"nxd_smp / torch ZeRO+DDP (step): {ratios['vs_torch_zero_ddp_step']:.2f} (target <= 0.7); "
          f"(iteration): {ratios['vs_torch_zero_ddp_iter']:.2f}")
    print(f"nxd_smp / roofline (step): {ratios['vs_roofline_step']:.2f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"results": results, "ratios": ratios, "targets": TARGETS, "params": n}, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
