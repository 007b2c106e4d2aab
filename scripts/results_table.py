#!/usr/bin/env python
"""The README's "Measured" table, made from the JSON files the benchmarks wrote in ``docs/``.

Every figure the README quotes comes from one of those files: this prints the table from them,
and ``--check README.md`` says whether the README's table is that table; ``--check-results
docs/results.md`` whether that page shows each benchmark's command and its report as the script
printed it (the ``command`` and ``report`` of each JSON file). ``tests/integration/test_scripts.py`` runs both checks, so a figure cannot be
typed in by hand or outlive a rerun.

    python scripts/results_table.py                   # print the table
    python scripts/results_table.py --check README.md --check-results docs/results.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
HEADER = ["| what | measured | target | made by (the file holds the command and the report) |", "|---|---|---|---|"]
#: The files whose ``report`` docs/results.md shows, as the scripts printed it.
REPORTS = ["precision/results.json", "bench_step.json", "bench_peers.json", "bench_xla.json", "bench_xla_matmul.json",
           "bench_checkpoint.json", "bench_step_options.json", "memory_options_demo.json", "compare_checkouts.json",
           "check_accelerator_cuda.json", "bench_tp.json", "bench_full_state.json",
           "compare_checkouts_issue51.json", "bench_checkpoint_limit.json", "bench_checkpoint_s3.json"]


def _load(name: str) -> dict:
    return json.loads((DOCS / name).read_text())


def rows() -> list[str]:
    precision = _load("precision/results.json")
    by_run = {r["run"]: r for r in precision["runs"]}
    step = _load("bench_step.json")
    xla = _load("bench_xla.json")
    ckpt = _load("bench_checkpoint.json")
    q1, q3 = step["ratio_per_pair_quartiles"]
    pt, st, xt, ct = precision["targets"], step["target"], xla["targets"], ckpt["targets"]
    out = [
        ("SMP's validation loss against fp32 (GPT on real text; pure bf16 in brackets)",
         f"{100 * by_run['smp']['val_vs_fp32']:+.2f}% ({100 * by_run['bf16']['val_vs_fp32']:+.2f}%)",
         f"<= {100 * pt['smp_vs_fp32_rel']:.1f}%", "precision/results.json"),
        ("CPU step against the fused-AdamW roofline, a backward before each step (quartiles)",
         f"{step['ratio']:.2f} ({q1:.2f}-{q3:.2f})", f"<= {st['ratio']:.2f}", "bench_step.json"),
        ("bytes per parameter on CPU at DP=1 (slope)", f"{step['bytes_per_param_slope']:.1f}",
         f"<= {st['bytes_per_param']:.1f}", "bench_step.json"),
    ]
    out.append(("CPU backward + step against the roofline's backward + step (plain autograd, bf16 .grad; quartiles)",
                f"{step['backward_plus_step_ratio']:.2f} ({step['backward_plus_step_ratio_quartiles'][0]:.2f}-"
                f"{step['backward_plus_step_ratio_quartiles'][1]:.2f})", "report", "bench_step.json"))
    for world in (1, 2, 4):
        ratios = xla["ratios"].get(f"dp{world}")
        if ratios is None:
            continue
        forced = "" if world == 1 else "; torch_xla's collectives split per tensor (forced by XLA:CPU)"
        out.append((f"XLA iteration against torch_xla's ZeRO-1 in one process, NxD's loop / one graph per iteration, "
                    f"DP={world}{forced}", f"{ratios['nxd_loop']:.2f} / {ratios['one_graph']:.2f}",
                    f"<= {xt['nxd_loop']} / {xt['one_graph']}", "bench_xla.json"))
        out.append((f"XLA memory per parameter against torch_xla's ZeRO-1, DP={world}", f"{ratios['memory']:.2f}",
                    f"<= {xt['memory_ratio']}", "bench_xla.json"))
    matmul = _load("bench_xla_matmul.json")["ratios"]["dp1"]
    out.append(("XLA iteration against torch_xla's ZeRO-1, NxD's loop / one graph, DP=1, layers x @ W (no transposed "
                "weight gradient: docs/trainium.md)", f"{matmul['nxd_loop']:.2f} / {matmul['one_graph']:.2f}",
                f"<= {xt['nxd_loop']} / {xt['one_graph']}", "bench_xla_matmul.json"))
    for world, kind, target in ((1, xla["trainium_kind"], "dp1_memory_ratio"),
                                (4, "nxd_smp_both", "dp4_memory_ratio")):
        r = xla["ratios"].get(f"{kind}_dp{world}")
        if r is not None:
            what = "sharded accumulation (the README's Trainium settings)" if world == 1 else \
                "sharded accumulation + remainders"
            out.append((f"XLA memory per parameter against torch_xla's ZeRO-1, DP={world}, {what}",
                        f"{r['memory']:.2f}", f"<= {xla['option_targets'][target]}", "bench_xla.json"))
    tp = _load("bench_tp.json")
    mine, fsdp = tp["results"]["nxd_smp"], tp["results"]["fsdp2"]
    out.append(("DTensor TP 2 x ZeRO-1 DP 2 against FSDP2 (the same TP, fully_shard over dp, MixedPrecisionPolicy(bf16, "
                "fp32)): iteration / bytes held per parameter per rank / bytes sent per parameter per iteration",
                f"{tp['ratios']['iter_ms']['median']:.2f} / {mine['held_bytes_per_param']:.1f} against "
                f"{fsdp['held_bytes_per_param']:.1f} / {mine['sent_bytes_per_param']:.1f} against "
                f"{fsdp['sent_bytes_per_param']:.1f}", "report", "bench_tp.json"))
    options = _load("bench_step_options.json")
    for name, m in options["memory"].items():
        out.append((f"bytes per parameter per rank at DP=2 over gloo, {name} (slope)",
                    f"{m['bytes_per_param']:.2f}", f"floor {m['floor']:.1f}", "bench_step_options.json"))
    demo = _load("memory_options_demo.json")
    worst = max(abs(r[k]) for name, r in demo["results"].items() for k in ("train_vs_default", "val_vs_default"))
    out.append(("the demo's final losses with each memory option against the default's (largest difference)",
                f"{100 * worst:.3f}%", f"<= {100 * demo['target_rel']:.2f}%", "memory_options_demo.json"))
    for size in ckpt["results"]:
        out += [
            (f"checkpoint save / cold load / warm load against torch ({size['params'] / 1e6:.0f}M parameters)",
             f"{size['save_ratio']:.2f} / {size['load_ratio_cold']:.2f} / {size['load_ratio_warm']:.2f}",
             f">= {ct['save_ratio']} / {ct.get('load_ratio', ct['save_ratio'])} / {ct.get('load_ratio', ct['save_ratio'])}",
             "bench_checkpoint.json"),
            (f"asynchronous save: time training waits / a synchronous save ({size['params'] / 1e6:.0f}M)",
             f"{size['async_blocking_fraction']:.2f}", f"<= {ct['async_blocking_fraction']}", "bench_checkpoint.json"),
        ]
    return HEADER + [f"| {what} | {measured} | {target} | `python {_load(file)['command']}` |"
                     for what, measured, target, file in out]


def readme_table(readme: Path) -> list[str]:
    text = readme.read_text()
    section = text[text.index("## Measured"):]
    section = section[: section.find("\n## ", 4)]
    return [line for line in section.splitlines() if line.startswith("|")]


def missing_reports(results: Path) -> list[str]:
    """The JSON files whose report (as one block of lines) or command ``results`` does not show."""
    text = results.read_text()
    return [name for name in REPORTS
            if "\n".join(_load(name)["report"]) not in text or f"`python {_load(name)['command']}`" not in text]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", type=Path, help="a README whose Measured table must be this one")
    p.add_argument("--check-results", type=Path, help="a page that must show every benchmark's report")
    a = p.parse_args()
    table = rows()
    if a.check is None and a.check_results is None:
        print("\n".join(table))
        return
    failed = False
    if a.check is not None:
        if readme_table(a.check) != table:
            print(f"{a.check}'s Measured table is not the one the JSON files make:\n" + "\n".join(table))
            failed = True
        else:
            print(f"{a.check}'s Measured table matches docs/*.json")
    if a.check_results is not None:
        missing = missing_reports(a.check_results)
        if missing:
            print(f"{a.check_results} does not show the reports of {missing} as written")
            failed = True
        else:
            print(f"{a.check_results} shows every benchmark's report as written")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
