"""The stages of the one load pipeline, each tested where it lives, through the entry points users call:

* check: a 0-dim moment of a 0-dim parameter (a CLIP-style ``logit_scale``) is a moment, not a step
  counter, in every reader of whole per-parameter state; it loads and trains as torch does (oracle);
* agree: at DP 2 on gloo, ranks whose files would install different hyperparameters or step counts
  refuse together (NxD Training's state-dict tags, ``load_state_dict``), and a refusal on one rank is
  a refusal on every rank;
* install: a scheduler that passes the checks and then refuses its state is put back, with the other
  objects; a refusing stateful object too;
* the offline tools and the tensor-parallel join read only what the reader checked, and refuse parts of
  two saves and coordinates that do not join with a ``CheckpointError`` naming them.
"""

from __future__ import annotations

import copy
import json
import os
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from nxd_smp import CheckpointError, MixedPrecisionConfig, Zero1Optimizer, load_checkpoint, save_checkpoint
from nxd_smp.checkpoint import inspect_checkpoint, load_full_optimizer_state, read_checkpoint
from nxd_smp.checkpointing.tools import read_whole_checkpoint
from tests.distributed import run_ranks

KEEP = MixedPrecisionConfig(use_master_weights_in_ckpt=True)


class Clip(nn.Module):
    """A model with a 0-dim parameter (CLIP's ``logit_scale``) beside ordinary ones."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 4)
        self.logit_scale = nn.Parameter(torch.tensor(2.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.logit_scale


def clip_pair(seed: int = 0) -> tuple[nn.Module, Zero1Optimizer, nn.Module, torch.optim.Optimizer]:
    """An fp32 model under Zero1Optimizer and its twin under torch's AdamW (the oracle)."""
    torch.manual_seed(seed)
    model = Clip()
    twin = copy.deepcopy(model)
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, compile_update=False, grad_clipping=False, lr=1e-2,
                         weight_decay=0.0)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.0)
    return model, opt, twin, reference


