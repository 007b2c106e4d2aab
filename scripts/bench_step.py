#!/usr/bin/env python
"""Optimizer-step benchmark: Zero1Optimizer against the practical roofline.

DP=1 on CPU, a bf16 model of >= 20M parameters, AdamW with SMP (fp32 master weights,
fp32 main_grad, clipping on). The roofline is ``torch.optim.AdamW(fused=True)`` over one
flat fp32 tensor of the same size plus the copy of it into a bf16 buffer: the least
work any fp32-master optimizer step must do. Each step, ours and the roofline's, follows its
own backward (a step consumes the accumulation of its own backward): ours fills the fp32
accumulation through its hooks, the roofline's is the same model under plain autograd (a bf16
``.grad``, set to None after its step). Both are timed alternately in one process: the step
ratio of medians with the spread of the per-pair ratios, each backward, and backward + step
against the roofline's backward + step (work moved from the step into the backward shows
there).

Memory is a slope (docs/design.md, "How performance is measured"): the peak RSS (VmHWM) of backward + step at two
model sizes, each in its own process, difference over difference. It counts everything
that grows with the model: 2 (bf16 parameters) + 4 (main_grad) + 4 (master) + 8 (Adam
states) = 18 bytes per parameter, and any transient copy on top.

    python scripts/bench_step.py                 # prints a table, writes JSON
    python scripts/bench_step.py --params 50e6 --iters 30

``--options`` measures the memory options instead (docs/design.md, "Memory options"), at DP=2
over gloo on this machine's CPU: per option (the default, sharded fp32 accumulation, parameter
remainders, both), the peak-RSS slope per rank (each size in freshly spawned ranks) beside the
figure the option must hold, the bytes each rank sends per step for 1, 4 and 16 micro-batches
(ring collectives: (N-1)/N of each buffer), and the iteration time (backward of every
micro-batch + step) at those micro-batch counts, the options alternating in one pair of ranks.
It also measures how much of the sharded accumulation's reduce-scatters backward hides.

    python scripts/bench_step.py --options --out docs/bench_step_options.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

import nxd_smp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_slope import check_sizes, rss_bytes, slope  # noqa: E402

REQUIRED = {"ratio": 1.25, "bytes_per_param": 20.0}
# The memory target at DP=1 (docs/design.md): 6 + 12/N bytes per parameter, plus 2%.
TARGET = {"ratio": 1.05, "bytes_per_param": (6 + 12) * 1.02}


class Weights(nn.Module):
    """bf16 weights of ``width`` x ``width`` whose loss is element-wise (each weight times
    one fixed bf16 tensor): its backward fills ``main_grad`` in milliseconds, where a
    bf16 matmul backward takes seconds on CPUs without bf16 units and would dwarf the step."""

    def __init__(self, n_params: float, width: int):
        super().__init__()
        layers = self.layers(n_params, width)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(width, width, dtype=torch.bfloat16) * 0.02) for _ in range(layers)
        )

    @staticmethod
    def layers(n_params: float, width: int) -> int:
        return max(1, round(n_params / (width * width)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((w * x).float().sum() for w in self.weights)


def build(n_params: float, width: int, steps: int):
    """A model, its Zero1Optimizer and a backward closure, after ``steps`` warm-up steps."""
    torch.manual_seed(0)
    model = Weights(n_params, width)
    x = torch.randn(width, width, dtype=torch.bfloat16) * 1e-3
    opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, weight_decay=0.01)

    def backward() -> None:  # fills the fp32 main_grad buffers; each step consumes them
        model(x).backward()

    for _ in range(steps):
        backward()
        opt.step()
    return model, opt, backward


def memory_probe(n_params: float, width: int, steps: int) -> dict:
    """Run in a fresh process: the peak RSS of building and stepping one model size."""
    model, _, _ = build(n_params, width, steps)
    gc.collect()
    return {"params": sum(q.numel() for q in model.parameters()), "peak_bytes": rss_bytes("VmHWM")}


def probe_in_subprocess(n_params: float, width: int, steps: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--memory-probe", "--params", str(n_params), "--width", str(width),
         "--warmup", str(steps)],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- --options (DP=2, gloo)
OPTIONS = {
    "default": {},
    "sharded_acc": {"use_sharded_grad_acc": True},
    "remainders": {"use_param_remainders": True},
    "sharded_acc+remainders": {"use_sharded_grad_acc": True, "use_param_remainders": True},
}
MICRO = (1, 4, 16)


def options_floor(name: str, world: int) -> float:
    """Bytes per parameter per rank an option holds (a backward of ``Weights`` makes its bf16
    gradient one parameter at a time, so none is counted): bf16 parameters 2, the fp32
    accumulation 4 (4/N sharded), masters and Adam states 12/N (10/N with remainders)."""
    o = OPTIONS[name]
    return 2 + (4 / world if o.get("use_sharded_grad_acc") else 4) + (10 if o.get("use_param_remainders") else 12) / world


def _options_optimizer(name: str, model: nn.Module, bucket_cap_mb: float) -> nxd_smp.Zero1Optimizer:
    return nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, weight_decay=0.01,
                                  bucket_cap_mb=bucket_cap_mb,
                                  mixed_precision=nxd_smp.MixedPrecisionConfig(**OPTIONS[name]))


def _wire_bytes(opt: nxd_smp.Zero1Optimizer, micro: int) -> int:
    """Bytes one rank sends per step in ring collectives: (N-1)/N of every reduce-scattered
    gradient (fp32; every micro-batch when sharded) and of every gathered parameter (bf16)."""
    n = opt.world_size
    padded = sum(layout.padded_numel for layout in opt.bucket_layouts)
    reduces = micro if opt.mixed_precision.use_sharded_grad_acc else 1
    return int((n - 1) / n * padded * (4 * reduces + 2))


def options_memory_rank(rank: int, world: int, name: str, n_params: float, width: int, cap: float) -> dict:
    torch.manual_seed(0)
    model = Weights(n_params, width)
    x = torch.randn(width, width, dtype=torch.bfloat16) * 1e-3
    opt = _options_optimizer(name, model, cap)
    for _ in range(3):
        for _ in range(2):
            model(x).backward()
        opt.step()
    gc.collect()
    return {"params": sum(q.numel() for q in model.parameters()), "peak_bytes": rss_bytes("VmHWM")}


def options_timing_rank(rank: int, world: int, n_params: float, width: int, iters: int, cap: float,
                        names: list[str]) -> dict:
    """Every option over its own copy of the model, alternating; times per micro-batch count."""
    torch.manual_seed(0)
    x = torch.randn(width, width, dtype=torch.bfloat16) * 1e-3
    runs = {}
    for name in names:
        model = Weights(n_params, width)
        runs[name] = (model, _options_optimizer(name, model, cap))
    times = {f"{name}/{micro}": [] for name in names for micro in MICRO}
    backward_ms = {name: [] for name in names}
    for it in range(iters + 1):
        for micro in MICRO:
            for name, (model, opt) in runs.items():
                torch.distributed.barrier()
                t = time.perf_counter()
                for m in range(micro):
                    b = time.perf_counter()
                    model(x).backward()
                    if micro == 1:
                        backward_ms[name].append((time.perf_counter() - b) * 1e3)
                opt.step()
                if it:  # the first round warms up
                    times[f"{name}/{micro}"].append((time.perf_counter() - t) * 1e3)
    # What the sharded accumulation's reduce-scatters cost when nothing hides them: the same
    # buckets reduce-scattered one after the other, outside backward.
    sharded = next(opt for _, opt in runs.values() if opt.mixed_precision.use_sharded_grad_acc)
    flats = [torch.randn(layout.padded_numel) for layout in sharded.bucket_layouts]
    exposed = []
    for _ in range(iters):
        torch.distributed.barrier()
        t = time.perf_counter()
        for flat in flats:
            sharded.backend.reduce_scatter_start(flat).wait()
        exposed.append((time.perf_counter() - t) * 1e3)
    wire = {f"{name}/{micro}": _wire_bytes(opt, micro) for name, (_, opt) in runs.items() for micro in MICRO}
    return {"times_ms": times, "backward_ms": backward_ms, "reduce_scatter_alone_ms": exposed, "wire_bytes": wire,
            "params": sum(q.numel() for q in runs["default"][0].parameters())}


def run_options(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.distributed import run_ranks

    world = 2
    memory = {}
    chosen = [name for name in OPTIONS if name == "default" or name in args.option]
    for name in chosen:
        small, large = (max(run_ranks(world, options_memory_rank, name, n, args.width, args.bucket_cap_mb,
                                      start_method="spawn"),
                            key=lambda r: r["peak_bytes"])
                        for n in (args.params, 2 * args.params))
        memory[name] = {"small": small, "large": large,
                        "bytes_per_param": slope(small["peak_bytes"], small["params"], large["peak_bytes"],
                                                 large["params"]),
                        "floor": options_floor(name, world)}
        print(f"  {name}: {memory[name]['bytes_per_param']:.2f} bytes/param", flush=True)
    # (the timings alternate the options in one pair of ranks: how the ranks start does not enter them)
    timing = run_ranks(world, options_timing_rank, args.params, args.width, args.iters, args.bucket_cap_mb,
                       chosen)[0]
    med = {key: statistics.median(v) for key, v in timing["times_ms"].items()}
    bwd = {name: statistics.median(v) for name, v in timing["backward_ms"].items()}
    alone = statistics.median(timing["reduce_scatter_alone_ms"])
    shard_name = next(name for name in chosen if OPTIONS[name].get("use_sharded_grad_acc"))
    hidden = (bwd["default"] + alone - bwd[shard_name]) / alone if alone > 0 else float("nan")
    n = timing["params"]
    report = [f"DP=2 over gloo on {os.cpu_count()} CPU cores, {n / 1e6:.1f}M bf16 parameters (memory: slope against "
              f"{2 * args.params / 1e6:.0f}M, each size in fresh ranks), AdamW, buckets of {args.bucket_cap_mb:g} MiB; "
              f"iteration = backward of every micro-batch + step, median of {args.iters}, options alternating in "
              f"one pair of ranks", "",
              "| option | bytes/param/rank | floor | MB sent per step per rank (1 / 4 / 16 micro-batches) | "
              "iteration ms (1 / 4 / 16) | / default (1 / 4 / 16) |", "|---|---|---|---|---|---|"]
    for name in chosen:
        sent = " / ".join(f"{timing['wire_bytes'][f'{name}/{m}'] / 2**20:.0f}" for m in MICRO)
        its = " / ".join(f"{med[f'{name}/{m}']:.0f}" for m in MICRO)
        rel = " / ".join(f"{med[f'{name}/{m}'] / med[f'default/{m}']:.2f}" for m in MICRO)
        report.append(f"| {name} | {memory[name]['bytes_per_param']:.2f} | {memory[name]['floor']:.1f} | {sent} | {its} | {rel} |")
    report += ["", f"backward of one micro-batch: {bwd['default']:.1f} ms without communication, {bwd[shard_name]:.1f} ms "
               f"with the sharded accumulation's asynchronous reduce-scatters; the same reduce-scatters alone take "
               f"{alone:.1f} ms, so backward hides {100 * hidden:.0f}% of them"]
    print("\n".join(report))
    result = {"command": " ".join(sys.argv), "report": report, "memory": memory, "iteration_ms_median": med,
              "backward_ms_median": bwd, "reduce_scatter_alone_ms_median": alone, "hidden_fraction": hidden,
              "timing": timing, "options": OPTIONS, "world_size": world, "cpus": os.cpu_count(),
              "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


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
    p.add_argument("--memory-probe", action="store_true", help=argparse.SUPPRESS)  # internal: one size
    p.add_argument("--options", action="store_true",
                   help="measure the memory options at DP=2 over gloo instead (see above)")
    p.add_argument("--option", nargs="+", choices=[name for name in OPTIONS if name != "default"],
                   default=[name for name in OPTIONS if name != "default"],
                   help="with --options: the options measured beside the default (default: all; one "
                        "with sharded accumulation is needed)")
    p.add_argument("--bucket-cap-mb", type=float, default=32.0,
                   help="with --options: the bucket size of every option (default 32: the sharded "
                        "accumulation's staging, two buckets, stays small beside the models measured)")
    args = p.parse_args()
    if args.params < 1 or args.width < 1 or args.iters < 1 or args.warmup < 1:
        p.error("--params, --width, --iters and --warmup must be positive")
    try:  # the memory slope is over the model at --params and at twice that
        check_sizes(*(Weights.layers(n, args.width) * args.width**2 for n in (args.params, 2 * args.params)))
    except ValueError as e:
        p.error(str(e))
    if args.options:
        if not any(OPTIONS[name].get("use_sharded_grad_acc") for name in args.option):
            p.error("--option needs one with sharded accumulation (sharded_acc or sharded_acc+remainders)")
        run_options(args)
        return
    if args.memory_probe:
        print(json.dumps(memory_probe(args.params, args.width, args.warmup)))
        return

    small = probe_in_subprocess(args.params, args.width, args.warmup)
    large = probe_in_subprocess(2 * args.params, args.width, args.warmup)
    per_param = slope(small["peak_bytes"], small["params"], large["peak_bytes"], large["params"])

    model, opt, backward = build(args.params, args.width, args.warmup)
    n = sum(q.numel() for q in model.parameters())
    flat = torch.randn(n, dtype=torch.float32) * 0.02
    flat.grad = torch.randn(n, dtype=torch.float32) * 1e-3
    bf16 = torch.empty(n, dtype=torch.bfloat16)
    roof = torch.optim.AdamW([flat], lr=1e-4, weight_decay=0.01, fused=True)

    def roofline_step() -> None:
        roof.step()
        bf16.copy_(flat)

    # The roofline's backward: the same model under plain autograd (a bf16 .grad, set to None
    # after each step as training loops do), the backward any optimizer's user runs.
    torch.manual_seed(0)
    plain = Weights(args.params, args.width)
    x = torch.randn(args.width, args.width, dtype=torch.bfloat16) * 1e-3

    def plain_backward() -> None:
        plain(x).backward()

    def plain_zero_grad() -> None:
        plain.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        plain_backward()
        roofline_step()
        plain_zero_grad()
    ours, roofline, ours_bwd, roofline_bwd = [], [], [], []
    for _ in range(args.iters):
        for run_backward, step, times, bwd_times, after in ((backward, opt.step, ours, ours_bwd, None),
                                                            (plain_backward, roofline_step, roofline, roofline_bwd,
                                                             plain_zero_grad)):
            t = time.perf_counter()
            run_backward()  # ours: the accumulation its step consumes; the roofline's: the same work, discarded
            bwd_times.append(time.perf_counter() - t)
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
            if after is not None:
                after()

    ours_ms = statistics.median(ours) * 1e3
    roof_ms = statistics.median(roofline) * 1e3
    ratio = ours_ms / roof_ms
    bwd_ms, roof_bwd_ms = statistics.median(ours_bwd) * 1e3, statistics.median(roofline_bwd) * 1e3
    both = [(b + s_) / (rb + rs) for b, s_, rb, rs in zip(ours_bwd, ours, roofline_bwd, roofline)]
    both_ratio = statistics.median(both)
    both_q1, _, both_q3 = statistics.quantiles(both, n=4) if len(both) > 1 else (both_ratio,) * 3
    pair_ratios = sorted(a / b for a, b in zip(ours, roofline))
    q1, _, q3 = statistics.quantiles(pair_ratios, n=4) if len(pair_ratios) > 1 else (ratio, ratio, ratio)
    result = {
        "command": " ".join(sys.argv),
        "params": n,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "zero1_step_ms_median": ours_ms,
        "roofline_step_ms_median": roof_ms,
        "ratio": ratio,
        "ratio_per_pair_quartiles": [q1, q3],
        "bytes_per_param_slope": per_param,
        "memory_probes": [small, large],
        "required": REQUIRED,
        "target": TARGET,
        "meets_required": ratio <= REQUIRED["ratio"] and per_param <= REQUIRED["bytes_per_param"],
        "meets_target": ratio <= TARGET["ratio"] and per_param <= TARGET["bytes_per_param"],
        "backward_ms_median": bwd_ms,
        "roofline_backward_ms_median": roof_bwd_ms,
        "backward_plus_step_ratio": both_ratio,
        "backward_plus_step_ratio_quartiles": [both_q1, both_q3],
        "zero1_step_ms_all": [t * 1e3 for t in ours],
        "roofline_step_ms_all": [t * 1e3 for t in roofline],
    }
    rows = [
        ("parameters (bf16)", f"{n / 1e6:.1f}M"),
        ("Zero1Optimizer.step() median", f"{ours_ms:.1f} ms"),
        ("roofline: fused AdamW fp32 + copy to bf16", f"{roof_ms:.1f} ms"),
        ("ratio (required <= 1.25, target <= 1.05)", f"{ratio:.3f}"),
        ("per-pair ratio, quartiles", f"{q1:.3f} .. {q3:.3f}"),
        ("backward before it: ours (hooks into the fp32 accumulation) / plain autograd (bf16 .grad)",
         f"{bwd_ms:.1f} ms / {roof_bwd_ms:.1f} ms"),
        ("backward + step against the roofline's backward + step, median of pairs (quartiles)",
         f"{both_ratio:.3f} ({both_q1:.3f} .. {both_q3:.3f})"),
        (f"peak RSS slope {small['params'] / 1e6:.0f}M -> {large['params'] / 1e6:.0f}M, bytes/param "
         f"(target <= {TARGET['bytes_per_param']:.2f})", f"{per_param:.2f}"),
    ]
    report = ["| metric | value |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows]
    result["report"] = report
    print("\n".join(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
