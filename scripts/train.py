#!/usr/bin/env python
"""A small real training run with Zero1Optimizer under an NxD-style config.

A bf16 MLP student learns a fixed random teacher on synthetic data, with fp32 master
weights, fp32 gradient accumulation over micro-batches and gradient clipping. It prints
the loss and gradient norm per step.

    python scripts/train.py                      # XLA CPU device if torch_xla is installed
    python scripts/train.py --device cpu --steps 50
    torchrun --nproc-per-node 2 scripts/train.py # data parallel over gloo on CPU
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import nxd_smp


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--batch-size", type=int, default=64, help="examples per micro-batch (default 64)")
    p.add_argument("--hidden", type=int, default=512, help="MLP width (default 512)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip threshold (default 1.0)")
    p.add_argument("--no-master-weights", action="store_true", help="legacy mode: bf16 shards and states")
    p.add_argument("--device", choices=["auto", "cpu", "xla"], default="auto",
                   help="auto: the XLA CPU device when torch_xla is installed and running on one rank")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for name in ("steps", "micro_batches", "batch_size", "hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0:
        p.error("--lr must be > 0")
    return args


def pick_device(choice: str, world_size: int) -> torch.device:
    if choice == "cpu":
        return torch.device("cpu")
    try:
        import torch_xla
    except ImportError:
        if choice == "xla":
            raise SystemExit("--device xla needs torch_xla (pip install -e '.[xla]')")
        return torch.device("cpu")
    if world_size > 1:
        if choice == "xla":
            raise SystemExit(
                "torch_xla cannot run collectives between XLA:CPU replicas (pytorch/xla#9089); "
                "run data parallel with --device cpu"
            )
        return torch.device("cpu")
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    return torch_xla.device()


def make_mlp(width: int, d_in: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(d_in, width), nn.GELU(), nn.LayerNorm(width),
        nn.Linear(width, width), nn.GELU(), nn.Linear(width, d_out),
    )


def main() -> None:
    args = parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1:
        dist.init_process_group("gloo")
    # The config first: with master weights it sets NEURON_RT_STOCHASTIC_ROUNDING_EN=0,
    # which the XLA runtime reads once when the device is first used.
    config = nxd_smp.neuronx_distributed_config(
        optimizer_config={"zero_one_enabled": True, "grad_clipping": True,
                          "max_grad_norm": args.max_grad_norm},
        mixed_precision_config={"use_master_weights": not args.no_master_weights,
                                "use_fp32_grad_acc": not args.no_master_weights},
    )
    device = pick_device(args.device, world_size)
    sync = (lambda: __import__("torch_xla").sync()) if device.type == "xla" else (lambda: None)

    d_in, d_out = 32, 8
    torch.manual_seed(args.seed)  # same initial weights on every rank
    teacher = make_mlp(64, d_in, d_out).eval()
    model = make_mlp(args.hidden, d_in, d_out).to(torch.bfloat16).to(device)

    optimizer = nxd_smp.initialize_parallel_optimizer(
        config, torch.optim.AdamW, model.parameters(), lr=args.lr, weight_decay=0.01
    )
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"nxd_smp {nxd_smp.__version__}: {n_params / 1e6:.2f}M bf16 params on {device}, "
              f"DP={world_size}, mixed precision {config['mixed_precision_config']}", flush=True)

    data = torch.Generator().manual_seed(1000 + rank)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        total = torch.zeros((), device=device)
        for _ in range(args.micro_batches):
            x = torch.randn(args.batch_size, d_in, generator=data)
            with torch.no_grad():
                y = teacher(x)
            x, y = x.to(torch.bfloat16).to(device), y.to(device)
            loss = (model(x).float() - y).pow(2).mean() / args.micro_batches
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        sync()
        if world_size > 1:
            dist.all_reduce(total)
            total /= world_size
        if rank == 0:
            print(f"step {step:4d}  loss {float(total):.5f}  grad_norm {float(optimizer.grad_norm):.4f}",
                  flush=True)
    if rank == 0:
        elapsed = time.perf_counter() - start
        print(f"done: {args.steps} steps in {elapsed:.1f}s ({args.steps / elapsed:.1f} steps/s)")
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
