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
from tests.oracle import assert_params_close, batch, loss_fn, make_model, param_groups


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


def test_storage_replaced_on_the_same_device_and_dtype_is_taken_back():
    """``model.to(torch.device("cpu", 0))`` (what the Trainer and accelerate do under torchrun)
    copies every CPU parameter: the optimizer takes the copies back into its flat buffers, with
    their values, and trains exactly as without the move; an edited copy is a changed weight."""
    reference, model = make_model(), make_model()
    ref_opt = Zero1Optimizer(reference.parameters(), torch.optim.AdamW)
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    model.to(torch.device("cpu", 0))
    with torch.no_grad():
        reference.lin1.weight.add_(1.0)
    model.lin1.weight.data = model.lin1.weight.data + 1.0  # a replaced storage with new values
    for m, o in ((reference, ref_opt), (model, opt)):
        for _ in range(2):
            backward(m)
            o.step()
            o.zero_grad()
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)
    flats = {buffer.untyped_storage().data_ptr() for buffer in opt.backend._flat_params}
    assert all(p.untyped_storage().data_ptr() in flats for p in opt.managed_params)


def test_moving_parameters_to_another_dtype_after_construction_is_refused_at_step():
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    backward(model)
    model.lin1.weight.data = model.lin1.weight.data.double()
    with pytest.raises(RuntimeError, match="float64"):
        opt.step()


# ---------------------------------------------------------------- layout in memory
def test_parameters_are_views_into_flat_buffers_and_frozen_ones_are_untouched():
    model = make_model()
    frozen_storage = model.frozen.untyped_storage().data_ptr()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, bucket_cap_mb=math.inf)
    (flat,) = opt.backend._flat_params
    managed = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():  # (the parameters' memory is the buffer's: what is written there, they hold)
        flat.copy_(torch.arange(flat.numel(), dtype=flat.dtype))
    for p in managed:
        start = (p.data_ptr() - flat.data_ptr()) // flat.element_size()
        assert torch.equal(p.detach().reshape(-1), torch.arange(start, start + p.numel(), dtype=flat.dtype))
        assert p.storage_offset() == 0  # (a storage of its own over its range, as a parameter made alone)
    assert model.frozen.untyped_storage().data_ptr() == frozen_storage
    assert len(opt.bucket_layouts) == 1
    # at DP=1 the gradient shard is the main_grad buffer itself: no copy
    backward(model)
    assert opt._grads.reduce()[0].data_ptr() == opt._grads.buffers[0].data_ptr()


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


def fp32_sum_of_micro_batch_grads(reference, step: int, micro: int) -> dict[str, torch.Tensor]:
    """The fp32 sum of ``reference``'s gradients over ``micro`` micro-batches of ``step`` (rank 0's data)."""
    expected = {n: torch.zeros(p.shape) for n, p in reference.named_parameters()}
    for m in range(micro):
        reference.zero_grad()
        x, y = batch(0, 0, step, m)
        loss_fn(reference, x, y).backward()
        for n, p in reference.named_parameters():
            if p.grad is not None:
                expected[n] += p.grad.float()
    return expected


def test_main_grad_is_the_fp32_sum_of_micro_batch_gradients():
    model = make_model()
    reference = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    backward(model, micro=3)
    expected = fp32_sum_of_micro_batch_grads(reference, step=0, micro=3)
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


def test_load_state_dict_keeps_the_gradients_accumulated_since_the_last_step_as_torch_does():
    model, opt = _fresh(True, seed=0)
    train(model, opt, 1)
    saved = copy.deepcopy(opt.state_dict())
    backward(model, step=1)
    accumulated = {n: opt.main_grad(p).clone() for n, p in model.named_parameters() if p.requires_grad}
    opt.load_state_dict(saved)
    weight = nn.Parameter(torch.ones(3))
    plain = torch.optim.AdamW([weight])
    weight.grad = torch.full((3,), 2.0)
    plain.load_state_dict(plain.state_dict())
    assert torch.equal(weight.grad, torch.full((3,), 2.0))  # torch's rule
    assert accumulated and any(g.abs().sum() > 0 for g in accumulated.values())
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(opt.main_grad(p), accumulated[n]), n


