#!/usr/bin/env python
"""The demo (``scripts/train_gpt.py``) once per memory option: does each end where the default
ends, and at what speed?

Each option is the default NxD config (ZeRO-1, SMP) plus its ``mixed_precision_config`` keys,
passed to the demo as an NxD config file (``--config``); each run is a fresh process with the
same seed, data and steps. Reported per option: the final training loss (mean of the last 10
steps) and validation loss, their difference from the default's, and tokens per second against
the default's. The runs go one after the other, so the speed ratios carry the host's noise; the
losses do not (the runs are deterministic).

    python scripts/compare_memory_options.py --out docs/memory_options_demo.json
    python scripts/compare_memory_options.py --steps 50 --out /tmp/options.json   # a quick look
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.bench_step import OPTIONS  # noqa: E402  (the same options as the gloo benchmark)

#: The issue's target: each option's final loss within 0.05% of the default's.
TARGET_REL = 5e-4


def run_demo(name: str, steps: int, micro: int, work: Path, extra: list[str]) -> dict:
    config = work / f"{name}.json"
    config.write_text(json.dumps({
        "optimizer_config": {"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0},
        "mixed_precision_config": {"use_master_weights": True, "use_fp32_grad_acc": True, **OPTIONS[name]},
    }))
    out = work / name
    subprocess.run([sys.executable, str(ROOT / "scripts" / "train_gpt.py"), "--config", str(config),
                    "--steps", str(steps), "--micro-batches", str(micro), "--out", str(out),
                    "--ckpt-every", "0", "--no-progress", *extra], check=True, cwd=ROOT)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="the demo's steps (default: the demo's 300)")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--option", nargs="+", choices=[name for name in OPTIONS if name != "default"],
                   default=[name for name in OPTIONS if name != "default"],
                   help="the options run beside the default (default: all)")
    p.add_argument("--out", type=Path, default=Path("bench_results/memory_options_demo.json"))
    p.add_argument("demo_args", nargs="*", help="more arguments for train_gpt.py (after --)")
    a = p.parse_args()
    if a.steps < 1 or a.micro_batches < 1:
        p.error("--steps and --micro-batches must be positive")
    with tempfile.TemporaryDirectory() as work:
        runs = {name: run_demo(name, a.steps, a.micro_batches, Path(work), a.demo_args)
                for name in OPTIONS if name == "default" or name in a.option}
    base = runs["default"]
    rows, results = [], {}
    for name, s in runs.items():
        rel_train = s["final_train_loss"] / base["final_train_loss"] - 1
        rel_val = s["final_val_loss"] / base["final_val_loss"] - 1
        speed = s["tokens_per_s"] / base["tokens_per_s"]
        results[name] = {"final_train_loss": s["final_train_loss"], "final_val_loss": s["final_val_loss"],
                         "train_vs_default": rel_train, "val_vs_default": rel_val, "tokens_per_s": s["tokens_per_s"],
                         "speed_vs_default": speed, "peak_rss_mib": s["peak_rss_mib"],
                         "within_target": abs(rel_train) <= TARGET_REL and abs(rel_val) <= TARGET_REL}
        rows.append(f"| {name} | {s['final_train_loss']:.4f} ({100 * rel_train:+.3f}%) | "
                    f"{s['final_val_loss']:.4f} ({100 * rel_val:+.3f}%) | {s['tokens_per_s']:,.0f} ({speed:.2f}x) |")
    report = [f"The demo, {a.steps} steps of {a.micro_batches} micro-batch(es), {base['params'] / 1e6:.2f}M parameters "
              f"on {base['device']} (DP={base['dp_size']}); in brackets: against the default (target: losses "
              f"within {100 * TARGET_REL:.2f}%)", "",
              "| option | final train loss | final val loss | tokens/s |", "|---|---|---|---|", *rows]
    print("\n".join(report))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"command": " ".join(sys.argv), "report": report, "results": results,
                                 "options": OPTIONS, "target_rel": TARGET_REL}, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
