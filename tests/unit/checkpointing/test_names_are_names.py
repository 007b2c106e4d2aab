"""A state keyed by parameter name maps by name, never by position (DESIGN §5, "One model of a
parameter's state").

``Zero1Optimizer.load_state_dict`` takes torch's distributed state-dict API's dicts (``state`` and each
group's ``params`` by FQN, as ``get_optimizer_state_dict`` returns them) and torch.optim's own (numbered,
with ``param_names`` where the optimizer was built from ``model.named_parameters()``, as TorchTitan builds
it). The model here has two parameters of one shape in one group, so a state installed by position onto
the wrong one passes every shape check: the oracle is the saved optimizer's state looked up by name.

* a named state whose groups list the names in another order loads each parameter's own state;
* a name the optimizer lacks, or holds in another group, is refused by that name, nothing changed;
* a numbered state whose ``param_names`` are other parameters' (an optimizer built in another order) is
  refused, where before it was installed onto the parameters at those places;
* at DP 2 on gloo, rank 1's dict naming a parameter the model lacks is refused by both ranks at once.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from nxd_smp import CheckpointError, Zero1Optimizer
from tests.distributed import run_ranks
from tests.hostile_worker import timed_call


class Twins(nn.Module):
    """Two (8, 8) weights in one group (a swap between them keeps every shape), a bias in a second."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8, bias=False)
        self.second = nn.Linear(8, 8, bias=False)
        self.bias = nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x))) + self.bias


def named_groups(model: Twins, order: tuple[str, str] = ("first.weight", "second.weight")) -> list[dict[str, Any]]:
    params = dict(model.named_parameters())
    return [{"params": [(n, params[n]) for n in order], "lr": 1e-2},
            {"params": [("bias", params["bias"])], "lr": 3e-2}]


def trained(seed: int = 0, order: tuple[str, str] = ("first.weight", "second.weight"), steps: int = 2
            ) -> tuple[Twins, Zero1Optimizer]:
    """A Twins model and a named Zero1Optimizer over it, after ``steps`` steps of distinct gradients."""
    torch.manual_seed(seed)
    model = Twins()
    opt = Zero1Optimizer(named_groups(model, order), torch.optim.AdamW, compile_update=False, grad_clipping=False)
    for step in range(steps):
        torch.manual_seed(100 + step)
        model(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def by_name(model: nn.Module, opt: Zero1Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's state (moments flattened, this rank's range) by its name: the oracle's view."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.detach().clone().reshape(-1) for k, v in s.items() if isinstance(v, torch.Tensor)}
            for p, s in opt.state.items()}


def same(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n])
                                        for n in a)


def test_a_named_state_listed_in_another_order_loads_each_parameters_own_state():
    model, opt = trained()
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt))
    assert saved["param_groups"][0]["params"] == ["first.weight", "second.weight"]
    saved["param_groups"][0]["params"].reverse()  # (the same names, in the other order)
    fresh, fresh_opt = trained(seed=1, steps=1)
    fresh_opt.load_state_dict(saved)
    assert same(by_name(fresh, fresh_opt), by_name(model, opt))
    swapped = by_name(model, opt)
    swapped["first.weight"], swapped["second.weight"] = swapped["second.weight"], swapped["first.weight"]
    assert not same(by_name(fresh, fresh_opt), swapped)  # (what a load by position would have installed)


@pytest.mark.parametrize("edit,named", [
    ("renamed", "'third.weight', which is no parameter"),
    ("moved to the other group", "'bias', which the optimizer holds in param group 1"),
])
def test_a_name_the_optimizer_lacks_or_holds_elsewhere_is_refused_by_name(edit, named):
    model, opt = trained()
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt))
    if edit == "renamed":
        saved["param_groups"][0]["params"][1] = "third.weight"
        saved["state"]["third.weight"] = saved["state"].pop("second.weight")
    else:
        saved["param_groups"][0]["params"].append(saved["param_groups"][1]["params"].pop())
    fresh, fresh_opt = trained(seed=1, steps=1)
    before = by_name(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=named):
        fresh_opt.load_state_dict(saved)
    assert same(by_name(fresh, fresh_opt), before)


def test_a_numbered_state_of_other_parameters_is_refused_where_it_names_them():
    """A state dict numbered 0..n-1 of an optimizer built over (second, first): its ``param_names`` say whose
    state each number holds, and the optimizer over (first, second) refuses it rather than swapping them."""
    model, opt = trained(order=("second.weight", "first.weight"))
    saved = opt.state_dict()
    assert saved["param_groups"][0]["param_names"] == ["second.weight", "first.weight"]
    fresh, fresh_opt = trained(seed=1, steps=1)
    before = by_name(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match="names other parameters than the optimizer's"):
        fresh_opt.load_state_dict(saved)
    assert same(by_name(fresh, fresh_opt), before)
    same_order, same_opt = trained(seed=2, steps=1, order=("second.weight", "first.weight"))
    same_opt.load_state_dict(saved)  # (the control: the optimizer it was saved from loads it)
    assert same(by_name(same_order, same_opt), by_name(model, opt))


def _misnamed_on_rank_one(rank: int, world: int) -> dict[str, Any]:
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)
    model, opt = trained()
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt))
    if rank == 1:
        saved["param_groups"][0]["params"][1] = "third.weight"
        saved["state"]["third.weight"] = saved["state"].pop("second.weight")
    fresh, fresh_opt = trained(seed=1, steps=1)
    before = by_name(fresh, fresh_opt)
    return {**timed_call(lambda: fresh_opt.load_state_dict(saved)), "unchanged": same(by_name(fresh, fresh_opt), before)}


def test_a_misnamed_state_on_one_rank_is_refused_by_every_rank_at_once():
    outcomes = run_ranks(2, _misnamed_on_rank_one)
    for rank, outcome in enumerate(outcomes):
        assert outcome["type"] == "CheckpointError" and outcome["seconds"] < 20 and outcome["unchanged"], (rank, outcome)
    assert "third.weight" in outcomes[1]["message"] and "another rank" in outcomes[0]["message"], outcomes