def test_state_dict_without_master_weights_rebuilds_them_from_the_loaded_params():
    model, opt = _fresh(False, seed=0)
    train(model, opt, 3)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())
    saved_inner = copy.deepcopy(opt.inner_optimizer.state_dict())
    assert all("master" not in entry for entry in saved_opt["state"].values())

    # Oracle: a fresh optimizer built on the loaded bf16 weights, with the saved states.
    expected_model, expected_opt = _fresh(False, seed=7)
    expected_model.load_state_dict(saved_model)
    expected_opt.rebuild_master_from_params()
    expected_opt.inner_optimizer.load_state_dict(saved_inner)
    train(expected_model, expected_opt, 2, start=3)

    resumed, opt2 = _fresh(False, seed=5)
    with pytest.warns(UserWarning, match="precision"):
        opt2.load_state_dict(saved_opt)  # optimizer first, model second: order must not matter
    resumed.load_state_dict(saved_model)
    train(resumed, opt2, 2, start=3)
    expected = snapshot(expected_model)
    for n, p in snapshot(resumed).items():
        assert torch.equal(p, expected[n]), n


def test_loading_into_an_optimizer_built_otherwise_restores_lr_and_master_weights():
    """torch_xla's test_zero1_load: the loaded hyperparameters and masters win over the
    ones the new optimizer was built with."""
    model = make_model()
    mp = MixedPrecisionConfig(use_master_weights_in_ckpt=True)
    opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, lr=0.5, momentum=0.5, mixed_precision=mp)
    train(model, opt, 1)
    saved = copy.deepcopy(opt.state_dict())
    other = make_model(3)
    reloaded = Zero1Optimizer(other.parameters(), torch.optim.SGD, lr=0.1, momentum=0.1, mixed_precision=mp)
    reloaded.load_state_dict(saved)
    assert [(g["lr"], g["momentum"]) for g in reloaded.param_groups] == [(0.5, 0.5)]
    assert [(g["lr"], g["momentum"]) for g in reloaded.inner_optimizer.param_groups] == [(0.5, 0.5)]
    for a, b in zip(reloaded.master_shards, opt.master_shards):
        assert torch.equal(a, b)
    for a, b in zip(other.parameters(), model.parameters()):
        if b.requires_grad:
            assert torch.equal(a, b)


def test_a_state_dict_that_does_not_fit_is_refused_without_changes():
    model, opt = _fresh(True)
    train(model, opt, 1)
    other = Zero1Optimizer(make_model().parameters(), torch.optim.AdamW, bucket_cap_mb=math.inf)
    before = {k: v.clone() for k, v in opt.inner_optimizer.state_dict()["state"][0].items()}
    with pytest.raises(ValueError, match="layout"):
        opt.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="param groups"):
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
    assert opt.max_norm == 1.0
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


# ---------------------------------------------------------------- gradient lifecycle
def _sgd(model, **kwargs):
    return Zero1Optimizer(model.parameters(), torch.optim.SGD, lr=0.1, max_norm=math.inf, **kwargs)


def test_a_parameter_without_a_gradient_since_the_last_step_moves_on_zero():
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    b = nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    opt = Zero1Optimizer([a, b], torch.optim.SGD, lr=0.5, max_norm=math.inf)
    (a.float().sum() + b.float().sum()).backward()
    opt.step()
    before = b.detach().clone()
    a.float().pow(2).sum().backward()  # b gets no gradient this step
    opt.step()
    assert torch.equal(b, before), "b moved on the previous step's gradient"
    assert opt.main_grad(b).abs().sum() == 0


def test_main_grad_holds_only_the_current_accumulation():
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    backward(model, step=0)
    opt.step()  # no zero_grad anywhere
    backward(model, step=1, micro=3)
    reference = make_model()
    reference.load_state_dict(model.state_dict())
    expected = fp32_sum_of_micro_batch_grads(reference, step=1, micro=3)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(opt.main_grad(p), expected[n], rtol=0, atol=0)


def test_a_gradient_computed_before_the_optimizer_existed_is_used():
    """torch_xla's own test builds the ZeRO optimizer after backward."""
    model = make_model()
    backward(model, micro=1)
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    expected = {n: p.detach().float() - 0.1 * grads[n] for n, p in model.named_parameters() if n in grads}
    opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, lr=0.1, max_norm=math.inf)
    opt.step()
    assert expected and all(p.grad is None for p in model.parameters())
    for n, p in model.named_parameters():
        if n in expected:
            assert torch.equal(p.detach(), expected[n].bfloat16()), n


