#!/usr/bin/env python
"""Train the same GPT from the same seed in four precision modes, plus SMP at DP=2, and
compare: fp32, pure bf16 (no master weights), bf16 legacy with software stochastic
rounding, and SMP (ZeRO-1 + fp32 master weights + fp32 accumulation).

Writes ``OUT/loss_curves.png`` (matplotlib), ``OUT/results.md`` (a markdown table) and
``OUT/results.json``. Runs on plain CPU (gloo for DP=2) so the five runs are comparable.

    python scripts/compare_precision.py                # about 5 minutes on 2 cores
    python scripts/compare_precision.py --steps 20     # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt_lib import GPTConfig  # noqa: E402
from train_gpt import RunConfig, run  # noqa: E402

TARGETS = {"smp_vs_fp32_rel": 0.005, "dp2_vs_dp1_abs": 1e-3}


def _dp_worker(rank: int, world_size: int, port: int, cfg: RunConfig) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        run(replace(cfg, progress=cfg.progress and rank == 0))
    finally:
        dist.destroy_process_group()


def run_dp(cfg: RunConfig, world_size: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_dp_worker, args=(world_size, port, cfg), nprocs=world_size, join=True, start_method="spawn")
    return json.loads((Path(cfg.out) / "summary.json").read_text())


def curve(out: Path) -> tuple[list[int], list[float], list[tuple[int, float]]]:
    steps, losses, vals = [], [], []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        steps.append(r["step"])
        losses.append(r["loss"])
        if "val_loss" in r:
            vals.append((r["step"], r["val_loss"]))
    return steps, losses, vals


def smooth(values: list[float], k: int = 10) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-k:]
        out.append(sum(acc) / len(acc))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("runs/compare"))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--replot", action="store_true", help="only redraw the plot and table from OUT's runs")
    a = p.parse_args()
    if a.steps < 1 or a.batch < 2 or a.batch % 2 or a.lr <= 0:
        p.error("--steps >= 1, an even --batch >= 2 and --lr > 0 are needed")
    a.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # the DP=2 run shares the cores

    base = RunConfig(steps=a.steps, batch=a.batch, lr=a.lr, eval_every=a.eval_every, eval_iters=a.eval_iters,
                     model=GPTConfig(layers=a.layers, width=a.width, seq=a.seq), device="cpu", ckpt_every=0,
                     progress=not a.no_progress)
    runs = {}
    names = ("fp32", "smp", "bf16", "bf16_sr", "smp_dp2")
    if a.replot:  # redraw from the runs already in OUT
        runs = {name: json.loads((a.out / name / "summary.json").read_text()) for name in names}
    else:
        for name in names:
            out = a.out / name
            (out / "metrics.jsonl").unlink(missing_ok=True)
            cfg = replace(base, mode=name.replace("_dp2", ""), out=str(out))
            runs[name] = run_dp(cfg, 2) if name.endswith("_dp2") else run(cfg)

    fp32 = runs["fp32"]["final_val_loss"]
    rows = []
    for name, r in runs.items():
        rows.append({
            "run": name,
            "final_train_loss": r["final_train_loss"],
            "final_val_loss": r["final_val_loss"],
            "val_vs_fp32": r["final_val_loss"] / fp32 - 1,
            "tokens_per_s": r["tokens_per_s"],
        })
    checks = {
        "smp_vs_fp32_rel": abs(runs["smp"]["final_val_loss"] / fp32 - 1),
        "dp2_vs_dp1_abs": abs(runs["smp_dp2"]["final_val_loss"] - runs["smp"]["final_val_loss"]),
        "bf16_minus_smp": runs["bf16"]["final_val_loss"] - runs["smp"]["final_val_loss"],
    }
    passed = {
        "smp_within_0.5pct_of_fp32": checks["smp_vs_fp32_rel"] <= TARGETS["smp_vs_fp32_rel"],
        "dp2_within_1e-3_of_dp1": checks["dp2_vs_dp1_abs"] <= TARGETS["dp2_vs_dp1_abs"],
        "pure_bf16_worse_than_smp": checks["bf16_minus_smp"] > 0,
    }

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff) = plt.subplots(2, 1, figsize=(8, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    _, reference, ref_vals = curve(a.out / "fp32")
    for name in runs:
        steps, losses, vals = curve(a.out / name)
        style = "--" if name == "smp_dp2" else "-"
        line, = ax.plot(steps, smooth(losses), style, label=name, linewidth=1.2)
        if vals:
            ax.plot(*zip(*vals), "o", color=line.get_color(), markersize=4)
        delta = [x - y for x, y in zip(losses, reference)]
        diff.plot(steps, smooth(delta, 25), style, color=line.get_color(), linewidth=1.2)
        if vals:
            diff.plot([s for s, _ in vals], [v - r for (_, v), (_, r) in zip(vals, ref_vals)], "o",
                      color=line.get_color(), markersize=4)
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(f"GPT on stdlib sources, {runs['fp32']['params'] / 1e6:.2f}M params "
                 f"(lines: train, smoothed; dots: validation)")
    ax.grid(alpha=0.3)
    ax.legend()
    diff.axhline(0, color="black", linewidth=0.6)
    diff.set_xlabel("step")
    diff.set_ylabel("loss minus fp32's")
    diff.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out / "loss_curves.png", dpi=120)

    lines = [
        f"Same model, seed and data; {a.steps} steps, global batch {a.batch} x {base.model.seq} bytes, "
        f"AdamW lr {a.lr}, CPU.",
        "",
        "| run | final train loss | final val loss | val vs fp32 | tokens/s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['run']} | {r['final_train_loss']:.4f} | {r['final_val_loss']:.4f} | "
                     f"{100 * r['val_vs_fp32']:+.2f}% | {r['tokens_per_s']:,.0f} |")
    lines += ["", f"SMP vs fp32: {100 * checks['smp_vs_fp32_rel']:.3f}% (target <= 0.5%); "
              f"SMP DP=2 vs DP=1: {checks['dp2_vs_dp1_abs']:.2e} (target <= 1e-3); "
              f"pure bf16 - SMP: {checks['bf16_minus_smp']:+.4f}"]
    (a.out / "results.md").write_text("\n".join(lines) + "\n")
    (a.out / "results.json").write_text(json.dumps({"runs": rows, "checks": checks, "passed": passed,
                                                     "targets": TARGETS, "command": " ".join(sys.argv),
                                                     "report": lines},
                                                    indent=2) + "\n")
    print("\n".join(lines))
    print(f"wrote {a.out / 'loss_curves.png'}, {a.out / 'results.md'}, {a.out / 'results.json'}")


if __name__ == "__main__":
    main()
