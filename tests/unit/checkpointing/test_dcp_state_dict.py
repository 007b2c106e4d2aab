"""torch's distributed state-dict API and checkpoint (``get_optimizer_state_dict``,
``set_optimizer_state_dict``, ``dcp.save``/``dcp.load``/``dcp.async_save``) over a ``Zero1Optimizer``,
as TorchTitan, torchtune and Lightning's FSDP strategy call them.

The oracle of a resume is the uninterrupted run itself: the same global batch at every DP size (as
``test_checkpoint`` trains), so a run saved at DP 2 and resumed at DP 3 through DCP ends where the
uninterrupted one does, within rounding, and at DP 2 bit for bit. The test is calibrated: a resume
that loads the model but not the optimizer's state lands outside the same tolerance.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from nxd_smp import CheckpointError, MixedPrecisionConfig, Zero1Optimizer, load_checkpoint, save_checkpoint
from nxd_smp.checkpoint import read_checkpoint
from nxd_smp.core.flat_shard import FlatShard
from tests.distributed import run_ranks
from tests.oracle import assert_params_close, make_model, param_groups
from tests.checkpoint_scenario import build, params_of, train


def snapshot(model, opt) -> dict:
    return copy.deepcopy({"params": params_of(model), "masters": list(opt.master_shards),
                          "inner": opt.inner_optimizer.state_dict()["state"],
                          "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]})


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# ---------------------------------------------------------------- no framework call changes the state
@pytest.mark.parametrize("steps", [0, 2])
def test_the_state_dict_api_never_steps_the_optimizer(steps):
    """torch's ``_init_optim_state`` steps an optimizer whose ``state`` is empty (with zero gradients and
    lr 0) before reading it: the state exists from construction, so nothing moves, not even the
    gradient accumulated since the last step."""
    model, opt = build()
    train(model, opt, steps, 0)
    assert len(opt.state) == len(opt.managed_params) and all(opt.state[p] for p in opt.managed_params)
    from tests.oracle import batch, loss_fn

    x, y = batch(0, 0, 9, 0)
    loss_fn(model, x, y).backward()  # an accumulation in flight
    accumulated = {n: opt.main_grad(p).clone() for n, p in model.named_parameters() if p.requires_grad}
    before = snapshot(model, opt)
    state = get_optimizer_state_dict(model, opt)
    set_optimizer_state_dict(model, opt, state)
    after = snapshot(model, opt)
    assert [k for k in before if not same(before[k], after[k])] == []
    assert all(torch.equal(opt.main_grad(p), accumulated[n]) for n, p in model.named_parameters() if p.requires_grad)


def test_the_state_dict_is_torchs_shape_keyed_by_name_for_the_api():
    model, opt = build()
    train(model, opt, 1, 0)
    state = get_optimizer_state_dict(model, opt)
    managed = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(state["state"]) == managed and set(state) == {"state", "param_groups"}
    weight = state["state"]["lin1.weight"]
    assert isinstance(weight["exp_avg"], FlatShard) and weight["exp_avg"].shape == model.lin1.weight.shape
    assert weight["step"].dim() == 0 and float(weight["step"]) == 1
    assert torch.equal(weight["master"].local.view(model.lin1.weight.shape).bfloat16(), model.lin1.weight)


def test_the_state_dict_hands_out_copies_and_torch_save_loads_it_weights_only():
    """What ``state_dict()`` hands out is written in place by ``dcp.load``: a copy, never the live state.
    ``torch.save`` writes plain tensors, which ``torch.load(weights_only=True)`` reads back anywhere."""
    model, opt = build()
    train(model, opt, 2, 0)
    before = snapshot(model, opt)
    state = opt.state_dict()
    for entry in state["state"].values():
        for value in entry.values():
            (value.local if isinstance(value, FlatShard) else value).fill_(7.0)
    assert same(before, snapshot(model, opt))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert all(type(v) is torch.Tensor for entry in loaded["state"].values() for v in entry.values())
    train(model, opt, 1, 2)
    opt.load_state_dict(loaded)
    assert same(before["masters"], list(opt.master_shards)) and same(before["inner"],
                                                                    opt.inner_optimizer.state_dict()["state"])


def test_a_state_of_another_range_or_shape_is_refused_without_changes():
    model, opt = build()
    train(model, opt, 1, 0)
    before = snapshot(model, opt)
    state = get_optimizer_state_dict(model, opt)
    moved = state["state"]["lin1.weight"]["exp_avg"]
    state["state"]["lin1.weight"]["exp_avg"] = FlatShard(moved.local[1:], moved.start + 1, moved.local_shape)
    with pytest.raises(CheckpointError, match=r"lin1\.weight|elements"):
        set_optimizer_state_dict(model, opt, state)
    state = opt.state_dict()
    state["state"][0]["exp_avg"] = torch.zeros(3)  # a plain tensor of another length
    with pytest.raises(CheckpointError, match="elements"):
        opt.load_state_dict(state)
    assert same(before, snapshot(model, opt))


# ---------------------------------------------------------------- dcp.save / dcp.load across DP sizes
def dcp_save_then_continue(rank, world_size, path, async_save=False):
    model, opt = build(seed=0)
    train(model, opt, 3, 0, rank, world_size)
    model_state, optim_state = get_state_dict(model, opt)
    if async_save:
        # (its own group, as TorchTitan gives it: the background write's collectives never meet the step's)
        group = torch.distributed.new_group(backend="gloo")
        future = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=path, process_group=group)
        train(model, opt, 2, 3, rank, world_size)  # training goes on while the checkpoint is written
        future.result()
    else:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        train(model, opt, 2, 3, rank, world_size)
    return params_of(model)


def dcp_load_then_continue(rank, world_size, path, optimizer=True):
    model, opt = build(seed=5)  # everything must come from the checkpoint
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, **({"optim": optim_state} if optimizer else {})}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state.get("optim", {})) \
        if optimizer else model.load_state_dict(state["model"])
    if not optimizer:
        opt.rebuild_master_from_params()
    train(model, opt, 2, 3, rank, world_size)
    return params_of(model)


@pytest.fixture(scope="module")
def dcp_dp2_run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    return path, run_ranks(2, dcp_save_then_continue, path)


def test_dcp_resume_at_the_same_dp_size_is_bit_exact(dcp_dp2_run):
    path, uninterrupted = dcp_dp2_run
    resumed = run_ranks(2, dcp_load_then_continue, path)
    for rank in range(2):
        assert all(torch.equal(resumed[rank][n], v) for n, v in uninterrupted[rank].items()), rank


def test_dcp_resume_from_dp2_at_dp3_matches_within_rounding_and_not_without_the_optimizer(dcp_dp2_run):
    path, uninterrupted = dcp_dp2_run
    resumed = run_ranks(3, dcp_load_then_continue, path)
    assert_params_close(resumed[0], uninterrupted[0], max_ulp=2, max_flip_fraction=0.05)
    model_only = dcp_load_then_continue(0, 1, path, optimizer=False)  # calibration: fresh moments
    with pytest.raises(AssertionError):
        assert_params_close(model_only, uninterrupted[0], max_ulp=2, max_flip_fraction=0.05)


def test_dcp_async_save_at_dp3_resumes_at_dp1(tmp_path):
    path = str(tmp_path / "ckpt")
    uninterrupted = run_ranks(3, dcp_save_then_continue, path, True)
    resumed = run_ranks(1, dcp_load_then_continue, path)
    assert_params_close(resumed[0], uninterrupted[0], max_ulp=2, max_flip_fraction=0.05)


def test_save_and_load_must_agree_on_masters(tmp_path):
    """"Masters when asked" is one setting on both sides: a checkpoint saved without masters, loaded into
    an optimizer that keeps them in its state dict, is DCP's own missing-key error, and nothing is installed."""
    model = make_model(0)
    opt = Zero1Optimizer(param_groups(model, lr_a=1e-2, lr_b=3e-2), torch.optim.AdamW, compile_update=False,
                         mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=False))
    train(model, opt, 1, 0)
    state = get_optimizer_state_dict(model, opt)
    assert all("master" not in entry for entry in state["state"].values())
    dcp.save({"optim": state}, checkpoint_id=str(tmp_path / "ckpt"))
    model2, opt2 = build(seed=5)
    before = snapshot(model2, opt2)
    template = {"optim": get_optimizer_state_dict(model2, opt2)}
    with pytest.raises(BaseException, match="master"):  # (DCP's own: a RuntimeError, or on torch 2.13 its
        # CheckpointException, a BaseException, naming the key)
        dcp.load(template, checkpoint_id=str(tmp_path / "ckpt"))
    assert same(before, snapshot(model2, opt2))