# ---------------------------------------------------------------- weights changed outside
def _oracle_step(weights: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    master = weights.float().clone().requires_grad_()
    master.grad = grad.float()
    torch.optim.AdamW([master], lr=lr).step()
    return master.detach().bfloat16()


def test_weights_loaded_after_the_optimizer_is_built_are_the_truth():
    torch.manual_seed(0)
    layer = nn.Linear(16, 16, bias=False).to(torch.bfloat16)
    opt = Zero1Optimizer(layer.parameters(), torch.optim.AdamW, lr=1e-3)
    layer.load_state_dict({"weight": torch.full((16, 16), 0.5, dtype=torch.bfloat16)})
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    layer(x).float().pow(2).mean().backward()
    grad = opt.main_grad(layer.weight).clone()
    opt.step()
    expected = _oracle_step(torch.full((16, 16), 0.5), grad, 1e-3)
    assert torch.equal(layer.weight.detach(), expected)
    assert abs(float(layer.weight.detach().float().mean()) - 0.5) < 2e-3


@pytest.mark.parametrize("change", ["copy_", "mul_", "load_state_dict"])
def test_exactly_the_changed_parameters_get_new_master_weights(change):
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    train(model, opt, 3)
    masters = [m.clone() for m in opt.master_shards]
    untouched = {n for n, p in model.named_parameters() if p.requires_grad} - {"lin1.weight"}
    with torch.no_grad():
        if change == "copy_":
            model.lin1.weight.copy_(torch.ones_like(model.lin1.weight))
        elif change == "mul_":
            model.lin1.weight.mul_(2)
        else:
            model.lin1.load_state_dict({"weight": torch.ones_like(model.lin1.weight), "bias": model.lin1.bias})
    expected_w = model.lin1.weight.detach().float().reshape(-1).clone()
    opt.adopt_param_changes()
    index = {id(p): i for i, p in enumerate(opt.managed_params)}
    names = dict(model.named_parameters())
    for layout, old, new in zip(opt.bucket_layouts, masters, opt.master_shards):
        for k, i in enumerate(layout.param_indices):
            start, end = layout.param_range(k)
            name = next(n for n, p in names.items() if index.get(id(p)) == i)
            if name == "lin1.weight":
                assert torch.equal(new[start:end], expected_w)
            else:
                assert name in untouched and torch.equal(new[start:end], old[start:end]), name


def test_rewriting_the_same_values_keeps_the_master_precision():
    """Only a write that changes values replaces the master: reloading the model's own
    weights mid-training (a version bump, same values) continues bit for bit."""
    model, reference = make_model(), make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    ref_opt = Zero1Optimizer(reference.parameters(), torch.optim.AdamW, lr=1e-2)
    train(model, opt, 3)
    train(reference, ref_opt, 3)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    train(model, opt, 3, start=3)
    train(reference, ref_opt, 3, start=3)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_writes_through_data_are_not_counted_by_torch_and_can_be_adopted_explicitly():
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, lr=0.0, max_norm=math.inf)
    model.lin2.weight.data.fill_(0.25)  # torch's version counter does not see .data writes
    backward(model)
    opt.step()  # lr 0: the parameters are just the masters cast back
    assert not torch.all(model.lin2.weight == 0.25)
    model.lin2.weight.data.fill_(0.25)
    opt.rebuild_master_from_params([model.lin2.weight])
    backward(model)
    opt.step()
    assert torch.all(model.lin2.weight == 0.25)
    with pytest.raises(ValueError, match="not managed"):
        opt.rebuild_master_from_params([model.frozen])
    with pytest.raises(ValueError, match="not managed"):
        opt.main_grad(model.frozen)


def test_a_state_dict_taken_after_a_load_holds_the_loaded_weights():
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW,
                         mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True))
    with torch.no_grad():
        model.lin1.weight.fill_(0.75)
    saved = opt.state_dict()
    fresh = make_model(3)
    fresh_opt = Zero1Optimizer(fresh.parameters(), torch.optim.AdamW,
                               mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True))
    fresh_opt.load_state_dict(saved)
    assert torch.all(fresh.lin1.weight == 0.75)


def _ddp_broadcast_worker(rank: int, world_size: int) -> dict:
    import gc

    from torch.nn.parallel import DistributedDataParallel

    model = make_model(seed=rank)  # ranks start different, as before DDP's broadcast
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, compile_update=False)
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's weights in place
    del ddp
    gc.collect()
    after_broadcast = snapshot(model)
    backward(model, rank=rank)
    opt.step()
    return after_broadcast, snapshot(model)


