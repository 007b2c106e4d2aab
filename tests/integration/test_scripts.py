"""The demo (the README's main job) with tiny settings: it runs, its outputs are well-formed and
finite, it resumes from its checkpoint and takes an NxD config file; and every figure the README and
docs/results.md quote comes from a file a benchmark wrote. The numbers themselves come from the
scripts, not from here (the benchmarks' own smoke test parses their arguments:
tests/integration/test_benchmarks.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from tests.distributed import run_python

ROOT = Path(__file__).resolve().parents[2]
TINY_GPT = ["--layers", "1", "--width", "32", "--seq", "32", "--batch", "4"]


def run(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PJRT_DEVICE": "CPU"}
    proc = run_python([str(ROOT / "scripts" / script), *args], cwd=ROOT, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def test_train_gpt_runs_checkpoints_and_resumes(tmp_path):
    out = tmp_path / "gpt"
    args = [*TINY_GPT, "--device", "cpu", "--eval-every", "2", "--eval-iters", "1", "--ckpt-every", "2",
            "--out", str(out), "--no-progress"]
    proc = run("train_gpt.py", "--steps", "4", *args)
    assert "final train loss" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert finite(summary["final_train_loss"], summary["final_val_loss"], summary["tokens_per_s"], summary["peak_rss_mib"])
    assert summary["corpus"]["train_bytes"] > 0 and summary["corpus"]["val_bytes"] > 0
    assert os.path.lexists(summary["checkpoint"])
    assert sorted(p.name for p in (out / "ckpt").iterdir() if not p.name.startswith(".")) == ["step_2", "step_4"]
    run("train_gpt.py", "--steps", "6", "--resume", "--keep-ckpts", "1", *args)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # resumed at 5, not restarted
    assert sorted(p.name for p in (out / "ckpt").iterdir() if not p.name.startswith(".")) == ["step_6"]
    # The LR schedule resumed where it was: after 5 steps of the demo's warm-up/decay
    # schedule over 6 steps (restarted, it would be after 1).
    cfg = json.loads((out / "summary.json").read_text())["config"]
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lrs[4] == pytest.approx(cfg["lr"] * min(1, 6 / cfg["warmup"]) * max(0.1, 1 - 5 / 6))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(finite(r["loss"], r["grad_norm"], r["tokens_per_s"]) for r in records)


def test_train_gpt_takes_an_nxd_config_file(tmp_path):
    config = tmp_path / "nxd.json"
    config.write_text(json.dumps({"optimizer_config": {"zero_one_enabled": True, "max_grad_norm": 0.5},
                                  "mixed_precision_config": {"use_master_weights_in_ckpt": True}}))
    out = tmp_path / "gpt"
    run("train_gpt.py", "--steps", "2", *TINY_GPT, "--device", "cpu", "--config", str(config),
        "--eval-iters", "1", "--ckpt-every", "0", "--out", str(out), "--no-progress")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["nxd"]["optimizer_config"]["max_grad_norm"] == 0.5
    assert summary["config"]["nxd"]["mixed_precision_config"]["use_master_weights_in_ckpt"] is True


def test_every_figure_the_readme_and_the_results_page_quote_comes_from_a_benchmarks_file():
    run("results_table.py", "--check", "README.md", "--check-results", "docs/results.md")