# ---------------------------------------------------------------- a full state set at any DP size
def full_state_of(path: str) -> tuple[dict, dict]:
    """The model's and the optimizer's whole state in torch's shape (``get_optimizer_state_dict`` with
    ``full_state_dict=True`` over an unsharded optimizer: ``state`` and ``params`` by FQN), the master
    weights beside the moments: the checkpoint consolidated by the offline reader."""
    full = read_checkpoint(path)
    optimizer = full["optimizer"]
    state = {name: {**entry, "master": optimizer["master_weights"][name]} for name, entry in optimizer["state"].items()}
    groups = [{**group["hyper"], "params": list(group["params"])} for group in optimizer["groups"]]
    return full["model"], {"state": state, "param_groups": groups}


def save_then_continue(rank, world_size, path):
    model, opt = build(seed=0)
    train(model, opt, 3, 0, rank, world_size)
    save_checkpoint(path, model=model, optimizer=opt)
    train(model, opt, 2, 3, rank, world_size)
    return params_of(model)


def full_set_then_continue(rank, world_size, path, how):
    """The full state set into a fresh optimizer at this DP size (``how``: torch's ``set_optimizer_state_dict``
    with ``full_state_dict=True``, every rank holding it or rank 0 alone with ``broadcast_from_rank0``; or,
    the oracle, ``load_checkpoint`` of the checkpoint it was consolidated from), then two more steps."""
    model, opt = build(seed=5)  # everything must come from the state set
    if how == "load_checkpoint":
        load_checkpoint(path, model=model, optimizer=opt)
    else:
        weights, state = full_state_of(path)
        model.load_state_dict(weights)
        broadcast = how == "broadcast_from_rank0"
        set_optimizer_state_dict(model, opt, state if rank == 0 or not broadcast else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast))
    installed = {"masters": [m.clone() for m in opt.master_shards],
                 "inner": copy.deepcopy(opt.inner_optimizer.state_dict()["state"])}
    train(model, opt, 2, 3, rank, world_size)
    return {"params": params_of(model), **installed}