def clip_step(model: nn.Module, opt: Any, seed: int) -> None:
    torch.manual_seed(100 + seed)
    model(torch.randn(3, 6)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def trained_reference(steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    """torch's own AdamW after ``steps`` steps on the Clip model: whole per-parameter state, 0-dim
    moments for ``logit_scale``."""
    _, _, twin, reference = clip_pair()
    for s in range(steps):
        clip_step(twin, reference, s)
    assert reference.state[twin.logit_scale]["exp_avg"].dim() == 0
    return twin, reference


def named_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}


def nxd_plain_tag(tag: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """NxD's tag folder of a run without ZeRO-1 (a plain optimizer's state dict, by parameter id)."""
    (tag / "model").mkdir(parents=True)
    (tag / "optim").mkdir()
    torch.save(model.state_dict(), tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    torch.save(optimizer.state_dict(), tag / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    (tag / "checkpoint").write_text("1")
    (tag / "done").write_text("1")
    return tag


def native_dcp(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory, no_dist=True)
    return directory


def load_zero_dim(how: str, tmp_path: Path) -> None:
    twin, reference = trained_reference()
    model, opt, _, _ = clip_pair(seed=9)  # other weights: the load must replace them
    if how == "full state":
        with torch.no_grad():
            model.load_state_dict(twin.state_dict())
        load_full_optimizer_state(model, opt, named_state(twin, reference),
                                  [{k: v for k, v in g.items() if k != "params"} for g in reference.param_groups],
                                  {n: p.detach().clone() for n, p in twin.named_parameters()})
    elif how == "NxD tag":
        load_checkpoint(nxd_plain_tag(tmp_path / "tag", twin, reference), model=model, optimizer=opt)
    elif how == "import_torch":
        from nxd_smp.interop.native_torch import import_torch

        import_torch(native_dcp(tmp_path / "dcp", twin, reference), model=model, optimizer=opt)
    for s in range(3, 6):  # both go on; the zero-dim moments must have been taken as moments
        clip_step(model, opt, s)
        clip_step(twin, reference, s)
    for name, p in twin.named_parameters():
        assert torch.allclose(dict(model.named_parameters())[name], p, rtol=1e-6, atol=1e-7), name


@pytest.mark.parametrize("how", ["full state", "NxD tag", "import_torch"])
def test_zero_dim_moments_of_a_zero_dim_parameter_load_as_moments_and_train_as_torch(how, tmp_path):
    load_zero_dim(how, tmp_path)


def test_zero_dim_moments_for_a_shaped_parameter_are_refused():
    twin, reference = trained_reference()
    state = named_state(twin, reference)
    state["proj.weight"]["exp_avg"] = torch.tensor(0.5)  # a step-like 0-dim value where a moment belongs
    model, opt, _, _ = clip_pair(seed=9)
    before = [m.clone() for m in opt.master_shards]
    with pytest.raises(CheckpointError, match=r"proj\.weight/exp_avg.*shaped like the parameter"):
        load_full_optimizer_state(model, opt, state,
                                  [{k: v for k, v in g.items() if k != "params"} for g in reference.param_groups])
    assert all(torch.equal(a, b) for a, b in zip(before, opt.master_shards)) and as_built(opt)



def as_built(opt) -> bool:
    """Whether ``opt``'s inner state is still the zero state it was built with (nothing installed)."""
    return all(not isinstance(v, torch.Tensor) or not v.any() for entry in opt.inner_optimizer.state.values()
               for v in entry.values())

# ---------------------------------------------------------------- agree: DP 2
def _diverging_state_dicts(rank: int, world: int, root: str, into: str) -> str:
    from tests.checkpoint_scenario import build, train

    model, opt = build()
    train(model, opt, 1, 0, rank, world)
    save_checkpoint(root, "t1", model=model.state_dict(), optimizer=opt.state_dict())
    opt.backend.coordinator.barrier()
    if rank == 0:  # the attacker's edit: rank 1's file holds another lr and step
        path = Path(root) / "t1" / "optim" / "dp_rank_01_tp_rank_00_pp_rank_00.pt"
        state = torch.load(path, weights_only=True)
        state["param_groups"][0]["lr"] = 1.0
        for entry in state["state"].values():
            entry["step"] = torch.tensor(1e6)
        torch.save(state, path)
    opt.backend.coordinator.barrier()
    fresh, fresh_opt = build(seed=3)
    before = [m.clone() for m in fresh_opt.master_shards]
    try:
        if into == "objects":
            load_checkpoint(root, "t1", model=fresh, optimizer=fresh_opt)
        elif into == "dicts":
            load_checkpoint(root, "t1", model={}, optimizer={})
        else:  # load_state_dict of each rank's own file
            state = torch.load(Path(root) / "t1" / "optim" / f"dp_rank_{rank:02d}_tp_rank_00_pp_rank_00.pt",
                               weights_only=True)
            fresh_opt.load_state_dict(state)
    except CheckpointError as e:
        assert all(torch.equal(a, b) for a, b in zip(before, fresh_opt.master_shards))
        assert as_built(fresh_opt)
        return str(e)
    return "loaded"


@pytest.mark.parametrize("into", ["objects", "dicts", "load_state_dict"])
def test_ranks_that_would_install_different_values_refuse_together(into, tmp_path):
    results = run_ranks(2, _diverging_state_dicts, str(tmp_path / "run"), into)
    assert all("would install different values" in r for r in results), results
    assert all("hyperparameters" in r and "step counters" in r for r in results), results


def _masters_on_one_rank(rank: int, world: int) -> str:
    """Each rank's own state dict, rank 1's without its master shards: publishing the masters is a
    collective, so one rank publishing and the other rebuilding would leave the first waiting."""
    from tests.checkpoint_scenario import build, train

    model, opt = build()
    train(model, opt, 1, 0, rank, world)
    state = opt.state_dict()
    if rank == 1:
        for entry in state["state"].values():
            entry.pop("master")
    try:
        opt.load_state_dict(state)
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_master_weights_in_one_ranks_state_dict_only_are_refused_together():
    results = run_ranks(2, _masters_on_one_rank)
    assert all("would install different values" in r and "master weights" in r for r in results), results


def test_a_refusal_after_the_staging_puts_every_object_back(tmp_path):
    """A state the digest cannot read (NxD Training's optimizer dict with param groups that are no list) is
    refused before the install: the scheduler loaded with it is left as it was."""
    from tests.checkpoint_scenario import build

    model, opt = build()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    save_checkpoint(tmp_path, "t1", model=model.state_dict(), optimizer={"param_groups": 5, "state": {}},
                    scheduler=scheduler)
    live = torch.optim.lr_scheduler.StepLR(build(seed=2)[1], step_size=2)
    for _ in range(3):
        live.step()
    before = live.state_dict()
    try:
        load_checkpoint(tmp_path, "t1", model={}, optimizer={}, scheduler=live)
    except CheckpointError:
        pass
    assert live.state_dict() == before


# ---------------------------------------------------------------- state keys by parameter
def test_state_keys_that_differ_by_group_and_a_parameter_of_no_elements_round_trip(tmp_path):
    """AdamW with ``amsgrad`` in one param group keeps ``max_exp_avg_sq`` there only, and a parameter of no
    elements is no rank's piece: the checkpoint records each parameter's keys, and loads back exactly."""
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.empty = nn.Linear(4, 4), nn.Linear(4, 4), nn.Parameter(torch.zeros(0, 4))

        def forward(self, x):
            return self.b(self.a(x)).sum() + self.empty.sum()

    def built(model):
        return Zero1Optimizer([{"params": list(model.a.parameters()), "amsgrad": True},
                               {"params": [*model.b.parameters(), model.empty]}], torch.optim.AdamW,
                              compile_update=False, lr=1e-2, mixed_precision=KEEP)

    torch.manual_seed(0)
    model = Model()
    opt = built(model)
    for _ in range(2):
        model(torch.randn(2, 4)).backward()
        opt.step()
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    torch.manual_seed(1)
    fresh = Model()
    fresh_opt = built(fresh)
    load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_opt)
    for live, saved in zip(fresh_opt.inner_shards, opt.inner_shards):
        got, want = fresh_opt.inner_optimizer.state[live], opt.inner_optimizer.state[saved]
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_torch_xla_files_of_more_than_ten_parameters_import(tmp_path):
    """torch_xla numbers the parameters 0..n-1: the numbers are checked as numbers (sorted as text, 10
    came before 2)."""
    from nxd_smp.interop.torch_xla import export_xla, import_xla

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])  # 12 parameters
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, compile_update=False, lr=1e-2, mixed_precision=KEEP)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    files = export_xla(tmp_path / "c", tmp_path / "xla", dp_size=2)
    masters = [m.clone() for m in opt.master_shards]
    import_xla(files, model=model, optimizer=opt)
    assert all(torch.equal(a, b) for a, b in zip(masters, opt.master_shards))


