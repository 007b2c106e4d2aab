"""The benchmarks in the suite: each script parses its arguments (one interpreter for all of them:
``--help`` exits before any work), and the memory slope refuses sizes its meter cannot tell apart.
Running them is the benchmarks' job (``make bench``, ``make bench-peers``, ``make compare``, the
commands in docs/results.md), not the suite's: their figures, and every check a run makes of its own
output, come from the scripts at full size. What they measure of nxd_smp's behaviour is tested
where it is the behaviour (one program on every replica and no compile after warm-up:
tests/integration/test_xla_replicas.py and test_xla_graphs.py; the wire bytes of the memory options:
tests/unit/optim/test_memory_options.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.distributed import run_python

ROOT = Path(__file__).resolve().parents[2]


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


#: Every benchmark and comparison in scripts/ (the demo, train_gpt.py, runs in test_scripts.py; the
#: accelerator check in tests/unit/backend/test_device_decisions.py).
BENCHMARKS = ["bench_step.py", "bench_checkpoint.py", "bench_peers.py", "bench_tp.py", "bench_xla.py",
              "compare_memory_options.py", "compare_precision.py", "compare_checkouts.py", "xla_memory_phases.py",
              "bench_full_state.py"]

PARSE_ALL = """
import contextlib, io, runpy, sys
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), (script, e.code)
    assert out.getvalue().startswith("usage:"), (script, out.getvalue()[:200])
    print("parsed", script)
"""


def test_every_benchmark_parses_its_arguments():
    # (bench_step.py re-executes itself before parsing, to set the allocator's environment: alone)
    for names in (["bench_step.py"], [name for name in BENCHMARKS if name != "bench_step.py"]):
        scripts = [str(ROOT / "scripts" / name) for name in names]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "USE_TORCH_XLA": "0"}
        proc = run_python(["-c", PARSE_ALL, *scripts], cwd=ROOT, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        if names == ["bench_step.py"]:  # (the re-executed process printed the usage itself)
            assert proc.stdout.startswith("usage: bench_step.py"), proc.stdout[:300]
        else:
            assert proc.stdout.count("parsed") == len(names), proc.stdout[-2000:]
