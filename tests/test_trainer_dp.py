"""The Hugging Face ``Trainer`` with a nxd_smp optimizer at DP 2, launched as its users launch
it (``torchrun --nproc-per-node 2``, gloo on the CPU), against the same run at DP 1 with the
same global batch (``tests/trainer_dp_worker.py``).

Under torchrun the Trainer moves the model to ``cpu:0``, which copies every parameter after
the optimizer was built; the optimizer takes the copies back into its flat buffers. The DP 2
step reduces the gradients of two batches of two as the DP 1 run accumulates them (accelerate
gives rank r the r-th batch of each pair), so the runs agree bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")}
    return {**env, "PYTHONPATH": str(ROOT), "USE_TORCH_XLA": "0"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("trainer_dp")
    dp2 = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "tests/trainer_dp_worker.py"]
    commands = {  # name: (command, DDP's all-reduce skipped)
        "dp2": (dp2 + [str(out / "dp2")], True),
        "dp2_ddp_allreduce": (dp2 + [str(out / "dp2_ddp_allreduce")], False),
        "dp1": ([sys.executable, "tests/trainer_dp_worker.py", str(out / "dp1")], False),
    }
    results = {}
    for name, (command, skip) in commands.items():
        env = {**_env(), "SKIP_DDP_ALLREDUCE": "1" if skip else "0"}
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        results[name] = [torch.load(f, weights_only=True) for f in sorted((out / name).glob("rank*.pt"))]
    return results


def test_the_trainer_runs_on_two_ranks_on_the_device_accelerate_chose(runs):
    assert [r["world"] for r in runs["dp2"]] == [2, 2]
    assert all(r["device"] == "cpu:0" for r in runs["dp2"])  # the copy the optimizer had to take back


@pytest.mark.parametrize("dp2", ["dp2", "dp2_ddp_allreduce"])
def test_the_ranks_agree_and_equal_the_dp1_run_with_the_same_global_batch(runs, dp2):
    (rank0, rank1), (single,) = runs[dp2], runs["dp1"]
    for name, value in single["params"].items():
        assert torch.equal(rank0["params"][name], rank1["params"][name]), name
        assert torch.equal(rank0["params"][name], value), name
    masters = torch.cat([rank0["masters"][0], rank1["masters"][0]])
    n = min(masters.numel(), single["masters"][0].numel())
    assert torch.equal(masters[:n], single["masters"][0][:n])


def test_an_optimizer_built_before_the_process_group_is_refused_at_its_first_step(tmp_path):
    """Built before ``TrainingArguments`` (which initialises torch.distributed), it is a DP
    group of one: each rank would train alone, so its first step refuses."""
    script = tmp_path / "early.py"
    script.write_text(
        "import torch\n"
        "from transformers import Trainer, TrainingArguments\n"
        "import nxd_smp\n"
        "from tests.loops_worker import make_model, markov_data\n"
        "model = make_model(torch.bfloat16)\n"
        "opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW)\n"
        f"args = TrainingArguments(output_dir={str(tmp_path / 'out')!r}, per_device_train_batch_size=2, max_steps=1,\n"
        "                         report_to='none', save_strategy='no', use_cpu=True, disable_tqdm=True)\n"
        "data = [{'input_ids': t, 'labels': t} for t in markov_data(8, seed=1)]\n"
        "try:\n"
        "    Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None)).train()\n"
        "except RuntimeError as e:\n"
        "    assert 'before torch.distributed was initialised' in str(e), e\n"
        "    print('REFUSED')\n"
    )
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.count("REFUSED") == 2, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_ddp_all_reduces_a_bf16_gradient_per_step_unless_the_callback_skips_it(runs):
    """DDP's reducer sends every parameter's bf16 ``.grad`` (zeros: the optimizer's hooks took
    them) each step: 2 bytes per parameter, counted by a hook that does DDP's own all-reduce.
    ``Zero1TrainerCallback(trainer)`` replaces it by a hook that sends nothing, and the run is
    the same (above)."""
    counted, (single,) = runs["dp2_ddp_allreduce"][0], runs["dp1"]
    per_step = 2 * sum(p.numel() for p in single["params"].values())
    assert sum(counted["ddp_bytes"]) == per_step * counted["steps"]
