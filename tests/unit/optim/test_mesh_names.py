"""``device_mesh=`` by the names of its dimensions: nxd_smp's ``("dp", "tp")`` and TorchTitan's world mesh
(``dp_replicate``, ``dp_shard``, ``tp``, with ``dp`` flattened from the first two), on 4 gloo ranks.

The oracle is the same training step over the same groups given as nxd_smp's own mesh: TorchTitan's
names select those groups, so the weights agree bit for bit; a ``dp_shard`` dimension larger than 1
(FSDP2's) is refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.distributed import run_ranks


def step_over(mesh, tp_mesh) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from nxd_smp import Zero1Optimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).to(torch.bfloat16)
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, device_mesh=mesh, compile_update=False)
    g = torch.Generator().manual_seed(opt.rank)
    model(torch.randn(4, 8, generator=g).bfloat16()).float().pow(2).mean().backward()
    opt.step()
    assert (opt.world_size, opt.tensor_parallel_size) == (2, 2)
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def titan_names(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    ours = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    titan = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    replicate_only = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    titan[("dp_replicate", "dp_shard")]._flatten("dp")
    results = {"ours": step_over(ours, ours["tp"]), "flattened dp": step_over(titan, titan["tp"]),
               "dp_replicate": step_over(replicate_only, replicate_only["tp"])}
    sharded = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    try:
        step_over(sharded, sharded["tp"])
        results["sharded"] = "accepted"
    except ValueError as e:
        results["sharded"] = str(e)
    return results


def test_torchtitans_mesh_names_select_the_same_groups_and_dp_shard_is_refused():
    for rank, result in enumerate(run_ranks(4, titan_names)):
        for how in ("flattened dp", "dp_replicate"):
            assert all(torch.equal(result[how][n], v) for n, v in result["ours"].items()), (rank, how)
        assert "'dp_shard' of size 2" in result["sharded"], (rank, result["sharded"])


def test_a_device_mesh_that_is_no_mesh_is_refused_by_type():
    from nxd_smp import Zero1Optimizer

    with pytest.raises(TypeError, match="DeviceMesh"):
        Zero1Optimizer(nn.Linear(2, 2).parameters(), torch.optim.AdamW, device_mesh=("dp", "tp"))


def tp_peers_state(rank: int, world: int) -> dict:
    """Each rank's state dict handed to its tensor-parallel peer: the same DP rank, layout and ranges, but
    another part of each split tensor."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from nxd_smp import CheckpointError, Zero1Optimizer
    from nxd_smp.core.flat_shard import FlatShard

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).to(torch.bfloat16)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, device_mesh=mesh, compile_update=False)
    model(torch.randn(4, 8).bfloat16()).float().pow(2).mean().backward()
    opt.step()
    mine = opt.state_dict()
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, mine)  # (pickled: plain tensors and the record)
    peer = everyone[rank ^ 1]  # the other tensor-parallel rank of this data-parallel rank
    results = {}
    for how, state in (("pickled", peer), ("flat shards", {**mine, "state": {
            number: {key: FlatShard(v.local, v.start, v.local_shape, tuple(v.shape),
                                    tuple((o + v.local_shape[0]) % v.shape[0] if i == 0 else o
                                          for i, o in enumerate(v.global_offset)))
                     if isinstance(v, FlatShard) and v.shape != v.local_shape else v for key, v in entry.items()}
            for number, entry in mine["state"].items()}})):
        try:
            opt.load_state_dict(state)
            results[how] = "loaded"
        except CheckpointError as e:
            results[how] = str(e)
    opt.load_state_dict(mine)
    return results


def test_a_tensor_parallel_peers_state_is_refused():
    for rank, result in enumerate(run_ranks(4, tp_peers_state)):
        assert "model_parallel_rank" in result["pickled"], (rank, result["pickled"])
        assert "this rank's part is" in result["flat shards"], (rank, result["flat shards"])
