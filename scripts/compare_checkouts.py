#!/usr/bin/env python
"""Two checkouts of nxd_smp side by side, on what a change that should not change behaviour must
keep: the XLA step graphs (HLO instruction counts and the text's hash, compilations, one program for
every rank) and bytes per parameter (``bench_xla.py``), the CPU step against the roofline and its
bytes per parameter (``bench_step.py``, as ``make bench``), and checkpoint throughput against torch
(``bench_checkpoint.py``). Each benchmark is the checkout's own script over its own package (run with
that checkout first on ``PYTHONPATH``), the two checkouts alternating, so a slow spell of the machine
falls on both; the ratios are reported as medians over the runs, with their range.

    git worktree add /tmp/base <earlier commit>
    python scripts/compare_checkouts.py /tmp/base --out docs/compare_checkouts.json
    python scripts/compare_checkouts.py /tmp/base --step-runs 1 --checkpoint-runs 0 --xla-args "--width 256 --layers 2 4 --dp 1"
    python scripts/compare_checkouts.py /tmp/base --skip-xla     # the CPU step and the checkpoints only
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
XLA_ARGS = "--width 1024 --layers 4 8 --dp 1 2 --iters 3 --warmup 3"


def run(checkout: Path, script: str, args: list[str], out: Path) -> dict:
    """``checkout``'s ``scripts/<script>`` over ``checkout``'s package; its JSON."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "PJRT_DEVICE": "CPU"}
    proc = subprocess.run([sys.executable, str(checkout / "scripts" / script), *args, "--out", str(out)],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: {script} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def check_imports_its_own(checkout: Path) -> None:
    """Refuse to compare a checkout whose scripts would import another copy of nxd_smp (an
    installed one, say) than its own."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    found = subprocess.run([sys.executable, "-c", "import nxd_smp; print(nxd_smp.__file__)"], cwd=checkout, env=env,
                           capture_output=True, text=True, timeout=300).stdout.strip()
    if not found or not Path(found).resolve().is_relative_to(checkout):
        raise SystemExit(f"{checkout}: its scripts would import nxd_smp from {found or 'nowhere'}, not from it")


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", type=Path, help="the other checkout (a git worktree of an earlier commit)")
    p.add_argument("--xla-args", default=XLA_ARGS, help=f"bench_xla.py's arguments (default: {XLA_ARGS})")
    p.add_argument("--skip-xla", action="store_true", help="leave out the XLA step graphs (bench_xla.py)")
    p.add_argument("--step-runs", type=int, default=3, help="bench_step.py runs per checkout (default 3)")
    p.add_argument("--checkpoint-runs", type=int, default=2, help="bench_checkpoint.py runs per checkout (default 2)")
    p.add_argument("--checkpoint-args", default="--repeats 3", help="bench_checkpoint.py's arguments")
    p.add_argument("--out", type=Path, default=Path("bench_results/compare_checkouts.json"))
    a = p.parse_args()
    base = a.base.resolve()
    if not (base / "nxd_smp" / "__init__.py").is_file() or not (base / "scripts" / "bench_xla.py").is_file():
        p.error(f"{base} is not a checkout of nxd_smp (no nxd_smp/ and scripts/bench_xla.py)")
    if a.step_runs < 0 or a.checkpoint_runs < 0:
        p.error("--step-runs and --checkpoint-runs must be >= 0")
    checkouts = {"base": base, "this": ROOT}
    for path in checkouts.values():
        check_imports_its_own(path)
    result: dict = {"command": " ".join(sys.argv), "checkouts": {
        name: subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip() or str(path) for name, path in checkouts.items()}}
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    changes = ", with its uncommitted changes" if dirty else ""
    report = [f"this checkout ({result['checkouts']['this']}{changes}) against "
              f"{result['checkouts']['base']}; the benchmarks alternate between the two", ""]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not a.skip_xla:
            xla = {name: run(path, "bench_xla.py", shlex.split(a.xla_args), tmp / f"xla_{name}.json")
                   for name, path in checkouts.items()}
            graphs = {}
            report += [f"XLA step graphs (bench_xla.py {a.xla_args}):", "",
                       "| run | HLO instructions | same HLO text | compilations (after warm-up) | one program for all ranks "
                       "| bytes/param/rank |", "|---|---|---|---|---|---|"]
            for kind, theirs in xla["base"]["results"].items():
                ours = xla["this"]["results"][kind]
                b, t = theirs["large"], ours["large"]
                graphs[kind] = {"hlo_instructions": [b["step_hlo_instructions"], t["step_hlo_instructions"]],
                                "same_hlo": b["step_hlo_sha"] == t["step_hlo_sha"],
                                "compiles": [[b["compiles"], b["compiles_after_warmup"]],
                                             [t["compiles"], t["compiles_after_warmup"]]],
                                "one_program": [b["one_graph_for_all_ranks"], t["one_graph_for_all_ranks"]],
                                "bytes_per_param": [theirs["bytes_per_param"], ours["bytes_per_param"]]}
                g = graphs[kind]
                report.append(f"| {kind} | {g['hlo_instructions'][0]} -> {g['hlo_instructions'][1]} | "
                              f"{'yes' if g['same_hlo'] else 'no'} | {b['compiles']} ({b['compiles_after_warmup']}) -> "
                              f"{t['compiles']} ({t['compiles_after_warmup']}) | {b['one_graph_for_all_ranks']} -> "
                              f"{t['one_graph_for_all_ranks']} | {g['bytes_per_param'][0]:.1f} -> "
                              f"{g['bytes_per_param'][1]:.1f} |")
            result["xla"] = graphs
        steps: dict[str, list[dict]] = {name: [] for name in checkouts}
        for i in range(a.step_runs):
            for name, path in checkouts.items():
                steps[name].append(run(path, "bench_step.py", [], tmp / f"step_{name}_{i}.json"))
        ckpts: dict[str, list[dict]] = {name: [] for name in checkouts}
        for i in range(a.checkpoint_runs):
            for name, path in checkouts.items():
                ckpts[name].append(run(path, "bench_checkpoint.py", shlex.split(a.checkpoint_args),
                                       tmp / f"ckpt_{name}_{i}.json"))
    rows = []
    if a.step_runs:
        for key, label in (("ratio", "CPU step / roofline (make bench)"),
                           ("bytes_per_param_slope", "bytes per parameter on CPU (slope)")):
            result.setdefault("step", {})[key] = {name: spread([r[key] for r in runs]) for name, runs in steps.items()}
            rows.append((label, result["step"][key]))
    if a.checkpoint_runs:
        # The ratios are speeds (MB/s) over torch's, so above 1 is faster than torch. torch's side of a
        # load ends in this checkout's optimizer.load_state_dict, so nxd_smp's own MB/s are shown too.
        for key, label, value in (
            ("save_ratio", "checkpoint save speed / torch.save's", lambda r: r["save_ratio"]),
            ("load_ratio_cold", "checkpoint cold load speed / torch.load's", lambda r: r["load_ratio_cold"]),
            ("load_ratio_warm", "checkpoint warm load speed / torch.load's", lambda r: r["load_ratio_warm"]),
            ("save_MBps", "checkpoint save, MB/s", lambda r: r["save_MBps"]["nxd_smp"]),
            ("load_MBps_cold", "checkpoint cold load, MB/s", lambda r: r["load_MBps"]["cold"]["nxd_smp"]),
            ("load_MBps_warm", "checkpoint warm load, MB/s", lambda r: r["load_MBps"]["warm"]["nxd_smp"]),
            ("async_blocking_fraction", "asynchronous save: blocks / sync save",
             lambda r: r["async_blocking_fraction"]),
        ):
            result.setdefault("checkpoint", {})[key] = {name: spread([value(r) for r in runs])
                                                       for name, runs in ckpts.items()}
            rows.append((label, result["checkpoint"][key]))
    if rows:
        report += ["", f"medians (range) of {a.step_runs} bench_step.py and {a.checkpoint_runs} bench_checkpoint.py "
                       f"({a.checkpoint_args}) runs per checkout, largest size:", "",
                   "| measure | base | this |", "|---|---|---|"]
        report += [f"| {label} | {v['base']['median']:.2f} ({v['base']['min']:.2f}-{v['base']['max']:.2f}) | "
                   f"{v['this']['median']:.2f} ({v['this']['min']:.2f}-{v['this']['max']:.2f}) |" for label, v in rows]
    print("\n".join(report))
    result["report"] = report
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
