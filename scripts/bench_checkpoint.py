#!/usr/bin/env python
"""Checkpoint throughput: save_checkpoint / load_checkpoint against torch.save / torch.load,
and how long an asynchronous save holds up training, at two model sizes.

A bf16 model with a trained Zero1Optimizer (AdamW, fp32 master weights saved), DP=1. The
baseline writes the same tensors (model, Adam states, master weights) as one ``torch.save``
file followed by an fsync (a checkpoint that may be lost to a crash is not a checkpoint;
``save_checkpoint`` fsyncs too) and reads them back with ``torch.load``. Every measurement
alternates with its baseline in one process; MB/s = bytes on disk / seconds (median of
``--repeats``). Loading includes nxd_smp's checks (file sizes, CRC-32 of every tensor) and
putting the state into the live model and optimizer. ``async_save=True`` is timed twice: until
the call returns (what the training loop waits for: copying the state to host memory) and
until ``finalize_checkpoint()`` returns.

    python scripts/bench_checkpoint.py                       # 50M and 100M parameters
    python scripts/bench_checkpoint.py --params 2e6 4e6 --repeats 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

import nxd_smp

TARGETS = {"save_ratio": 0.8, "load_ratio": 0.8, "async_blocking_fraction": 0.1}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build(params: float, width: int):
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, dtype=torch.bfloat16) for _ in range(layers)])
    mp = nxd_smp.MixedPrecisionConfig(use_master_weights_in_ckpt=True)
    opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, mixed_precision=mp, lr=1e-4,
                                 compile_update=False)
    model(torch.randn(2, width, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    for b, master in enumerate(opt.master_shards):
        for key, value in opt.inner_optimizer.state[master].items():
            tensors[f"optim/{b}/{key}"] = value
        tensors[f"master/{b}"] = master
    return model, opt, tensors


def measure(params: float, width: int, repeats: int, root: Path) -> dict:
    model, opt, tensors = build(params, width)
    n = sum(q.numel() for q in model.parameters())
    times: dict[str, list[float]] = {k: [] for k in ("save", "torch_save", "load", "torch_load", "async_return",
                                                     "async_total")}
    for _ in range(repeats):
        t = time.perf_counter()
        nxd_smp.save_checkpoint(root / "ckpt", model=model, optimizer=opt)
        times["save"].append(time.perf_counter() - t)
        ours_bytes = dir_bytes((root / "ckpt").resolve())

        t = time.perf_counter()
        with open(root / "plain.pt", "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())
        times["torch_save"].append(time.perf_counter() - t)
        base_bytes = (root / "plain.pt").stat().st_size

        t = time.perf_counter()
        nxd_smp.load_checkpoint(root / "ckpt", model=model, optimizer=opt)
        times["load"].append(time.perf_counter() - t)

        t = time.perf_counter()
        loaded = torch.load(root / "plain.pt", weights_only=True)
        times["torch_load"].append(time.perf_counter() - t)
        del loaded

        t = time.perf_counter()
        nxd_smp.save_checkpoint(root / "ckpt", model=model, optimizer=opt, async_save=True)
        times["async_return"].append(time.perf_counter() - t)
        nxd_smp.finalize_checkpoint()
        times["async_total"].append(time.perf_counter() - t)
    median = {k: statistics.median(v) for k, v in times.items()}
    mb = 2**20
    result = {
        "params": n,
        "bytes": {"nxd_smp": ours_bytes, "torch_save": base_bytes},
        "save_MBps": {"nxd_smp": ours_bytes / mb / median["save"], "torch_save": base_bytes / mb / median["torch_save"]},
        "load_MBps": {"nxd_smp": ours_bytes / mb / median["load"], "torch_load": base_bytes / mb / median["torch_load"]},
        "async_seconds": {"blocking": median["async_return"], "total": median["async_total"],
                          "sync_save": median["save"]},
        "seconds": times,
    }
    result["save_ratio"] = result["save_MBps"]["nxd_smp"] / result["save_MBps"]["torch_save"]
    result["load_ratio"] = result["load_MBps"]["nxd_smp"] / result["load_MBps"]["torch_load"]
    result["async_blocking_fraction"] = median["async_return"] / median["save"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, nargs="+", default=[50e6, 101e6], help="approximate parameter counts")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_checkpoint.json"))
    args = p.parse_args()
    if min(args.params) < 1 or args.width < 1 or args.repeats < 1:
        p.error("--params, --width and --repeats must be positive")

    results = []
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        for params in args.params:
            results.append(measure(params, args.width, args.repeats, root))
            shutil.rmtree(root / (root / "ckpt").resolve().name, ignore_errors=True)
            (root / "ckpt").unlink(missing_ok=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print("AdamW states + fp32 master weights, DP=1, medians of", args.repeats, "(MB/s = MiB on disk / s)")
    print("| params | MiB | save MB/s (torch) | ratio | load MB/s (torch) | ratio | async: blocks / sync save |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        a = r["async_seconds"]
        print(f"| {r['params'] / 1e6:.1f}M | {r['bytes']['nxd_smp'] / 2**20:.0f} | "
              f"{r['save_MBps']['nxd_smp']:.0f} ({r['save_MBps']['torch_save']:.0f}) | {r['save_ratio']:.2f} | "
              f"{r['load_MBps']['nxd_smp']:.0f} ({r['load_MBps']['torch_load']:.0f}) | {r['load_ratio']:.2f} | "
              f"{a['blocking']:.2f} s / {a['sync_save']:.2f} s = {r['async_blocking_fraction']:.2f} |")
    print(f"targets: save and load ratio >= {TARGETS['save_ratio']}, async blocking <= {TARGETS['async_blocking_fraction']}")
    summary = {
        "results": results,
        "targets": TARGETS,
        # the fields the smoke test and readers look at, from the largest size
        "save_ratio": results[-1]["save_ratio"],
        "load_ratio": results[-1]["load_ratio"],
        "save_MBps": results[-1]["save_MBps"],
        "load_MBps": results[-1]["load_MBps"],
        "async_blocking_fraction": results[-1]["async_blocking_fraction"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