def test_ddps_broadcast_after_the_optimizer_is_built_is_taken_up():
    (b0, r0), (b1, r1) = run_ranks(2, _ddp_broadcast_worker)
    reference = make_model(seed=0)
    assert all(torch.equal(b1[n], p) for n, p in snapshot(reference).items())  # rank 0's weights
    opt = Zero1Optimizer(reference.parameters(), torch.optim.AdamW, lr=1e-3, compile_update=False)
    for rank in range(2):
        backward(reference, rank=rank)
    opt.step()  # one rank summing both ranks' gradients: AdamW is scale invariant
    for name, value in r0.items():
        assert torch.equal(value, r1[name]), name
    assert_params_close(r0, snapshot(reference), max_ulp=1, max_flip_fraction=0.05)


# ---------------------------------------------------------------- peers' call shapes
class _SGDWithStepKWArg(torch.optim.SGD):
    def step(self, closure=None, kwarg=None):
        super().step()
        kwarg.append(5)


class _SGDWithNewKey(torch.optim.SGD):
    def step(self, closure=None):
        super().step()
        self.param_groups[0]["new_key"] = 0.1


def test_step_passes_keyword_arguments_to_the_inner_step():
    x = torch.tensor([1.0], requires_grad=True)
    opt = Zero1Optimizer([x], _SGDWithStepKWArg, lr=0.1, max_norm=math.inf)
    x.backward()
    kwarg = []
    opt.step(0, kwarg=kwarg)  # torch's ZeroRedundancyOptimizer test passes closure=0 on
    assert kwarg == [5]
    assert x.item() == pytest.approx(0.9)


def test_a_key_the_inner_optimizer_adds_shows_on_the_wrapper():
    x = torch.tensor([1.0], requires_grad=True)
    opt = Zero1Optimizer([x], _SGDWithNewKey, lr=0.1)
    x.backward()
    opt.step()
    assert opt.param_groups[0]["new_key"] == 0.1
    assert x.item() == pytest.approx(0.9, rel=1e-6)


def test_a_callable_closure_is_evaluated_before_the_gradients_are_reduced():
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, lr=0.1, max_norm=math.inf)
    reference = make_model()
    ref_opt = Zero1Optimizer(reference.parameters(), torch.optim.SGD, lr=0.1, max_norm=math.inf)
    x, y = batch(0, 0, 0, 0)

    def closure():
        loss = loss_fn(model, x, y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    loss_fn(reference, x, y).backward()
    ref_opt.step()
    assert loss.requires_grad or loss.grad_fn is not None
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_base_optimizer_is_the_inner_optimizer():
    opt = Zero1Optimizer(make_model().parameters(), torch.optim.AdamW)
    assert opt.base_optimizer is opt.inner_optimizer
    assert isinstance(opt.base_optimizer, torch.optim.AdamW)


def test_zero1_state_equals_the_plain_optimizers_after_a_step():
    """torch_xla's test_zero1: the sharded state is the plain optimizer's state."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 32)
    plain_layer = nn.Linear(32, 32)
    plain_layer.load_state_dict(layer.state_dict())
    for m in (layer, plain_layer):
        m(torch.ones(32, 32)).sum().backward()
    opt = Zero1Optimizer(layer.parameters(), torch.optim.SGD, lr=0.01, momentum=0.9, grad_clipping=False)
    plain = torch.optim.SGD(plain_layer.parameters(), lr=0.01, momentum=0.9)
    opt.step()
    plain.step()
    (shard,) = opt.master_shards
    buffer = opt.inner_optimizer.state[shard]["momentum_buffer"]
    (layout,) = opt.bucket_layouts
    for k, p in enumerate(plain_layer.parameters()):
        start, end = layout.param_range(k)
        torch.testing.assert_close(buffer[start:end], plain.state[p]["momentum_buffer"].reshape(-1))
    for a, b in zip(layer.parameters(), plain_layer.parameters()):
        torch.testing.assert_close(a, b)


def test_groups_come_one_way_resolved_in_one_place():
    """``topology=`` (the groups as one ``Topology``) is taken as it is by the optimizer and NxD's ZeRO-1-off
    wrapper alike, and refused beside any group keyword or as anything but a Topology (``Topology.build``)."""
    from nxd_smp import ClippedOptimizer
    from nxd_smp.optim.topology import Topology

    given = Topology.build(torch.device("cpu"))
    model = torch.nn.Linear(4, 4)
    assert Zero1Optimizer(model.parameters(), torch.optim.AdamW, topology=given, lr=1e-3).topology is given
    clipped = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), topology=given)
    assert clipped._topology is given
    for wrong in ({"topology": given, "grad_norm_groups": [None]}, {"topology": "dp"}):
        with pytest.raises(TypeError, match="topology must be a Topology"):
            Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, **wrong)
    with pytest.raises(TypeError, match="topology must be a Topology"):
        ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), topology=given, pipeline_groups=[None])
