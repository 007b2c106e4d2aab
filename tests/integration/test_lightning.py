"""PyTorch Lightning with ``Zero1LightningCallback`` (native suite: Lightning is installed there only),
on ranks with the environment ``torchrun`` gives them, where Lightning's DDP strategy finds its
cluster (forked from the tests' preloaded server, ``tests/distributed.py``; ``tests/lightning_worker.py``)
at DP 1 and DDP 2. The guide's snippet ("PyTorch Lightning", ``tests/docs/test_docs_snippets.py``)
runs under ``torchrun`` itself.

The oracle is the fp32-master reference: an fp32 copy of the model trained by torch's AdamW on the
same global batches, clipped by torch's ``clip_grad_norm_`` at ``gradient_clip_val``. The masters'
the masters (rel. L2 at most 1e-2), their updates (at most 5e-2) and the Adam moments (at most 1e-2)
must match it; calibrated: a reference at lr/10 and a pure-bf16 run fail the updates' comparison, and
moments clipped at the optimizer's own ``max_norm`` (10x) the moments'. The resume through Lightning's own ``trainer.save_checkpoint`` and
``fit(ckpt_path=...)`` equals the uninterrupted run bit for bit; without the callback it is refused on
every rank, nothing corrupted.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from tests.distributed import run_launched, run_python  # noqa: E402
from tests.lightning_worker import CLIP, GLOBAL_BATCH, LR, STEPS, data, initial_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


# One launch per DP size runs every mode of tests/lightning_worker.py (the refusal last).
MODES = {1: ("clip", "resume"), 2: ("clip", "resume", "no_callback")}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(ranks)[mode]``: what rank 0 wrote for that mode, each DP size launched once per module."""
    cache: dict[int, dict] = {}

    def get(ranks: int) -> dict:
        if ranks not in cache:
            out = tmp_path_factory.mktemp("lightning") / f"dp{ranks}.pt"
            env = {**os.environ, "USE_TORCH_XLA": "0", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
            proc = run_launched(ranks, ["-m", "tests.lightning_worker", str(out), *MODES[ranks]], cwd=ROOT, env=env)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            cache[ranks] = torch.load(out, weights_only=True)
        return cache[ranks]

    return get


def reference(lr: float = LR, clip: float | None = CLIP, dtype: torch.dtype = torch.float32) -> tuple[dict, dict]:
    """torch's AdamW on the whole model in ``dtype`` over the same global batches: weights, moments."""
    model = initial_model().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    dataset = data()
    for step in range(STEPS):
        batch = step % (len(dataset) // GLOBAL_BATCH)  # (epochs of the same batches)
        x, y = dataset[batch * GLOBAL_BATCH:(batch + 1) * GLOBAL_BATCH]
        (model(x.to(dtype)).float() - y).pow(2).mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    weights = {n: p.detach().float() for n, p in model.named_parameters()}
    moments = {f"{n}/{k}": opt.state[p][k].float() for n, p in model.named_parameters() for k in ("exp_avg",)}
    return weights, moments


def update_error(got: dict, expected: dict) -> float:
    """The weights' update against the reference's, rel. L2 over the whole model."""
    initial = {n: p.detach().float() for n, p in initial_model().named_parameters()}
    diff = sum(((got[n] - initial[n]) - (expected[n] - initial[n])).pow(2).sum() for n in expected)
    return float(diff.sqrt() / sum((expected[n] - initial[n]).pow(2).sum() for n in expected).sqrt())


def moment_error(got: dict, expected: dict) -> float:
    diff = sum((got[k] - expected[k]).pow(2).sum() for k in expected)
    return float(diff.sqrt() / sum(expected[k].pow(2).sum() for k in expected).sqrt())


def masters_error(got: dict, expected: dict) -> float:
    """The masters against the reference's weights, rel. L2 over the whole model."""
    diff = sum((got[n] - expected[n]).pow(2).sum() for n in expected)
    return float(diff.sqrt() / sum(expected[n].pow(2).sum() for n in expected).sqrt())


@pytest.mark.parametrize("ranks", [1, 2])
def test_gradient_clip_val_is_the_optimizers_clipping_and_training_matches_the_fp32_reference(launched, ranks):
    """Measured (DP 1 / DP 2): masters 1e-4 / 3e-4 rel. L2, updates 0.005 / 0.013, moments 0.002; the
    calibrations: updates 0.90 at lr/10 and 0.26 in pure bf16, moments 9.0 clipped at 1.0."""
    run = launched(ranks)["clip"]
    assert run["max_norm"] == CLIP and run["clipping"]
    masters = {k.removesuffix("/master"): v for k, v in run["state"].items() if k.endswith("/master")}
    weights, moments = reference()
    assert masters_error(masters, weights) <= 1e-2
    assert update_error(masters, weights) <= 5e-2
    assert moment_error({k: run["state"][k] for k in moments}, moments) <= 1e-2
    # calibration: the comparison tells lr/10, pure bf16 and the optimizer's own max_norm (1.0) apart
    assert update_error(reference(lr=LR / 10)[0], weights) > 5e-2
    assert update_error(reference(dtype=torch.bfloat16)[0], weights) > 5e-2
    assert moment_error(reference(clip=1.0)[1], moments) > 1e-2


@pytest.mark.parametrize("ranks", [1, 2])
def test_lightnings_own_save_and_resume_hold_every_ranks_shard(launched, ranks):
    run = launched(ranks)["resume"]
    assert "refused" not in run, run.get("refused")
    for part in ("params", "state"):
        for name, value in run["uninterrupted"][part].items():
            assert torch.equal(run["resumed"][part][name], value), (part, name)


def test_without_the_callback_a_ddp_resume_is_refused_on_every_rank(launched):
    run = launched(2)["no_callback"]
    assert "CheckpointError" in run.get("refused", ""), run.get("refused")


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Saved by Lightning at DDP 2 after one epoch, resumed at DP 1 for the second and saved, resumed at
    DDP 3 for the third; and the DP 1 checkpoint resumed into an SGD optimizer. Each launch's rank 0 results."""
    folder = tmp_path_factory.mktemp("chain")
    env = {**os.environ, "USE_TORCH_XLA": "0", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    one, two = folder / "dp2.ckpt", folder / "dp1.ckpt"
    steps = [(2, [f"chain_first:{one}"]), (1, [f"chain_next:{one}:{two}:2", f"refused:{two}", f"validate:{two}", f"renamed:{one}"]),
             (3, [f"chain_next:{two}:{folder / 'dp3.ckpt'}:3"])]
    results = []
    for ranks, modes in steps:
        out = folder / f"out{len(results)}.pt"
        proc = run_launched(ranks, ["-m", "tests.lightning_worker", str(out), *modes], cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results.append(torch.load(out, weights_only=True))
    return results


def test_lightning_resumes_at_any_dp_size_like_the_uninterrupted_run(chain):
    """DDP 2 -> DP 1 -> DDP 3 through Lightning's own ``save_checkpoint`` and ``fit(ckpt_path=...)``: each
    checkpoint holds the whole state, each resume slices its ranks' ranges, and the run ends where the
    uninterrupted DDP 2 run does, to rounding (the sum over ranks rounds differently at each size)."""
    from tests.oracle import assert_params_close

    first, second, third = chain
    uninterrupted = next(v for k, v in first.items() if k.startswith("chain_first:"))
    final = next(v for k, v in third.items() if k.startswith("chain_next:"))["resumed"]
    expected = uninterrupted["uninterrupted"]
    assert_params_close(final["params"], expected["params"], max_ulp=2, max_flip_fraction=0.1)
    masters = {k: v for k, v in expected["state"].items() if k.endswith("/master")}
    moments = {k: v for k, v in expected["state"].items() if not k.endswith("/master")}
    assert update_error({k.split("/")[0]: v for k, v in final["state"].items() if k.endswith("/master")},
                        {k.split("/")[0]: v for k, v in masters.items()}) < 5e-2
    assert moment_error(final["state"], moments) < 1e-2
    # calibration: the state after the first epoch, or the second, is not the end of the run
    for earlier in (uninterrupted["saved"], next(v for k, v in chain[1].items() if k.startswith("chain_next:"))["resumed"]):
        assert moment_error(earlier["state"], moments) > 5e-2


def test_a_resume_that_does_not_fit_is_refused_before_lightning_changes_the_model(chain):
    refused = next(v for k, v in chain[1].items() if k.startswith("refused:"))
    assert "CheckpointError" in (refused["refused"] or ""), refused["refused"]
    assert refused["model unchanged"]


@pytest.mark.requires_xla
def test_under_lightnings_xla_strategy_the_resume_equals_the_uninterrupted_run(tmp_path):
    """Lightning's ``SingleDeviceXLAStrategy`` on the XLA CPU device (no torch.distributed): the checkpoint
    holds the whole state, gathered through the optimizer's XLA backend, and the resume equals the
    uninterrupted run bit for bit (parameters and masters)."""
    out = tmp_path / "xla.pt"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = run_python(["-m", "tests.lightning_worker", str(out), "xla"], cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(out, weights_only=True)["xla"]
    assert got["strategy"] == "SingleDeviceXLAStrategy" and got["format"] == "nxd_smp.lightning_whole/1"
    assert got["saved keys"] == ["exp_avg", "exp_avg_sq", "master", "step"]
    uninterrupted, resumed = got["params"]
    assert all(torch.equal(resumed[n], v) for n, v in uninterrupted.items())
    assert all(torch.equal(a, b) for a, b in zip(*got["masters"]))


def test_validate_from_a_checkpoint_restores_the_model_as_lightning_does(chain):
    """Outside ``fit`` the callback holds nothing back: ``validate(ckpt_path=...)`` loads the saved weights."""
    assert next(v for k, v in chain[1].items() if k.startswith("validate:"))["model restored"]


def test_the_modules_own_on_load_checkpoint_migrates_the_saved_keys_before_the_install(chain):
    """The model's entries are held back after the module's ``on_load_checkpoint``: a module that keeps its
    network under another name and renames the saved keys there resumes the DDP 2 checkpoint at DP 1 to
    the same weights as the module that saved it (the chain's second segment)."""
    renamed = next(v for k, v in chain[1].items() if k.startswith("renamed:"))["renamed"]
    resumed = next(v for k, v in chain[1].items() if k.startswith("chain_next:"))["resumed"]["params"]
    assert renamed.keys() == resumed.keys()
    assert all(torch.equal(renamed[n], resumed[n]) for n in resumed)

