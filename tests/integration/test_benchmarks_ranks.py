"""Smoke tests of the benchmarks that run ranks or replicas of their own (the XLA benchmark's, the
tensor-parallel one's), with small settings; a module apart from tests/integration/test_benchmarks.py so that
the two halves run on different workers."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_scripts import finite, run


@pytest.mark.requires_xla
def test_xla_benchmark_runs_both_optimizers_on_replicas(tmp_path):
    # time: both in one process, alternating (a small width: no memory slope to resolve)
    run("bench_xla.py", "--time-only", "--width", "256", "--time-layers", "1", "--dp", "2", "--pairs", "2",
        "--warmup", "2", "--out", str(tmp_path / "time.json"), timeout=900)
    result = json.loads((tmp_path / "time.json").read_text())
    for shape in ("nxd_loop", "one_graph"):
        timed = result["timing"]["dp2"][shape]
        assert len(timed["pair_ratios"]) == 2 and finite(timed["ratio"], *timed["iter_ms"].values())
        assert all(timed["one_program_for_all_ranks"].values()) and timed["compiles_after_warmup"] == 0
        assert result["ratios"]["dp2"][shape] == timed["ratio"]
    assert not result["results"] and "split per tensor" in result["baseline"]
    # memory: each optimizer in processes of its own
    run("bench_xla.py", "--memory-only", "--width", "1024", "--layers", "1", "2", "--dp", "2", "--iters", "1",
        "--warmup", "2", "--kinds", "torch_xla", "nxd_smp", "--out", str(tmp_path / "memory.json"), timeout=900)
    result = json.loads((tmp_path / "memory.json").read_text())
    assert not result["timing"]
    for kind in ("nxd_smp_dp2", "torch_xla_dp2"):
        large = result["results"][kind]["large"]
        assert finite(large["iter_ms"], large["compile_s"], result["results"][kind]["bytes_per_param"])
        assert large["one_graph_for_all_ranks"] and large["compiles_after_warmup"] == 0


def test_the_tensor_parallel_benchmark_writes_finite_json_for_both_sides(tmp_path):
    run("bench_tp.py", "--width", "64", "--layers", "1", "--micro", "1", "--iters", "2", "--warmup", "1", "--no-peak",
        "--out", str(tmp_path / "tp.json"))
    result = json.loads((tmp_path / "tp.json").read_text())
    sides = result["results"]
    assert set(sides) == {"nxd_smp", "fsdp2"} and result["report"] and "bench_tp.py" in result["command"]
    for side in sides.values():
        assert finite(side["iter_ms_median"], side["step_ms_median"], side["held_bytes_per_param"],
                      side["sent_bytes_per_iteration"], side["first_grad_norm"])
        assert min(side["iter_ms_median"], side["step_ms_median"], side["held_bytes_per_param"],
                   side["sent_bytes_per_iteration"]) > 0
    # the same model on the same data: the first step's gradient norms agree (bf16 gradients summed in fp32)
    assert abs(sides["nxd_smp"]["first_grad_norm"] - sides["fsdp2"]["first_grad_norm"]) <= 1e-3 * sides["fsdp2"][
        "first_grad_norm"]
    # held at the step, counted from the tensors: nxd_smp bf16 parameters and fp32 accumulation over TP 2 (3),
    # masters and Adam states over TP 2 x DP 2 (3); FSDP2 fp32 parameters, gradients and states over 4 (4)
    assert sides["nxd_smp"]["held_bytes_per_param"] == pytest.approx(6.0, abs=0.1)
    assert sides["fsdp2"]["held_bytes_per_param"] == pytest.approx(4.0, abs=0.1)
    assert finite(*(r["median"] for r in result["ratios"].values()))