# ---------------------------------------------------------------- install: the transaction
class Ledger:
    """A stateful object that records what it was given and refuses a state holding ``"refuse"``."""

    def __init__(self) -> None:
        self.state = {"n": 0}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)  # changed first, as a careless load_state_dict does
        if state.get("refuse"):
            raise ValueError("refused")


def test_a_refusing_object_is_put_back_with_every_other(tmp_path):
    from tests.checkpoint_scenario import build, train

    model, opt = build()
    train(model, opt, 1, 0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    first, second = Ledger(), Ledger()
    second.state = {"n": 7, "refuse": True}
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt, scheduler=scheduler,
                    stateful={"first": first, "second": second})
    fresh, fresh_opt = build(seed=4)
    live_scheduler = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=5)
    a, b = Ledger(), Ledger()
    a.state, b.state = {"n": 1}, {"n": 2}
    before = (live_scheduler.state_dict(), [g["lr"] for g in fresh_opt.param_groups])
    with pytest.raises(CheckpointError, match="second refused its saved state"):
        load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_opt, scheduler=live_scheduler,
                        stateful={"first": a, "second": b})
    assert (a.state, b.state) == ({"n": 1}, {"n": 2})  # the refusing one put back too
    assert live_scheduler.state_dict() == before[0] and [g["lr"] for g in fresh_opt.param_groups] == before[1]
    assert as_built(fresh_opt)