@pytest.fixture(scope="module")
def saved_dp2_run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("full") / "ckpt")
    return path, run_ranks(2, save_then_continue, path)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("how", ["full_state_dict", "broadcast_from_rank0"])
def test_a_full_state_set_at_any_dp_size_installs_what_a_checkpoint_load_does_and_continues(saved_dp2_run,
                                                                                           world_size, how):
    """torch's ``set_optimizer_state_dict`` with ``full_state_dict=True`` hands every rank the whole tensors in
    place of its ranges: each rank slices its own on arrival. Saved at DP 2, set at DP 1, 2 and 3: each
    rank installs exactly what ``load_checkpoint`` of the same state installs there (masters and inner
    state bit for bit), the run continues like the uninterrupted one (bit for bit at DP 2, to rounding
    elsewhere), and the same state without the optimizer's part does not."""
    path, uninterrupted = saved_dp2_run
    set_full = run_ranks(world_size, full_set_then_continue, path, how)
    loaded = run_ranks(world_size, full_set_then_continue, path, "load_checkpoint")
    for rank in range(world_size):
        assert same(set_full[rank]["masters"], loaded[rank]["masters"]), rank
        assert same(set_full[rank]["inner"], loaded[rank]["inner"]), rank
        assert same(set_full[rank]["params"], loaded[rank]["params"]), rank
    if world_size == 2:
        assert same(set_full[0]["params"], uninterrupted[0])
    else:
        assert_params_close(set_full[0]["params"], uninterrupted[0], max_ulp=2, max_flip_fraction=0.05)



