"""The Hugging Face ``Trainer`` with a nxd_smp optimizer at DP 2, on two ranks with the environment
``torchrun --nproc-per-node 2`` gives them (gloo on the CPU; forked from the tests' preloaded
server, ``tests/distributed.py``), against the same run at DP 1 with the same global batch, and its
own checkpoints (``save_steps``, ``resume_from_checkpoint``) against the uninterrupted run
(``tests/trainer_dp_worker.py``: one launch per DP size runs every scenario). The same DP 2 save
and resume under ``torchrun`` itself is the guide's snippet ("The Trainer at DP > 1, with its
checkpoints", ``tests/docs/test_docs_snippets.py``); on the XLA CPU device the worker is an
interpreter of its own (transformers must import with ``USE_TORCH_XLA=1`` there).

Under torchrun the Trainer moves the model to ``cpu:0``, which copies every parameter after
the optimizer was built; the optimizer takes the copies back into its flat buffers. The DP 2
step reduces the gradients of two batches of two as the DP 1 run accumulates them (accelerate
gives rank r the r-th batch of each pair), so the runs agree bit for bit, and a resume at
either DP size continues either run exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nxd_smp.checkpoint import read_checkpoint
from nxd_smp.interop.loop_checkpoints import check_reference
from tests.distributed import run_launched, run_python
from tests.oracle import assert_same_run

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")}
    return {**env, "PYTHONPATH": str(ROOT), "USE_TORCH_XLA": "0"}


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trainer_dp")
    # DP 1 first: the DP 2 launch resumes from its checkpoint
    proc = run_python(["tests/trainer_dp_worker.py", str(out / "dp1")], cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    proc = run_launched(2, ["tests/trainer_dp_worker.py", str(out / "dp2"), str(out / "dp1")], cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def on_xla(tmp_path_factory) -> Path:
    """DP 1 on the XLA CPU device: the Trainer's torch_xla branches, run by the Trainer itself."""
    out = tmp_path_factory.mktemp("trainer_xla")
    env = {**_env(), "PJRT_DEVICE": "CPU", "USE_TORCH_XLA": "1"}
    proc = subprocess.run([sys.executable, "tests/trainer_dp_worker.py", str(out / "dp1")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def ranks(out: Path, dp: str, scenario: str) -> list[dict]:
    return [torch.load(f, weights_only=True) for f in sorted((out / dp / scenario).glob("rank*.pt"))]


def test_the_trainer_runs_on_two_ranks_on_the_device_accelerate_chose(out):
    assert [r["world"] for r in ranks(out, "dp2", "full")] == [2, 2]
    assert all(r["device"] == "cpu:0" for r in ranks(out, "dp2", "full"))  # the copy the optimizer had to take back


@pytest.mark.parametrize("scenario", ["full", "ddp_bytes"])
def test_the_ranks_agree_and_equal_the_dp1_run_with_the_same_global_batch(out, scenario):
    """``full`` skips DDP's all-reduce (the callback has the trainer), ``ddp_bytes`` keeps it."""
    (rank0, rank1), (single,) = ranks(out, "dp2", scenario), ranks(out, "dp1", "full")
    for name, value in single["params"].items():
        assert torch.equal(rank0["params"][name], rank1["params"][name]), name
        assert torch.equal(rank0["params"][name], value), name
    masters = torch.cat([rank0["masters"][0], rank1["masters"][0]])
    n = min(masters.numel(), single["masters"][0].numel())
    assert torch.equal(masters[:n], single["masters"][0][:n])


@pytest.mark.parametrize("dp", ["dp1", "dp2"])
@pytest.mark.parametrize("scenario", ["resumed", "xla_order", "xla_order_resumed"])
def test_a_resume_from_step_3_continues_the_uninterrupted_run_exactly_on_every_rank(out, dp, scenario):
    """``save_steps=3`` then ``resume_from_checkpoint`` (from a copy of checkpoint-3), through the
    Trainer's CPU call order and its torch_xla one (every rank calls ``state_dict()``)."""
    for got, expected in zip(ranks(out, dp, scenario), ranks(out, dp, "full"), strict=True):
        assert_same_run(got, expected)


@pytest.mark.requires_xla
def test_on_the_xla_device_the_trainers_own_xla_order_resumes_exactly(on_xla):
    (full,), (resumed,) = ranks(on_xla, "dp1", "full"), ranks(on_xla, "dp1", "resumed")
    assert full["device"] == "xla:0" and full["error"] is None
    reference = check_reference(torch.load(on_xla / "dp1" / "resumed" / "checkpoint-6" / "optimizer.pt",
                                           weights_only=True), "optimizer.pt")  # written by xm.save
    assert reference["dp_size"] == 1
    assert_same_run(resumed, full)


def test_a_save_the_trainer_decides_after_the_step_is_written_late_and_resumes_exactly(out):
    """``save_strategy="best"``: the Trainer decides after evaluating, past ``on_step_end``; the
    callback writes nxd_smp's files in ``on_save``, warns of the window, and replaces
    ``optimizer.pt`` (rank 0's state by then) by the reference."""
    (best,), (resumed,), (full,) = (ranks(out, "dp1", s) for s in ("best", "best_resumed", "full"))
    assert_same_run(best, full)
    assert_same_run(resumed, full)
    assert any("after the Trainer's files" in w for w in best["warnings"]), best["warnings"]
    # a save decided at the step (save_steps) is written before the Trainer's files: no such warning (the
    # callback stays after DefaultFlowCallback, whose should_save it reads in on_step_end)
    assert not any("after the Trainer's files" in w for w in full["warnings"]), full["warnings"]
    check_reference(torch.load(out / "dp1" / "best" / "checkpoint-3" / "optimizer.pt", weights_only=True), "optimizer.pt")


def test_a_resume_at_another_dp_size_reshards(out):
    """DP 1's checkpoint-3 resumed at DP 2 continues like the DP 2 run (which equals DP 1's)."""
    for got, expected in zip(ranks(out, "dp2", "from_dp1"), ranks(out, "dp2", "full"), strict=True):
        assert_same_run(got, expected)


@pytest.mark.parametrize("scenario", ["full", "xla_order"])
def test_the_trainers_optimizer_file_refers_to_every_ranks_state_saved_beside_it(out, scenario):
    """``optimizer.pt`` (rank 0's file) is the reference; the nxd_smp checkpoint beside it holds
    what DP 1's holds at the same step: the DP 1 run's masters and moments, bit for bit."""
    checkpoint = out / "dp2" / scenario / "checkpoint-3"
    reference = check_reference(torch.load(checkpoint / "optimizer.pt", weights_only=True), "optimizer.pt")
    assert reference["dp_size"] == 2 and reference["checkpoint"] == "nxd_smp"
    saved, single = (read_checkpoint(c / "nxd_smp")["optimizer"]
                     for c in (checkpoint, out / "dp1" / "full" / "checkpoint-3"))
    for name, master in single["master_weights"].items():
        assert torch.equal(saved["master_weights"][name], master), name
        for key, value in single["state"][name].items():
            assert torch.equal(saved["state"][name][key], value), (name, key)


def test_rotation_removes_nxd_smps_files_with_the_trainers(out):
    """``save_total_limit=1``: checkpoint-6 replaces the checkpoint-3 resumed from, nxd_smp's
    version folder and link included; nothing of nxd_smp is left beside the checkpoints."""
    run = out / "dp2" / "resumed"
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-6", "rank0.pt", "rank1.pt"]
    beside = sorted(p.name for p in (run / "checkpoint-6").iterdir() if "nxd_smp" in p.name)
    assert len(beside) == 3 and ".nxd_smp_saves.json" in beside and beside[2] == "nxd_smp" and (run / "checkpoint-6" / "nxd_smp").is_symlink()


def test_a_checkpoint_missing_one_ranks_shard_is_refused_on_every_rank_naming_it_and_changes_nothing(out):
    version = (out / "dp2" / "full" / "checkpoint-3" / "nxd_smp").resolve()
    missing = min(f.name for f in version.iterdir() if f.name.startswith("__1_"))  # what the worker removed
    for rank in ranks(out, "dp2", "missing_shard"):
        assert rank["error"].startswith("CheckpointError") and f"{missing} is missing" in rank["error"], rank["error"]
        before = rank["at_load"]  # when the Trainer handed over optimizer.pt
        for a, b in zip(rank["masters"], before["masters"], strict=True):
            assert torch.equal(a, b)
        for name, value in before["params"].items():
            assert torch.equal(rank["params"][name], value), name


def test_saving_at_dp2_without_the_trainer_is_refused_before_training(out):
    for rank in ranks(out, "dp2", "saving_without_the_trainer"):
        assert rank["error"].startswith("ConfigError") and "Zero1TrainerCallback(trainer)" in rank["error"]


def test_an_optimizer_built_before_the_process_group_is_refused_at_its_first_step(tmp_path):
    """Built before ``TrainingArguments`` (which initialises torch.distributed), it is a DP
    group of one: each rank would train alone, so its first step refuses, on every rank. Each rank
    then ends as the worker does (``tests/trainer_dp_worker.py``): a barrier, so that no rank closes
    its gloo connections while the other is still in a collective, and the group destroyed (a stuck
    collective fails after ``ddp_timeout`` instead of hanging the launch). Whether an interpreter's
    exit with gloo's threads up aborts ("terminate called without an active exception",
    pytorch/pytorch#190489) shows only under ``torchrun`` itself, where the guide's DP 2 snippets
    end the same way (tests/docs/test_docs_snippets.py)."""
    script = tmp_path / "early.py"
    script.write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "from transformers import Trainer, TrainingArguments\n"
        "import nxd_smp\n"
        "from tests.loops_worker import make_model, markov_data\n"
        "model = make_model(torch.bfloat16)\n"
        "opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW)\n"
        f"args = TrainingArguments(output_dir={str(tmp_path / 'out')!r}, per_device_train_batch_size=2, max_steps=1,\n"
        "                         report_to='none', save_strategy='no', use_cpu=True, disable_tqdm=True,\n"
        "                         ddp_timeout=120)\n"
        "data = [{'input_ids': t, 'labels': t} for t in markov_data(8, seed=1)]\n"
        "try:\n"
        "    Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None)).train()\n"
        "except RuntimeError as e:\n"
        "    assert 'before torch.distributed was initialised' in str(e), e\n"
        "    print('REFUSED', flush=True)\n"
        "finally:\n"
        "    if dist.is_initialized():\n"
        "        dist.barrier()\n"
        "        dist.destroy_process_group()\n"
    )
    proc = run_launched(2, [str(script)], cwd=ROOT, env=_env(), timeout=300)
    report = f"exit code {proc.returncode}\n" + proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("REFUSED") == 2, report
    assert proc.returncode == 0, report


def test_ddp_all_reduces_a_bf16_gradient_per_step_unless_the_callback_skips_it(out):
    """DDP's reducer sends every parameter's bf16 ``.grad`` (zeros: the optimizer's hooks took
    them) each step: 2 bytes per parameter, counted by a hook that does DDP's own all-reduce.
    ``Zero1TrainerCallback(trainer)`` replaces it by a hook that sends nothing, and the run is
    the same (above)."""
    counted, (single,) = ranks(out, "dp2", "ddp_bytes")[0], ranks(out, "dp1", "full")
    per_step = 2 * sum(p.numel() for p in single["params"].values())
    assert sum(counted["ddp_bytes"]) == per_step * counted["steps"]