class Picky(torch.optim.lr_scheduler.LambdaLR):
    """A scheduler whose ``load_state_dict`` applies the state, then refuses it (as ``SequentialLR`` does
    when a child refuses): a state of the right keys and kinds, which only the scheduler itself judges."""

    def __init__(self, optimizer, *, copyable: bool = True):
        super().__init__(optimizer, lambda epoch: 1.0)
        self._copyable = copyable

    def __deepcopy__(self, memo):
        if not self._copyable:  # (no dry run then: the install's transaction undoes the load)
            raise TypeError("this scheduler cannot be copied")
        new = Picky.__new__(Picky)
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def load_state_dict(self, state):
        super().load_state_dict(state)
        if state["base_lrs"][0] > 10:
            raise ValueError("a base lr above 10 is not mine")


@pytest.mark.parametrize("copyable", [True, False])
def test_a_scheduler_that_refuses_its_state_after_the_checks_is_never_half_applied(tmp_path, copyable):
    """The state passes the checks of keys and kinds and its values are numbers the scheduler could hold;
    the scheduler refuses it after applying it. Its dry run on a copy refuses first; a scheduler that
    cannot be copied refuses in the install, which puts it back. Either way nothing changes, and the next
    step does not set the file's learning rate."""
    from tests.checkpoint_scenario import build

    model, opt = build()
    scheduler = Picky(opt)
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt, scheduler=scheduler)
    version = (tmp_path / "c").resolve()
    extra = json.loads((version / "extra.json").read_text())
    extra["objects"]["scheduler"]["base_lrs"] = [100.0 for _ in extra["objects"]["scheduler"]["base_lrs"]]
    data = json.dumps(extra).encode()
    (version / "extra.json").write_bytes(data)
    record = json.loads((version / "COMPLETE.json").read_text())
    record["files"]["extra.json"] = [len(data), zlib.crc32(data)]
    (version / "COMPLETE.json").write_text(json.dumps(record))
    fresh, fresh_opt = build(seed=4)
    live = Picky(fresh_opt, copyable=copyable)
    before = copy.deepcopy({k: v for k, v in live.state_dict().items()}), [g["lr"] for g in fresh_opt.param_groups]
    with pytest.raises(CheckpointError, match="not mine"):
        load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_opt, scheduler=live)
    assert live.state_dict() == before[0] and [g["lr"] for g in fresh_opt.param_groups] == before[1]
    live.step()
    assert all(g["lr"] < 1.0 for g in fresh_opt.param_groups)  # never the file's 100


# ---------------------------------------------------------------- the offline tools
def _forge(path: Path, name: str, edit) -> None:
    version = path.resolve()
    value = json.loads((version / name).read_text())
    edit(value)
    data = json.dumps(value).encode()
    (version / name).write_bytes(data)
    record = json.loads((version / "COMPLETE.json").read_text())
    record["files"][name] = [len(data), zlib.crc32(data)]
    (version / "COMPLETE.json").write_text(json.dumps(record))


FORGERIES = {
    "inner_class a number": ("nxd_smp_meta.json", lambda m: m["optimizer"].__setitem__("inner_class", 7)),
    "no mixed_precision": ("nxd_smp_meta.json", lambda m: m["optimizer"].pop("mixed_precision")),
    "world_size a string": ("nxd_smp_meta.json", lambda m: m["optimizer"].__setitem__("world_size", "2")),
    "a group naming a parameter twice": ("nxd_smp_meta.json", lambda m: m["optimizer"]["groups"][0]["params"].append(
        m["optimizer"]["groups"][0]["params"][0])),
    "a key too many": ("nxd_smp_meta.json", lambda m: m.__setitem__("extra_field", 1)),
    "saved_at_ns a string": ("COMPLETE.json", lambda r: r.__setitem__("saved_at_ns", "now")),
    "tensor_parallel's rank past its size": ("nxd_smp_meta.json", lambda m: m.__setitem__(
        "tensor_parallel", {"size": 1, "rank": 3, "split": {}})),
    # An empty tensor whose size arithmetic overflows (torch.empty of it raises, though it has no element).
    "an empty model entry of an overflowing shape": ("nxd_smp_meta.json", lambda m: next(iter(m["model"].values()))
                                                     .__setitem__("shape", [2**62, 2**62, 0])),
    "an empty index entry of an overflowing shape": ("nxd_smp_index.json", lambda i: next(iter(i["entries"].values()))
                                                     .__setitem__(slice(2, 6, 3), [0, [2**62, 2**62, 0]])),
}


