"""torch's tensor parallelism (DTensor) with ZeRO-1 over the mesh's ``dp`` dimension, against an unsharded
fp32-master oracle and against NxD's hand-split tensor parallelism (tests/dtensor_worker.py)."""

from __future__ import annotations

import os

import pytest
import torch

import nxd_smp

from tests import dtensor_worker as w
from tests.distributed import run_ranks


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """The 4-rank runs, once for the module: (their checkpoint root, each rank's results)."""
    root = tmp_path_factory.mktemp("dtensor")
    return root, run_ranks(4, w.four_ranks, str(root / "ckpt"))


@pytest.fixture(scope="module")
def two():
    return run_ranks(2, w.two_ranks)


@pytest.mark.parametrize("how", ["device_mesh", "process_group"])
def test_tp2_dp2_matches_the_unsharded_oracle(four, how):
    results = [got["oracle"][how] for got in four[1]]
    expected, norms = w.oracle()
    for rank, got in enumerate(results):
        assert (got["tp_size"], got["dp_size"]) == (2, 2)
        # the global norm counts every element once: split parts summed over tp, replicated ones once
        assert got["norms"] == pytest.approx(norms, rel=1e-6), rank
        for name, value in expected.items():
            diff = (got["params"][name].float() - value.float()).abs().max().item()
            ulp = value.float().abs().max().item() * 2 ** -7
            assert diff <= ulp, (rank, name, diff)
    for a, b in ((0, 1), (2, 3)):  # the TP pairs agree: replicated parameters stay identical
        for name in ("down.bias", "norm.weight", "norm.bias"):
            assert torch.equal(results[a]["local"][name], results[b]["local"][name]), name
        for name in ("up.weight", "up.bias", "down.weight"):  # and the split ones are different parts
            assert not torch.equal(results[a]["local"][name], results[b]["local"][name]), name


