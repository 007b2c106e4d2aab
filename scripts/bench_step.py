#!/usr/bin/env python
"""Optimizer-step benchmark: Zero1Optimizer against the practical roofline.

DP=1 on CPU, a bf16 model of >= 20M parameters, AdamW with SMP (fp32 master weights,
fp32 main_grad, clipping on). The roofline is ``torch.optim.AdamW(fused=True)`` over one
flat fp32 tensor of the same size plus the copy of it into a bf16 buffer: the least
work any fp32-master optimizer step must do. The two are timed alternately in one
process; the ratio of medians is reported.

Memory: resident bytes per parameter beyond the bf16 parameters, measured as the peak
RSS (VmHWM, reset through /proc/self/clear_refs) during backward + step, minus the RSS
with only the bf16 model. Expected: 4 (main_grad) + 4 (master) + 8 (Adam states) = 16.

    python scripts/bench_step.py                 # prints a table, writes JSON
    python scripts/bench_step.py --params 50e6 --iters 30
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

import nxd_smp

REQUIRED = {"ratio": 1.25, "bytes_per_param": 18.0}
TARGET = {"ratio": 1.10, "bytes_per_param": 16.0}


def rss_bytes(field: str) -> int:
    """VmRSS or VmHWM of this process, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def make_model(n_params: float, width: int) -> nn.Sequential:
    layers = max(1, round(n_params / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width, dtype=torch.bfloat16) for _ in range(layers)])


def main() -> None:
    # glibc keeps freed heap pages resident, so RSS would measure the allocator's history
    # rather than the live tensors. A fixed mmap threshold returns every large free to
    # the OS at once; it is read at startup, hence the re-exec.
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and sys.platform.startswith("linux"):
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=21e6, help="approximate parameter count (default 21e6)")
    p.add_argument("--width", type=int, default=2048, help="Linear layer width (default 2048)")
    p.add_argument("--iters", type=int, default=20, help="timed steps of each (default 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_step.json"))
    args = p.parse_args()
    if args.params < 1 or args.width < 1 or args.iters < 1:
        p.error("--params, --width and --iters must be positive")

    # Touch every code path once on a tiny model, so the pages of the libraries and
    # kernels they load are in the baseline rather than counted per parameter.
    tiny = make_model(1, 64)
    tiny_opt = nxd_smp.Zero1Optimizer(tiny.parameters(), torch.optim.AdamW, lr=1e-4)
    tiny(torch.randn(2, 64, dtype=torch.bfloat16)).float().sum().backward()
    tiny_opt.step()
    del tiny, tiny_opt

    torch.manual_seed(0)
    model = make_model(args.params, args.width)
    n = sum(q.numel() for q in model.parameters())
    x = torch.randn(8, args.width, dtype=torch.bfloat16)
    gc.collect()
    base_rss = rss_bytes("VmRSS")

    reset_peak_rss()
    opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, weight_decay=0.01)
    build_peak = rss_bytes("VmHWM")
    gc.collect()
    can_reset = reset_peak_rss()
    model(x).float().pow(2).mean().backward()  # fills the fp32 main_grad buffers
    for _ in range(args.warmup):
        opt.step()
    steady_peak = rss_bytes("VmHWM")

    flat = torch.randn(n, dtype=torch.float32) * 0.02
    flat.grad = torch.randn(n, dtype=torch.float32) * 1e-3
    bf16 = torch.empty(n, dtype=torch.bfloat16)
    roof = torch.optim.AdamW([flat], lr=1e-4, weight_decay=0.01, fused=True)

    def roofline_step() -> None:
        roof.step()
        bf16.copy_(flat)

    for _ in range(args.warmup):
        roofline_step()
    ours, roofline = [], []
    for _ in range(args.iters):
        t = time.perf_counter()
        opt.step()
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        roofline_step()
        roofline.append(time.perf_counter() - t)

    ours_ms = statistics.median(ours) * 1e3
    roof_ms = statistics.median(roofline) * 1e3
    ratio = ours_ms / roof_ms
    per_param = (steady_peak - base_rss) / n
    result = {
        "params": n,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "zero1_step_ms_median": ours_ms,
        "roofline_step_ms_median": roof_ms,
        "ratio": ratio,
        "bytes_per_param_beyond_bf16_params": per_param,
        "peak_reset_supported": can_reset,
        "construction_peak_bytes_per_param": (build_peak - base_rss) / n,
        "required": REQUIRED,
        "target": TARGET,
        "meets_required": ratio <= REQUIRED["ratio"] and per_param <= REQUIRED["bytes_per_param"],
        "zero1_step_ms_all": [t * 1e3 for t in ours],
        "roofline_step_ms_all": [t * 1e3 for t in roofline],
    }
    rows = [
        ("parameters (bf16)", f"{n / 1e6:.1f}M"),
        ("Zero1Optimizer.step() median", f"{ours_ms:.1f} ms"),
        ("roofline: fused AdamW fp32 + copy to bf16", f"{roof_ms:.1f} ms"),
        ("ratio (required <= 1.25, target <= 1.10)", f"{ratio:.3f}"),
        ("bytes/param beyond bf16 params (req <= 18, target 16)", f"{per_param:.2f}"),
        ("peak during construction, bytes/param", f"{result['construction_peak_bytes_per_param']:.2f}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'metric':<{width}}  value")
    print(f"{'-' * width}  -----")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
