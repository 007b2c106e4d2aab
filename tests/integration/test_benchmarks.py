"""Smoke tests of the benchmarks with small settings: each runs and writes finite JSON with the
command that made it and the report it printed. Their figures come from the scripts at full
size (docs/results.md), not from here. A memory slope needs two sizes that peak RSS can tell
apart, so the smallest settings here are 1M parameters apart (``scripts/memory_slope.py``)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.integration.test_scripts import ROOT, finite, run

sys.path.insert(0, str(ROOT / "scripts"))
from memory_slope import MIN_PARAMS, check_sizes, slope  # noqa: E402


def test_a_memory_slope_over_sizes_the_meter_cannot_tell_apart_is_refused_not_divided_by():
    """Over 4,160 parameters the slope came out 0 or negative (the allocator's noise), and a ratio
    against it inf: the benchmarks refuse such sizes before they run, naming the fix."""
    with pytest.raises(ValueError, match="at least"):
        check_sizes(4_160, 8_320)
    with pytest.raises(ValueError, match="cannot resolve"):
        slope(10 << 20, 4_160, 10 << 20, 8_320)
    assert slope(100 << 20, MIN_PARAMS, (100 << 20) + 18 * MIN_PARAMS, 2 * MIN_PARAMS, per=2) == 9.0


def test_the_step_benchmark_writes_finite_json(tmp_path):
    run("bench_step.py", "--params", "1.1e6", "--width", "1024", "--iters", "3", "--out", str(tmp_path / "step.json"))
    step = json.loads((tmp_path / "step.json").read_text())
    assert finite(step["ratio"], step["bytes_per_param_slope"], step["zero1_step_ms_median"])


def test_the_checkpoint_benchmark_writes_finite_json(tmp_path):
    run("bench_checkpoint.py", "--params", "2e5", "4e5", "--width", "256", "--repeats", "1",
        "--out", str(tmp_path / "ckpt.json"))
    ckpt = json.loads((tmp_path / "ckpt.json").read_text())
    assert finite(ckpt["save_ratio"], ckpt["load_ratio_cold"], ckpt["load_ratio_warm"], ckpt["async_blocking_fraction"],
                  *ckpt["save_MBps"].values(), *ckpt["load_MBps"]["cold"].values())
    assert len(ckpt["results"]) == 2 and "bench_checkpoint.py" in ckpt["command"]


def test_the_peers_benchmark_writes_finite_json(tmp_path):
    # the XLA half is bench_xla's own code (the next test): the gloo half here
    run("bench_peers.py", "--only", "gloo", "--width", "1024", "--layers", "1", "2", "--iters", "1", "--warmup", "2",
        "--out", str(tmp_path / "peers.json"))
    peers = json.loads((tmp_path / "peers.json").read_text())
    assert finite(*peers["ratios"].values()) and set(peers["ratios"]) == {
        "vs_torch_zero_ddp_step", "vs_torch_zero_ddp_iter", "vs_torch_zero_ddp_memory"}
    assert finite(peers["results"]["torch_zero_ddp"]["bytes_per_param"]) and peers["report"]


def test_the_memory_options_benchmark_writes_finite_json(tmp_path):
    run("bench_step.py", "--options", "--option", "sharded_acc", "--params", "1.1e6", "--width", "1024", "--iters", "1",
        "--bucket-cap-mb", "4", "--out", str(tmp_path / "options.json"))
    result = json.loads((tmp_path / "options.json").read_text())
    assert set(result["memory"]) == {"default", "sharded_acc"}
    assert finite(*(m["bytes_per_param"] for m in result["memory"].values()), *result["iteration_ms_median"].values())
    # bytes sent grow with the micro-batches only when the accumulation is sharded
    wire = result["timing"]["wire_bytes"]
    assert wire["default/16"] == wire["default/1"] < wire["sharded_acc/4"] < wire["sharded_acc/16"]


def test_the_demo_comparison_of_the_memory_options_writes_finite_json(tmp_path):
    run("compare_memory_options.py", "--steps", "2", "--option", "sharded_acc+remainders",
        "--out", str(tmp_path / "demo.json"), "--",
        "--device", "cpu", "--layers", "1", "--width", "32", "--heads", "2", "--seq", "16", "--batch", "2",
        "--eval-every", "2", "--eval-iters", "1")
    result = json.loads((tmp_path / "demo.json").read_text())
    assert set(result["results"]) == {"default", "sharded_acc+remainders"}
    assert result["results"]["default"]["train_vs_default"] == 0 and result["report"]
    assert finite(*(r["final_train_loss"] for r in result["results"].values()))
