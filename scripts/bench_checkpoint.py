#!/usr/bin/env python
"""Checkpoint throughput: save_checkpoint / load_checkpoint against torch.save / torch.load.

A bf16 model of >= 100M parameters with a trained Zero1Optimizer (AdamW, fp32 master
weights saved), DP=1. The baseline writes the same tensors (model, Adam states, master
weights) as one ``torch.save`` file followed by an fsync (a checkpoint that may be lost
to a crash is not a checkpoint; ``save_checkpoint`` fsyncs too) and reads them back with
``torch.load``. Both run alternately in one process; MB/s = bytes on disk / seconds.
Loading includes nxd_smp's size and CRC-32 check of every file.

    python scripts/bench_checkpoint.py            # prints a table, writes JSON
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


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=101e6, help="approximate parameter count (default 101e6)")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_checkpoint.json"))
    args = p.parse_args()
    if args.params < 1 or args.width < 1 or args.repeats < 1:
        p.error("--params, --width and --repeats must be positive")

    layers = max(1, round(args.params / (args.width * args.width + args.width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width, dtype=torch.bfloat16) for _ in range(layers)])
    n = sum(q.numel() for q in model.parameters())
    mp = nxd_smp.MixedPrecisionConfig(use_master_weights_in_ckpt=True)
    opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, mixed_precision=mp, lr=1e-4,
                                 compile_update=False)
    model(torch.randn(2, args.width, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    opt.zero_grad()

    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    for b, master in enumerate(opt.master_shards):
        for key, value in opt.inner_optimizer.state[master].items():
            tensors[f"optim/{b}/{key}"] = value
        tensors[f"master/{b}"] = master

    root = Path(tempfile.mkdtemp(dir=args.dir))
    ours_save, ours_load, base_save, base_load = [], [], [], []
    try:
        for _ in range(args.repeats):
            t = time.perf_counter()
            nxd_smp.save_checkpoint(root / "ckpt", model=model, optimizer=opt)
            ours_save.append(time.perf_counter() - t)
            ours_bytes = dir_bytes((root / "ckpt").resolve())

            t = time.perf_counter()
            with open(root / "plain.pt", "wb") as f:
                torch.save(tensors, f)
                f.flush()
                os.fsync(f.fileno())
            base_save.append(time.perf_counter() - t)
            base_bytes = (root / "plain.pt").stat().st_size

            t = time.perf_counter()
            nxd_smp.load_checkpoint(root / "ckpt", model=model, optimizer=opt)
            ours_load.append(time.perf_counter() - t)

            t = time.perf_counter()
            loaded = torch.load(root / "plain.pt", weights_only=True)
            base_load.append(time.perf_counter() - t)
            del loaded
    finally:
        shutil.rmtree(root, ignore_errors=True)

    mb = 2**20
    result = {
        "params": n,
        "bytes": {"nxd_smp": ours_bytes, "torch_save": base_bytes},
        "save_MBps": {"nxd_smp": ours_bytes / mb / statistics.median(ours_save),
                      "torch_save": base_bytes / mb / statistics.median(base_save)},
        "load_MBps": {"nxd_smp": ours_bytes / mb / statistics.median(ours_load),
                      "torch_load": base_bytes / mb / statistics.median(base_load)},
        "seconds": {"save": ours_save, "torch_save": base_save, "load": ours_load, "torch_load": base_load},
        "target_ratio": 0.8,
    }
    result["save_ratio"] = result["save_MBps"]["nxd_smp"] / result["save_MBps"]["torch_save"]
    result["load_ratio"] = result["load_MBps"]["nxd_smp"] / result["load_MBps"]["torch_load"]
    print(f"{n / 1e6:.1f}M bf16 params, AdamW states + fp32 master weights, {ours_bytes / mb:.0f} MiB on disk")
    print(f"{'':<22}{'nxd_smp MB/s':>14}{'torch MB/s':>12}{'ratio':>8}   (target >= 0.8)")
    print(f"{'save (+fsync)':<22}{result['save_MBps']['nxd_smp']:>14.0f}{result['save_MBps']['torch_save']:>12.0f}"
          f"{result['save_ratio']:>8.2f}")
    print(f"{'load':<22}{result['load_MBps']['nxd_smp']:>14.0f}{result['load_MBps']['torch_load']:>12.0f}"
          f"{result['load_ratio']:>8.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