# ---------------------------------------------------------------- the whole state from torch's get side
def full_get_then_continue(rank, world_size, path):
    """Three steps, a checkpoint (the oracle's source), then torch's ``get_optimizer_state_dict`` with
    ``full_state_dict=True``, without and with ``cpu_offload``; the state must not change, and training goes on."""
    model, opt = build(seed=0)
    train(model, opt, 3, 0, rank, world_size)
    save_checkpoint(path, model=model, optimizer=opt)
    before = snapshot(model, opt)
    got = {cpu: get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu))
           for cpu in (False, True)}
    unchanged = same(before, snapshot(model, opt))
    train(model, opt, 1, 3, rank, world_size)
    return got, unchanged


def plain_torch_full_state() -> dict:
    """What torch gives for the same model in fp32 under ``torch.optim.AdamW``, unsharded: the shape to match."""
    model = make_model(0).float()
    opt = torch.optim.AdamW(param_groups(model, lr_a=1e-2, lr_b=3e-2))
    for p in model.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    opt.step()
    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_full_state_dict_is_the_whole_state_on_every_rank_or_on_rank0s_host(tmp_path, world_size):
    """``get_optimizer_state_dict(full_state_dict=True)`` is the whole per-parameter state: every moment and
    master whole in the parameter's shape, equal bit for bit to the checkpoint of the same moment consolidated
    by the offline reader, in torch's own layout (the keys torch gives an unsharded AdamW, plus ``master``).
    On every rank's device without ``cpu_offload``; with it on rank 0's host alone, the others' empty, as
    torch places it."""
    path = str(tmp_path / "ckpt")
    results = run_ranks(world_size, full_get_then_continue, path)
    _, oracle = full_state_of(path)
    torch_shape = plain_torch_full_state()
    for rank, (got, unchanged) in enumerate(results):
        assert unchanged, rank
        for whole in [got[False]] + ([got[True]] if rank == 0 else []):
            assert same(whole["state"], oracle["state"]), rank
            assert all(type(v) is torch.Tensor and v.device.type == "cpu" for e in whole["state"].values()
                       for v in e.values())
            assert [g["params"] for g in whole["param_groups"]] == [g["params"] for g in oracle["param_groups"]]
            assert all(g[k] == o[k] for g, o in zip(whole["param_groups"], oracle["param_groups"]) for k in o)
            assert set(whole["state"]) == set(torch_shape["state"])
            for name, entry in torch_shape["state"].items():
                assert set(whole["state"][name]) == set(entry) | {"master"}, name
                assert all(whole["state"][name][k].shape == v.shape and whole["state"][name][k].dtype == v.dtype
                           for k, v in entry.items()), name
            assert set(whole["param_groups"][0]) >= set(torch_shape["param_groups"][0]) - {"decoupled_weight_decay"}
        if rank:
            assert got[True] == {}


# ---------------------------------------------------------------- flatten_optimizer_state_dict
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def flat_save_then_continue(rank, world_size, path):
    model, opt = build(seed=0)
    train(model, opt, 3, 0, rank, world_size)
    flat = get_optimizer_state_dict(model, opt, options=FLAT)
    dcp.save({"optim": flat, "model": model.state_dict()}, checkpoint_id=path)
    train(model, opt, 2, 3, rank, world_size)
    return {"keys": sorted(flat), "params": params_of(model)}