@pytest.mark.parametrize("case", sorted(FORGERIES))
def test_the_offline_tools_refuse_a_forged_field_cleanly(case, tmp_path):
    from tests.checkpoint_scenario import build, train

    model, opt = build()
    train(model, opt, 1, 0)
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    name, edit = FORGERIES[case]
    if name == "COMPLETE.json":
        version = (tmp_path / "c").resolve()
        record = json.loads((version / name).read_text())
        edit(record)
        (version / name).write_text(json.dumps(record))
    else:
        _forge(tmp_path / "c", name, edit)
    for tool in (inspect_checkpoint, read_checkpoint, read_whole_checkpoint):
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            tool(tmp_path / "c")


def test_inspect_counts_no_byte_behind_a_link(tmp_path):
    from tests.checkpoint_scenario import build

    model, opt = build()
    save_checkpoint(tmp_path / "c", model=model, optimizer=opt)
    size = inspect_checkpoint(tmp_path / "c")["bytes_on_disk"]
    big = tmp_path / "big"
    big.write_bytes(b"x" * (1 << 20))
    os.symlink(big, (tmp_path / "c").resolve() / "link")
    assert inspect_checkpoint(tmp_path / "c")["bytes_on_disk"] == size


def test_the_staging_zeroes_exactly_what_no_saved_piece_fills():
    """``zero_unwritten``: the staging buffers are not initialised; what no view covers is zeroed, what
    a view covers is left for the read (overlapping, touching and empty views; a buffer no view covers)."""
    from nxd_smp.optim.loading.staged import zero_unwritten

    staging = {"exp_avg": [torch.full((10,), float("nan")), torch.full((4,), float("nan"))],
               None: [torch.full((6,), float("nan"))]}
    a, b = staging["exp_avg"][0], staging[None][0]
    written = [a[1:3], a[2:5], a[5:6], a[8:8], b[0:6], torch.full((3,), float("nan"))]  # (the last: no buffer's)
    zero_unwritten(staging, written)
    assert torch.equal(a.isnan(), torch.tensor([False, True, True, True, True, True, False, False, False, False]))
    assert torch.equal(a[~a.isnan()], torch.zeros(5)) and torch.equal(staging["exp_avg"][1], torch.zeros(4))
    assert b.isnan().all()


def test_a_load_into_uninitialised_staging_installs_the_saved_state_and_zero_padding(tmp_path, monkeypatch):
    """Every fresh tensor of the load made of NaN (what ``torch.empty`` may return): the loaded masters and
    moments equal the saved ones element for element, the shard's padding (46 elements in 48) zeros."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7))
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, mixed_precision=KEEP)
    for _ in range(2):
        model(torch.randn(4, 5)).square().sum().backward()
        opt.step()
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
    fresh = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7))
    loaded = Zero1Optimizer(fresh.parameters(), torch.optim.AdamW, lr=1e-2, mixed_precision=KEEP)
    assert [layout.shard_numel for layout in loaded.bucket_layouts] == [48]
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    load_checkpoint(tmp_path / "ckpt", model=fresh, optimizer=loaded)
    monkeypatch.undo()

    def flat(o):
        return [t for shard in o._masters.shards for t in (shard, *o._inner.state[shard].values())]

    for got, saved in zip(flat(loaded), flat(opt), strict=True):
        assert torch.equal(got, saved)
    assert all(not t[46:].any() for t in flat(loaded) if t.numel() == 48)
