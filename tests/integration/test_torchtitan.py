"""TorchTitan's own components over nxd_smp (native suite: torchtitan is installed there only):
its ``CheckpointManager`` (DCP) saving and loading a ``Zero1Optimizer`` in TorchTitan's optimizers
container (``nxd_smp.interop.torchtitan``) on a TP 2 x DP 2 DTensor model, 4 gloo ranks on CPU.

The oracle of the resume is the uninterrupted run (bit for bit: the same ranks, data and layout);
calibration: the same checkpoint loaded without the optimizer's state ends elsewhere. The gradient
scale under TorchTitan's per-token loss (a local sum over the global token count) is the fp32
reference's with ``grad_reduction="sum"``, and half of it with the default mean.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchtitan")

from tests.distributed import run_ranks  # noqa: E402

DIM, HIDDEN, TOKENS = 8, 16, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def build(seed: int, mesh, reduction: str = "sum"):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from nxd_smp import MixedPrecisionConfig
    from nxd_smp.interop.torchtitan import build_zero1_optimizers

    torch.manual_seed(seed)
    model = Block().to(torch.bfloat16)
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})  # TP only
    optimizers = build_zero1_optimizers([model], torch.optim.AdamW, lr=1e-2, device_mesh=mesh,
                                        grad_reduction=reduction, compile_update=False,
                                        mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True))
    return model, optimizers


def batch(dp_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(TOKENS, DIM, generator=g).bfloat16(), torch.randn(TOKENS, DIM, generator=g)


def train(model, optimizers, mesh, steps: range) -> list[float]:
    dp = mesh["dp"].get_local_rank()
    norms = []
    for step in steps:
        x, y = batch(dp, step)
        # TorchTitan's loss: this rank's sum over its tokens, over the global token count
        loss = (model(x).float() - y).pow(2).sum() / (TOKENS * mesh["dp"].size())
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        norms.append(float(optimizers.optimizers[0].grad_norm))
    return norms


def full(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def manager(folder: str, model, optimizers, **options):
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0,
                                      last_save_model_only=False, **options)
    return CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=optimizers,
                             lr_schedulers=None, states={}, sd_adapter=None, base_folder=folder)


def titan_run(rank: int, world: int, folder: str, async_mode: str = "disabled") -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, optimizers = build(0, mesh)
    train(model, optimizers, mesh, range(3))
    before = {k: v.clone() for k, v in optimizers.optimizers[0].inner_optimizer.state_dict()["state"][0].items()}
    saver = manager(folder, model, optimizers, exclude_from_loading=["dataloader", "lr_scheduler"],
                    async_mode=async_mode)
    saver.save(curr_step=3)
    saver.maybe_wait_for_staging()  # (an asynchronous save has copied the state by here: training may go on)
    after = optimizers.optimizers[0].inner_optimizer.state_dict()["state"][0]
    unchanged = all(torch.equal(before[k], after[k]) for k in before)  # the save stepped nothing
    train(model, optimizers, mesh, range(3, 5))
    uninterrupted = full(model)
    saver.maybe_wait_for_saving()
    saver.close()
    torch.distributed.barrier()

    resumed = {}
    for load_optimizer in (True, False):
        fresh, fresh_optimizers = build(5, mesh)
        excluded = ["dataloader", "lr_scheduler"] + ([] if load_optimizer else ["optimizer"])
        loader = manager(folder, fresh, fresh_optimizers, exclude_from_loading=excluded)
        assert loader.load(step=3)
        if not load_optimizer:
            fresh_optimizers.optimizers[0].rebuild_master_from_params()
        train(fresh, fresh_optimizers, mesh, range(3, 5))
        resumed[load_optimizer] = full(fresh)
        loader.close()
    return {"unchanged": unchanged, "uninterrupted": uninterrupted, "resumed": resumed[True],
            "model_only": resumed[False]}


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_torchtitans_checkpoint_manager_round_trips_a_zero1_optimizer_at_tp2_dp2(tmp_path, async_mode):
    """Synchronous, and TorchTitan's asynchronous save (``dcp.async_save``: the state dict staged, DTensor
    parameters' local parts included, then written in the background)."""
    results = run_ranks(4, titan_run, str(tmp_path), async_mode)
    for rank, result in enumerate(results):
        assert result["unchanged"], rank
        for name, value in result["uninterrupted"].items():
            assert torch.equal(result["resumed"][name], value), (rank, name)
        assert any(not torch.equal(result["model_only"][n], v) for n, v in result["uninterrupted"].items()), rank


def scale_run(rank: int, world: int, reduction: str) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, optimizers = build(0, mesh, reduction)
    return train(model, optimizers, mesh, range(1))


def reference_norm() -> float:
    """The fp32 model over both data-parallel ranks' tokens in one process, TorchTitan's loss."""
    torch.manual_seed(0)
    model = Block().to(torch.bfloat16).float()
    for dp in range(2):
        x, y = batch(dp, 0)
        ((model(x.float()) - y).pow(2).sum() / (TOKENS * 2)).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))


def test_the_gradient_scale_under_torchtitans_loss_is_the_references_with_sum_and_half_with_mean():
    expected = reference_norm()
    summed = run_ranks(4, scale_run, "sum")[0][0]
    averaged = run_ranks(4, scale_run, "mean")[0][0]
    assert summed == pytest.approx(expected, rel=1e-2)  # (bf16 forward against fp32)
    assert averaged == pytest.approx(expected / 2, rel=1e-2)
