"""The launch every Trainium user runs: ``torchrun`` with ``init_process_group("xla")``
before the optimizer is built, here on the XLA CPU device at one process (two XLA:CPU
processes each see a world of one, so DP > 1 runs on the replica threads of
test_xla_replicas.py). Each API and group form, and NxD's dict with the README's Trainium
settings (sharded accumulation), trains like the unsharded oracle; a
checkpoint saved from the XLA device resumes on the XLA device and on the CPU; the demo
takes the xla process group, launched as the README says."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.oracle import assert_params_close, run_oracle
from tests.xla_launch_worker import SAVED_AT, SCENARIO, STEPS, WARMUP, scenario_of

pytestmark = pytest.mark.requires_xla  # every test here runs torch_xla (tests/conftest.py skips them without it)
ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def launch_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")}
    return {**env, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("launch")
    proc = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "1", "tests/xla_launch_worker.py", str(out)],
        cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out / "results.pt", weights_only=True)


CASES = {"zero1_no_group": "zero1", "zero1_default_group": "zero1", "zero1_new_group": "zero1",
         "zero1_replica_groups": "zero1", "neuron": "neuron", "nxd_config": "nxd_config",
         "nxd_trainium_settings": "nxd_trainium"}  # case: the API it builds through


def test_the_launch_runs_under_the_xla_process_group(launched):
    assert launched["backend"] == "xla" and launched["world"] == 1


@pytest.mark.parametrize("case", CASES)
def test_every_api_and_group_form_trains_like_the_oracle_on_the_xla_backend(launched, case):
    got = launched["cases"][case]
    expected, norms = run_oracle(scenario_of(CASES[case]), 1)
    assert got["backend"] == "XlaBackend" and got["world_size"] == 1
    assert got["sharded_grad_acc"] == (case == "nxd_trainium_settings")
    assert_params_close(got["params"], expected)
    assert got["norms"] == pytest.approx(norms, rel=1e-5)
    assert got["compiles"][WARMUP - 1] == got["compiles"][-1], "a new graph after warm-up"


@pytest.mark.parametrize("where", ["xla", "cpu"])
def test_a_checkpoint_saved_from_the_xla_device_resumes_on_xla_and_on_cpu(launched, where):
    expected, _ = run_oracle(SCENARIO, 1)
    assert launched[f"resumed_on_{where}_backend"] == ("XlaBackend" if where == "xla" else "EagerBackend")
    # CPU eager continues with the fused AdamW kernel, XLA with the stock one: rare last-bit flips
    assert_params_close(launched[f"resumed_on_{where}"], expected, max_ulp=1, max_flip_fraction=0.03)
    assert STEPS > 3 and not all(torch.equal(a, launched["at_save"][n]) for n, a in expected.items())


def test_an_asynchronous_save_from_xla_keeps_the_state_of_its_step(launched):
    # AdamW keeps ``step`` on the host for XLA parameters; the writer ran after two more steps
    assert launched["async_saved_steps"] == [float(SAVED_AT)]


def readme_launch() -> list[str]:
    """The Trainium launch as the README shows it (its section "Running on Trainium")."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Running on Trainium"):]
    line = next(m.group(1) for m in re.finditer(r"^(PJRT_DEVICE=CPU torchrun .*)$", section, re.M))
    return shlex.split(line)


def test_the_demo_takes_the_xla_process_group_as_the_readme_launches_it(tmp_path):
    command = readme_launch()
    assert command[:2] == ["PJRT_DEVICE=CPU", "torchrun"] and "--device" in command and "xla" in command
    out = tmp_path / "gpt"
    proc = subprocess.run([TORCHRUN, *command[2:], "--out", str(out), "--no-progress"], cwd=ROOT,
                          env=launch_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["process_group"] == "xla" and summary["device"].startswith("xla")
    assert summary["final_val_loss"] < 5.5  # byte-level: ln(256) = 5.55 before training
    assert os.path.lexists(summary["checkpoint"])