def flat_load_then_continue(rank, world_size, path):
    model, opt = build(seed=5)
    state = {"optim": get_optimizer_state_dict(model, opt, options=FLAT), "model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"], options=FLAT)
    train(model, opt, 2, 3, rank, world_size)
    return params_of(model)


@pytest.mark.parametrize("load_size", [2, 3])
def test_flatten_optimizer_state_dict_round_trips_across_dp_sizes(tmp_path, load_size):
    """TorchTitan's layout before 0.3 (``flatten_optimizer_state_dict=True``: ``state.<fqn>.<key>`` and
    ``param_groups.<fqn>.<key>``, masters included) through ``dcp.save``/``dcp.load``: a resume at DP 2 is
    the uninterrupted run bit for bit, at DP 3 within rounding."""
    path = str(tmp_path / "flat")
    uninterrupted = run_ranks(2, flat_save_then_continue, path)
    assert "state.lin1.weight.master" in uninterrupted[0]["keys"] and "param_groups.lin1.weight.lr" in \
        uninterrupted[0]["keys"]
    resumed = run_ranks(load_size, flat_load_then_continue, path)
    if load_size == 2:
        assert same(resumed[0], uninterrupted[0]["params"]) and same(resumed[1], uninterrupted[1]["params"])
    else:
        assert_params_close(resumed[0], uninterrupted[0]["params"], max_ulp=2, max_flip_fraction=0.05)


def test_flatten_with_a_loss_scaler_is_refused_on_both_sides():
    """The scaler's state rides in the first param group, which torch's unflatten rebuilds from the live
    groups' keys: it would be lost on the way back. Refused by name on the get side, and on the set side a
    state without it is refused before anything changes."""
    from nxd_smp.optim.loss_scaler import DynamicLossScaler

    model = make_model(0)
    opt = Zero1Optimizer(param_groups(model, lr_a=1e-2, lr_b=3e-2), torch.optim.AdamW, compile_update=False,
                         loss_scaler=DynamicLossScaler(init_scale=2.0**8))
    train(model, opt, 1, 0)
    with pytest.raises(CheckpointError, match="flatten_optimizer_state_dict.*loss_scaler"):
        get_optimizer_state_dict(model, opt, options=FLAT)
    nested = get_optimizer_state_dict(model, opt)
    assert "loss_scaler" in nested["param_groups"][0]
    before = snapshot(model, opt)
    del nested["param_groups"][0]["loss_scaler"]  # what torch's unflatten hands back
    with pytest.raises(CheckpointError, match="no loss scaler state.*flatten_optimizer_state_dict"):
        set_optimizer_state_dict(model, opt, nested)
    assert same(before, snapshot(model, opt))


def test_a_caller_in_torchs_state_dict_module_that_nxd_smp_does_not_know_is_refused_when_full():
    """The options are read from torch's own frame; a newer torch whose function nxd_smp does not know, asking
    for a full state, is refused rather than answered with this rank's ranges. Without ``full_state_dict`` it
    gets the ranges, as any caller does."""
    model, opt = build()
    train(model, opt, 1, 0)
    newer_torch = {"__name__": "torch.distributed.checkpoint.state_dict"}
    exec("def _get_optim_state_dict_v2(optimizer, info):\n    return optimizer.state_dict()\n", newer_torch)

    class Info:
        full_state_dict, cpu_offload = True, False

    with pytest.raises(RuntimeError, match="does not know.*read_checkpoint"):
        newer_torch["_get_optim_state_dict_v2"](opt, Info())
    Info.full_state_dict = False
    assert isinstance(newer_torch["_get_optim_state_dict_v2"](opt, Info())["state"][0]["exp_avg"], FlatShard)