def test_nxd_hand_split_and_dtensor_train_to_the_same_numbers(four):
    for rank, got in enumerate(got["nxd"] for got in four[1]):
        assert got["dtensor_norm"] == pytest.approx(got["nxd_norm"], rel=1e-5), rank
        for a, b in zip(got["dtensor_masters"], got["nxd_masters"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        for name, value in got["nxd"].items():
            torch.testing.assert_close(got["dtensor"][name].float(), value.float(), rtol=2 ** -7, atol=1e-6)


def test_what_a_mesh_build_refuses(two):
    got = two[0]["refusals"]
    kind, message = got["fsdp"]
    assert kind == "ConfigError" and "fully_shard" in message and "export-torch" in message
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in message
    kind, message = got["tp_no_dp"]
    assert kind == "ConfigError" and "device_mesh=mesh" in message
    kind, message = got["names"]
    assert kind == "ConfigError" and "'dp'" in message and "replicas" in message
    assert got["beside"][0] == "TypeError"
    assert got["tp_only"] == got["dp_mesh"] == (1, 2)  # device_mesh=mesh, or process_group=mesh["dp"]
    assert got["2d_mesh"][0] == "ConfigError" and "mesh['dp']" in got["2d_mesh"][1]


def test_steps_raise_no_warning(two):
    """Nothing nxd_smp calls warns (torch 2.13 deprecates the ``*_tensor`` collectives), and nothing a user
    would see by default: DeprecationWarnings that torch's own modules raise while inductor compiles the update
    are hidden outside ``__main__`` and not ours."""
    package = os.path.dirname(nxd_smp.__file__)
    for rank, caught in enumerate(got["warnings"] for got in two):
        ours = [c for c in caught if c[1].startswith(package) or c[0] != "DeprecationWarning"]
        assert ours == [], (rank, ours)


def test_checkpoints_per_tp_coordinate_reshard_over_dp_and_export_whole(four):
    from nxd_smp.checkpoint import consolidate
    from nxd_smp.checkpointing.tools import read_whole_checkpoint
    from nxd_smp.interop.native_torch import export_safetensors, export_torch

    root, results = four
    saved = [got["saved"] for got in results]
    export = export_torch([root / "ckpt" / "tp0", root / "ckpt" / "tp1"], root / "dcp")
    for one_coordinate in (lambda p: export_torch(p, root / "dcp1"), lambda p: consolidate(p, root / "c.pt"),
                           lambda p: export_safetensors(p, root / "w.safetensors")):
        with pytest.raises(nxd_smp.CheckpointError, match="pass the checkpoints of all 2 coordinates"):
            one_coordinate(root / "ckpt" / "tp1")
    whole = read_whole_checkpoint([root / "ckpt" / "tp0", root / "ckpt" / "tp1"])
    with pytest.raises(nxd_smp.CheckpointError, match="parts of different saves.*tp1: save"):
        read_whole_checkpoint([root / "ckpt" / "tp0", root / "ckpt" / "later" / "tp1"])
    with pytest.raises(nxd_smp.CheckpointError, match="not tensor-parallel ranks 0..1.*in rank order"):
        read_whole_checkpoint([root / "ckpt" / "tp1", root / "ckpt" / "tp0"])
    for name, value in saved[0]["masters"].items():
        assert torch.equal(whole["optimizer"]["master_weights"][name], value), name
    # torch's full_state_dict at TP 2 x DP 2: gathered over dp and joined over tp, as the offline reader joins it
    optimizer = whole["optimizer"]
    oracle = {name: {**entry, "master": optimizer["master_weights"][name]} for name, entry in optimizer["state"].items()}
    for rank, got in enumerate(saved):
        assert same_tensors(got["full_get"][False]["state"], oracle), rank
        assert same_tensors(got["full_get"][True]["state"], oracle) if rank == 0 else got["full_get"][True] == {}
        # and the whole state set back at TP 2 x DP 2: what the checkpoints hold, installed as they load
        assert got["full_set"]["inner state as loaded"], rank
        for name, value in saved[0]["params"].items():
            assert torch.equal(got["full_set"]["params"][name], value), name
            assert torch.equal(got["full_set"]["masters"][name], saved[0]["masters"][name]), name
    for got in run_ranks(2, w.checkpoint_load_rank, str(root / "ckpt"), str(export)):
        assert "tensor-parallel rank" in got["wrong"] and "each tensor-parallel coordinate" in got["wrong"]
        for name, value in saved[0]["params"].items():
            assert torch.equal(got["params"][name], value), name
            assert torch.equal(got["masters"][name], saved[0]["masters"][name]), name
            assert torch.equal(got["exported"][name], saved[0]["masters"][name]), name
            # torch's full-state set of the joined whole state: each rank's part and range, sliced on arrival
            assert torch.equal(got["full_set"]["params"][name], value), name
            assert torch.equal(got["full_set"]["masters"][name], saved[0]["masters"][name]), name
        assert got["full_set"]["inner state as loaded"]


def same_tensors(got: dict, expected: dict) -> bool:
    """Two ``{name: {key: tensor}}`` maps hold the same keys and tensors (dtype, shape, bits)."""
    return got.keys() == expected.keys() and all(
        got[n].keys() == expected[n].keys() and all(
            type(got[n][k]) is torch.Tensor and got[n][k].dtype == v.dtype and got[n][k].shape == v.shape
            and torch.equal(got[n][k], v) for k, v in expected[n].items()) for n in expected)


def test_weights_written_in_place_after_the_build_are_kept(two):
    for got in two:
        assert got["written"] == {"mul_": 0.0, "load_state_dict": 0.0}


@pytest.mark.parametrize("world_size", [1, 2])
def test_fsdp2_is_refused_after_a_forward_at_any_world_size(two, world_size):
    messages = [got["fsdp"] for got in two] if world_size == 2 else run_ranks(1, w.fsdp_after_forward_rank)
    for message in messages:
        assert message.startswith("the parameters belong to a model sharded by FSDP2 (fully_shard)"), message


def test_a_tensor_parallel_part_of_no_elements_saves_and_loads(tmp_path):
    """Tensor-parallel rank 1 holds no element of ``up``'s weight and bias or of ``down``'s weight: its
    checkpoint still holds their step counters (each such part is no rank's piece, so data-parallel rank 0
    saves them) and loads back into a fresh optimizer exactly."""
    ranks = run_ranks(2, w.empty_part_rank, str(tmp_path))
    assert ranks[1]["local_numels"][:3] == [0, 0, 0] and all(n > 0 for n in ranks[0]["local_numels"])
    for got in ranks:
        saved, loaded = got["saved"], got["loaded"]
        assert all(torch.equal(a, b) for a, b in zip(saved["masters"], loaded["masters"]))
        assert saved["state"].keys() == loaded["state"].keys() and saved["state"]
        for i, entry in saved["state"].items():
            assert entry.keys() == loaded["state"][i].keys(), i
            assert all(torch.equal(v, loaded["state"][i][k]) for k, v in entry.items()), i
