#!/usr/bin/env python
"""Where the peak of ``scripts/bench_xla.py`` is: the resident memory per parameter of each
phase of an iteration on the XLA CPU replicas, for torch_xla's ZeRO-1 as NxD ships it and for
nxd_smp with each memory option.

The same model, optimizers and harness as ``bench_xla.py`` (its ``make_model`` and ``build``).
In one iteration after warm-up, rank 0 resets the process's peak resident size (``VmHWM``,
through ``/proc/self/clear_refs``) before each phase and reads it after the phase's graph ran:

* ``between steps``: what stays resident between iterations (parameters, optimizer state and
  whatever the optimizer keeps);
* ``forward+backward``: the peak of the forward and backward graph, above ``between steps``;
* ``step``: the peak of the optimizer-step graph, above ``between steps``.

Each figure is a slope over two depths run in separate processes, per rank, as in
``bench_xla.py`` (``MALLOC_MMAP_THRESHOLD_`` is fixed, so glibc returns large buffers when XLA
frees them and the resident size follows the live buffers). The iteration's peak is
``between steps`` plus the larger of the other two.

To see which buffers a graph holds, run with XLA's dumps on and read the buffer assignment of
the graph (``*-buffer-assignment.txt``, its ``preallocated-temp`` allocation)::

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" python scripts/xla_memory_phases.py \
        --kinds nxd_smp_sharded_acc --dp 4 --layers 8 16

Prints a table and writes JSON (``--out``).

    python scripts/xla_memory_phases.py --out docs/xla_memory_phases.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from memory_slope import check_depths  # noqa: E402
from memory_slope import slope as bytes_slope  # noqa: E402

from scripts.memory_slope import rss_bytes  # noqa: E402
from scripts.bench_xla import KINDS, build, make_model, theory  # noqa: E402

PHASES = ("between steps", "forward+backward", "step")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def replica(rank: int, world: int, kind: str, width: int, layers: int, warmup: int) -> dict[str, Any]:
    """One replica's run (called by tests/xla_replicas.py in the script's child process)."""
    import torch_xla

    from nxd_smp.backend.xla import restart_channel_ids
    from tests.xla_replicas import barrier, serial, sync, wait_for_device

    device = torch_xla.device()
    with serial:
        model = make_model(width, layers)
    model = model.to(device)
    opt = build(kind, model, world)
    sync()
    g = torch.Generator().manual_seed(rank)
    measured: dict[str, int] = {}

    def settle() -> None:
        sync()
        wait_for_device()
        barrier()

    for i in range(warmup + 1):
        x = torch.randn(16, width, generator=g).bfloat16()
        last = i == warmup
        settle()
        if last and rank == 0:
            _reset_peak()
            measured["between steps"] = rss_bytes("VmRSS")
        barrier()
        model(x.to(device)).float().pow(2).mean().backward()
        settle()
        if last and rank == 0:
            measured["forward+backward"] = rss_bytes("VmHWM") - measured["between steps"]
            _reset_peak()
        barrier()
        restart_channel_ids()
        opt.step()
        opt.zero_grad()
        settle()
        if last and rank == 0:
            measured["step"] = rss_bytes("VmHWM") - measured["between steps"]
        barrier()
    return {"params": sum(p.numel() for p in model.parameters()), "bytes": measured}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, nargs=2, default=[8, 16], help="two depths for the slope")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 4])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--kinds", nargs="+", choices=KINDS,
                   default=["torch_xla", "nxd_smp", "nxd_smp_sharded_acc", "nxd_smp_both"])
    p.add_argument("--out", type=Path, default=Path("bench_results/xla_memory_phases.json"))
    a = p.parse_args()
    if a.layers[0] >= a.layers[1] or min(a.layers) < 1 or min(a.dp) < 1 or a.width < 1 or a.warmup < 2:
        p.error("--layers needs two increasing positive depths; --dp and --width positive; --warmup >= 2")
    check_depths(p, a.width, a.layers)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # as bench_xla.py: large frees go back
    from tests.xla_replicas import run_replicas

    results, rows = {}, []
    for world in a.dp:
        for kind in a.kinds:
            small, large = (run_replicas(world, "scripts.xla_memory_phases:replica", kind, a.width, layers,
                                         a.warmup, timeout=1800, compile_in_turn=False)[0] for layers in a.layers)
            slope = {phase: bytes_slope(small["bytes"][phase], small["params"], large["bytes"][phase], large["params"],
                                        per=world) for phase in PHASES}
            peak = slope["between steps"] + max(slope["forward+backward"], slope["step"])
            results[f"{kind}_dp{world}"] = {"bytes_per_param": slope, "peak": peak,
                                            "floor": theory(kind, world), "small": small, "large": large}
            rows.append((f"{kind} DP={world}", *(f"{slope[phase]:.1f}" for phase in PHASES), f"{peak:.1f}",
                         f"{theory(kind, world):.1f}"))
            print(f"  {kind} DP={world}: " + ", ".join(f"{k} {v:.1f}" for k, v in slope.items()), flush=True)
    header = ("optimizer", "between steps", "+ forward+backward peak", "+ step peak", "iteration peak", "floor")
    report = [f"bytes per parameter per rank; bf16 MLP, {a.layers[0]} and {a.layers[1]} layers of {a.width}; "
              f"XLA CPU replicas in one process", "",
              "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    report += ["| " + " | ".join(row) + " |" for row in rows]
    print("\n" + "\n".join(report))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"results": results, "report": report, "command": " ".join(sys.argv),
                                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}},
                                indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
