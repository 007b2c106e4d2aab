"""Zero1Optimizer's behaviour beyond the oracle: bad input, grads, hyperparameters,
state dicts and the NxD/torch_xla signature."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from nxd_smp import ConfigError, MixedPrecisionConfig, NeuronZero1Optimizer, Zero1Optimizer
from tests.distributed import run_ranks
from tests.oracle import batch, loss_fn, make_model, param_groups


def backward(model, step=0, micro=2, rank=0):
    for m in range(micro):
        x, y = batch(0, rank, step, m)
        loss_fn(model, x, y).backward()


def train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        backward(model, step)
        opt.step()
        opt.zero_grad()


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- bad input
def test_parameters_on_several_devices_are_refused():
    params = [nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)),
              nn.Parameter(torch.zeros(3, dtype=torch.bfloat16, device="meta"))]
    with pytest.raises(ValueError, match="several devices"):
        Zero1Optimizer(params, torch.optim.AdamW)


def test_a_parameter_listed_twice_is_refused():
    w = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="listed twice"):
        Zero1Optimizer([w, w], torch.optim.AdamW)
    with pytest.raises(ValueError, match="listed twice"):
        Zero1Optimizer([{"params": [w]}, {"params": [w]}], torch.optim.AdamW)


@pytest.mark.parametrize("name", ["Adafactor", "LBFGS", "SparseAdam", "Muon"])
def test_optimizers_that_are_not_element_wise_are_refused(name):
    with pytest.raises(ValueError, match="not element-wise"):
        Zero1Optimizer(make_model().parameters(), getattr(torch.optim, name))


def test_an_optimizer_instance_instead_of_a_class_is_refused():
    model = make_model()
    with pytest.raises(TypeError, match="optimizer_class"):
        Zero1Optimizer(model.parameters(), torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_unsupported_parameter_dtypes_are_refused(dtype):
    with pytest.raises(ValueError, match="dtype"):
        Zero1Optimizer([nn.Parameter(torch.zeros(3, dtype=dtype))], torch.optim.AdamW)


def test_no_trainable_parameters_is_refused():
    with pytest.raises(ValueError, match="no trainable parameters"):
        Zero1Optimizer([nn.Parameter(torch.zeros(3), requires_grad=False)], torch.optim.AdamW)


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"mixed_precision": {"use_master_weights": True}}, TypeError, "MixedPrecisionConfig"),
        ({"max_norm": 0.0}, ConfigError, "max_norm"),
        ({"max_norm": float("nan")}, ConfigError, "max_norm"),
        ({"grad_clipping": 1}, ConfigError, "grad_clipping"),
        ({"bucket_cap_mb": -1}, ValueError, "bucket_cap_mb"),
        ({"reduce_dtype": torch.int32}, ValueError, "reduce_dtype"),
        ({"process_group": "world"}, TypeError, "process_group"),
        ({"lr": -1.0}, ValueError, "learning rate"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, text):
    with pytest.raises(error, match=text):
        Zero1Optimizer(make_model().parameters(), torch.optim.AdamW, **kwargs)


def test_adding_a_param_group_later_is_refused():
    opt = Zero1Optimizer(make_model().parameters(), torch.optim.AdamW)
    with pytest.raises(RuntimeError, match="param group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]})


def test_replacing_parameters_after_construction_is_caught_at_step():
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    model.lin1.weight.data = model.lin1.weight.data.clone()  # what model.to(...) does
    backward(model)
    with pytest.raises(RuntimeError, match="flat buffer"):
        opt.step()


# ---------------------------------------------------------------- layout in memory
def test_parameters_are_views_into_flat_buffers_and_frozen_ones_are_untouched():
    model = make_model()
    frozen_storage = model.frozen.untyped_storage().data_ptr()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, bucket_cap_mb=math.inf)
    (flat,) = opt._flat_params
    for p in model.parameters():
        if p.requires_grad:
            assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert model.frozen.untyped_storage().data_ptr() == frozen_storage
    assert len(opt.bucket_layouts) == 1
    # at DP=1 the gradient shard is the main_grad buffer itself: no copy
    backward(model)
    assert opt._reduce_gradients()[0].data_ptr() == opt._main_grads.buffers[0].data_ptr()


# ---------------------------------------------------------------- gradients
def test_optimizer_zero_grad_clears_main_grad_and_model_zero_grad_does_not():
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    backward(model)
    w = model.lin1.weight
    assert w.grad is None and opt.main_grad(w).abs().sum() > 0
    assert opt.main_grad(w).dtype == torch.float32 and opt.main_grad(w).shape == w.shape
    model.zero_grad()
    assert opt.main_grad(w).abs().sum() > 0
    opt.zero_grad()
    assert opt.main_grad(w).abs().sum() == 0


def test_main_grad_is_the_fp32_sum_of_micro_batch_gradients():
    model = make_model()
    reference = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    backward(model, micro=3)
    expected = {n: torch.zeros(p.shape) for n, p in reference.named_parameters()}
    for m in range(3):
        reference.zero_grad()
        x, y = batch(0, 0, 0, m)
        loss_fn(reference, x, y).backward()
        for n, p in reference.named_parameters():
            if p.grad is not None:
                expected[n] += p.grad.float()
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(opt.main_grad(p), expected[n], rtol=0, atol=0)


def test_a_new_optimizer_over_the_same_model_takes_over_accumulation():
    model = make_model()
    first = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    second = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    backward(model)
    w = model.lin1.weight
    assert first.main_grad(w).abs().sum() == 0
    assert second.main_grad(w).abs().sum() > 0


def test_grad_norm_is_none_before_the_first_step_and_measured_without_clipping():
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, lr=0.1, max_norm=math.inf)
    assert opt.grad_norm is None
    backward(model)
    expected = torch.stack([opt.main_grad(p).norm() for p in model.parameters() if p.requires_grad]).norm()
    opt.step()
    assert opt.grad_norm.dtype == torch.float32 and opt.grad_norm.dim() == 0
    torch.testing.assert_close(opt.grad_norm, expected)


# ---------------------------------------------------------------- hyperparameters
def test_lr_scheduler_acts_on_the_wrapper():
    model = make_model()
    groups = param_groups(model, lr_a=0.1, lr_b=0.1)
    for g in groups:
        g["weight_decay"] = 0.0
    opt = Zero1Optimizer(groups, torch.optim.SGD, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step == 0 else 0.0)
    train(model, opt, 1)
    scheduler.step()
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    before = snapshot(model)
    train(model, opt, 2, start=1)  # lr 0: nothing may move, though momentum is non-zero
    assert all(torch.equal(before[n], p) for n, p in snapshot(model).items())
    assert [g["lr"] for g in opt.inner_optimizer.param_groups] == [0.0, 0.0]


def test_wrapper_param_groups_carry_the_inner_optimizers_hyperparameters():
    model = make_model()
    opt = Zero1Optimizer(param_groups(model, lr_a=0.01, lr_b=0.02), torch.optim.AdamW, betas=(0.8, 0.9))
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.02]
    assert all(g["betas"] == (0.8, 0.9) and "eps" in g for g in opt.param_groups)
    assert not any(p is model.frozen for g in opt.param_groups for p in g["params"])


# ---------------------------------------------------------------- state dicts
def _fresh(master_in_ckpt, seed=1):
    model = make_model(seed)
    mp = MixedPrecisionConfig(use_master_weights_in_ckpt=master_in_ckpt)
    return model, Zero1Optimizer(param_groups(model, lr_a=1e-3, lr_b=3e-3), torch.optim.AdamW, mixed_precision=mp)


def test_state_dict_round_trip_with_master_weights_is_bit_exact():
    model, opt = _fresh(True, seed=0)
    train(model, opt, 3)
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    saved_model = {k: v.clone() for k, v in saved_model.items()}
    saved_opt = copy.deepcopy(saved_opt)
    train(model, opt, 3, start=3)
    uninterrupted = snapshot(model)

    resumed, opt2 = _fresh(True, seed=5)  # different initial weights
    resumed.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    train(resumed, opt2, 3, start=3)
    for n, p in snapshot(resumed).items():
        assert torch.equal(p, uninterrupted[n]), n


def test_state_dict_without_master_weights_rebuilds_them_from_the_loaded_params():
    model, opt = _fresh(False, seed=0)
    train(model, opt, 3)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())
    assert "master_weights" not in saved_opt

    # Oracle: a fresh optimizer built on the loaded bf16 weights, with the saved states.
    expected_model, expected_opt = _fresh(False, seed=7)
    expected_model.load_state_dict(saved_model)
    expected_opt._load_masters_from_params()
    expected_opt.inner_optimizer.load_state_dict(copy.deepcopy(saved_opt["inner"]))
    train(expected_model, expected_opt, 2, start=3)

    resumed, opt2 = _fresh(False, seed=5)
    with pytest.warns(UserWarning, match="precision"):
        opt2.load_state_dict(saved_opt)  # optimizer first, model second: order must not matter
    resumed.load_state_dict(saved_model)
    train(resumed, opt2, 2, start=3)
    expected = snapshot(expected_model)
    for n, p in snapshot(resumed).items():
        assert torch.equal(p, expected[n]), n


def test_a_state_dict_that_does_not_fit_is_refused_without_changes():
    model, opt = _fresh(True)
    train(model, opt, 1)
    other = Zero1Optimizer(make_model().parameters(), torch.optim.AdamW, bucket_cap_mb=math.inf)
    before = {k: v.clone() for k, v in opt.inner_optimizer.state_dict()["state"][0].items()}
    with pytest.raises(ValueError, match="layout"):
        opt.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="format"):
        opt.load_state_dict({"state": {}, "param_groups": []})
    after = opt.inner_optimizer.state_dict()["state"][0]
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------- NxD signature
def test_neuron_signature_maps_onto_zero1():
    model = make_model()
    opt = NeuronZero1Optimizer(
        model.parameters(), torch.optim.AdamW, optimizer_dtype=torch.bfloat16,
        use_grad_acc_hook=False, max_norm=None, lr=1e-3,
    )
    assert opt.mixed_precision == MixedPrecisionConfig(False, False, False)
    assert opt._max_norm == 1.0
    assert len(opt.bucket_layouts) == sum(p.requires_grad for p in model.parameters())  # caps 0
    backward(model)
    opt.step()
    opt.zero_grad()  # torch_xla's default keeps the gradient tensors, zeroed
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) >= 5 and all(g.abs().sum() == 0 for g in grads)


def test_neuron_lazy_init_defers_until_init_zero():
    model = make_model()
    opt = NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, lazy_init=True,
                               use_grad_acc_hook=True, lr=1e-3)
    with pytest.raises(RuntimeError, match="init_zero"):
        opt.step()
    opt.init_zero()
    eager_model = make_model()
    eager = NeuronZero1Optimizer(eager_model.parameters(), torch.optim.AdamW, use_grad_acc_hook=True, lr=1e-3)
    train(model, opt, 2)
    train(eager_model, eager, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager_model.parameters()))


def test_neuron_refuses_bad_optimizer_dtype_and_master_save_without_masters():
    with pytest.raises(ValueError, match="optimizer_dtype"):
        NeuronZero1Optimizer(make_model().parameters(), torch.optim.AdamW, optimizer_dtype=torch.int8)
    with pytest.raises(ConfigError, match="save_master_weights"):
        NeuronZero1Optimizer(make_model().parameters(), torch.optim.AdamW,
                             optimizer_dtype=torch.bfloat16, save_master_weights=True)


# ---------------------------------------------------------------- several ranks
def _groups_worker(rank: int, world_size: int) -> dict:
    out = {}
    # every rank takes part in creating every group
    singles = [dist.new_group([r]) for r in range(world_size)]
    only_rank_1 = dist.new_group([1])
    if rank == 0:
        try:
            Zero1Optimizer(make_model().parameters(), torch.optim.AdamW, process_group=only_rank_1)
        except ValueError as e:
            out["not_a_member"] = str(e)
    # Tensor parallel over both ranks, DP size 1 each: the split parameter differs per
    # rank and adds up; the replicated one is counted once.
    torch.manual_seed(0)
    replicated = nn.Parameter(torch.randn(10))
    torch.manual_seed(100 + rank)
    split = nn.Parameter(torch.randn(7))
    split.tensor_model_parallel = True
    opt = Zero1Optimizer([replicated, split], torch.optim.SGD, lr=0.0, max_norm=math.inf,
                         process_group=singles[rank], grad_norm_groups=[dist.group.WORLD])
    (replicated.sum() * 1.0 + (split * split).sum()).backward()
    opt.step()
    out["norm"] = float(opt.grad_norm)
    out["split_sq"] = float((2 * split.detach()).pow(2).sum())
    out["replicated_sq"] = float(torch.ones(10).pow(2).sum())
    return out


def test_process_groups_and_grad_norm_groups_over_two_ranks():
    r0, r1 = run_ranks(2, _groups_worker)
    assert "not a member" in r0["not_a_member"]
    expected = math.sqrt(r0["split_sq"] + r1["split_sq"] + r0["replicated_sq"])
    assert r0["norm"] == pytest.approx(expected, rel=1e-6)
    assert r1["norm"] == pytest.approx(expected, rel=1e-6)
