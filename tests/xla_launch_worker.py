"""The Trainium launch as users run it, on the XLA CPU device: run by test_launch.py under
``torchrun --nproc-per-node 1`` with ``init_process_group("xla", init_method="xla://")``.

Every API an NxD script uses builds its optimizer after the xla process group exists, with
each group form a script passes (none, the default group, a ``dist.new_group``, replica
groups), and trains the oracle's parameters on fixed gradients. The NxD-settings case then
saves a checkpoint from the XLA device, loads it back on the XLA device and on the CPU (in
this process, the xla group still initialised), and both continue. Results go to
``OUT/results.pt`` for the test to compare against the unsharded oracle.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.oracle import Scenario, fixed_grad_loss, fixed_grads, make_model, param_groups

STEPS, SAVED_AT, WARMUP = 5, 3, 3
SCENARIO = Scenario("launch", "AdamW", fixed_grads=True, steps=STEPS, micro=2, max_norm=0.5)
SGD = Scenario("launch_sgd", "SGD", opt_kwargs={"momentum": 0.9}, lr_a=0.05, lr_b=0.02, fixed_grads=True,
               steps=STEPS, micro=2, max_norm=0.05)
#: The README's Trainium settings: NxD's dict with sharded accumulation.
TRAINIUM = Scenario("launch_trainium", "AdamW", fixed_grads=True, steps=STEPS, micro=2, max_norm=0.5,
                    sharded_acc=True, api="nxd_config")


def scenario_of(api: str) -> Scenario:
    return {"nxd_config": SGD, "nxd_trainium": TRAINIUM}.get(api, SCENARIO)


def build(api: str, group, model) -> torch.optim.Optimizer:
    import nxd_smp

    s = scenario_of(api)
    groups = param_groups(model, lr_a=s.lr_a, lr_b=s.lr_b)
    if api == "neuron":  # what NxD's initialize_parallel_optimizer passes
        return nxd_smp.NeuronZero1Optimizer(
            groups, s.optimizer_class, optimizer_dtype=torch.float32, grad_clipping=True, max_norm=s.max_norm,
            pin_layout=False, sharding_groups=group, bucket_cap_mb_reduce_scatter=130,
            bucket_cap_mb_all_gather=130, use_grad_acc_hook=True, higher_cc_precision=True,
            save_master_weights=True, **s.opt_kwargs,
        )
    if api == "nxd_config":
        cfg = nxd_smp.neuronx_distributed_config(
            optimizer_config={"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": s.max_norm},
            mixed_precision_config={"use_master_weights_in_ckpt": True},
        )
        return nxd_smp.initialize_parallel_optimizer(cfg, s.optimizer_class, groups, process_group=group,
                                                     **s.opt_kwargs)
    if api == "nxd_trainium":
        cfg = nxd_smp.neuronx_distributed_config(
            optimizer_config={"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": s.max_norm},
            mixed_precision_config={"use_sharded_grad_acc": True},
        )
        return nxd_smp.initialize_parallel_optimizer(cfg, s.optimizer_class, groups, process_group=group)
    return nxd_smp.Zero1Optimizer(groups, s.optimizer_class, max_norm=s.max_norm, process_group=group,
                                  bucket_cap_mb=s.bucket_cap_mb, **s.opt_kwargs)


def train(model, opt, scenario: Scenario, steps: range, sync) -> list[float]:
    norms = []
    for step in steps:
        for micro in range(scenario.micro):
            fixed_grad_loss(model, fixed_grads(scenario.seed, 0, step, micro, model)).backward()
        opt.step()
        opt.zero_grad()
        sync()
        norms.append(float(opt.grad_norm.cpu()))
    return norms


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def held_writer():
    """Hold the background part of the next asynchronous save until the event is set."""
    import threading

    from nxd_smp.checkpointing import save as checkpoint_save

    go, write = threading.Event(), checkpoint_save._write_and_publish

    def held(*args, **kwargs):
        go.wait()
        checkpoint_save._write_and_publish = write
        return write(*args, **kwargs)

    checkpoint_save._write_and_publish = held
    return go


def main(out_dir: str) -> None:
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend)

    import nxd_smp

    dist.init_process_group("xla", init_method="xla://")
    out = Path(out_dir)
    device = torch_xla.device()
    results: dict = {"backend": dist.get_backend(), "world": dist.get_world_size(), "cases": {}}
    forms = {
        "zero1_no_group": ("zero1", lambda: None),
        "zero1_default_group": ("zero1", lambda: dist.group.WORLD),
        "zero1_new_group": ("zero1", lambda: dist.new_group([0])),
        "zero1_replica_groups": ("zero1", lambda: [[0]]),
        "neuron": ("neuron", lambda: None),
        "nxd_config": ("nxd_config", lambda: None),
        "nxd_trainium_settings": ("nxd_trainium", lambda: dist.group.WORLD),
    }
    for name, (api, group) in forms.items():
        model = make_model(0).to(device)
        opt = build(api, group(), model)
        scenario = scenario_of(api)
        compiles = []
        norms = []
        for step in range(STEPS):
            norms += train(model, opt, scenario, range(step, step + 1), torch_xla.sync)
            compiles.append((met.metric_data("CompileTime") or [0])[0])
            if name == "neuron" and step + 1 == SAVED_AT:
                nxd_smp.save_checkpoint(out / "from_xla", model=model, optimizer=opt)
                results["at_save"] = params_of(model)
            if name == "zero1_default_group" and step + 1 == SAVED_AT:
                writing = held_writer()
                nxd_smp.save_checkpoint(out / "async_from_xla", model=model, optimizer=opt, async_save=True)
        if name == "zero1_default_group":
            writing.set()  # the background writer starts only once the steps after the save ran
            nxd_smp.finalize_checkpoint()
            saved = nxd_smp.checkpoint.read_checkpoint(out / "async_from_xla")["optimizer"]["state"]
            results["async_saved_steps"] = sorted({float(s["step"]) for s in saved.values() if "step" in s})
        results["cases"][name] = {"params": params_of(model), "norms": norms, "compiles": compiles,
                                  "backend": type(opt.backend).__name__, "world_size": opt.world_size,
                                  "sharded_grad_acc": opt.mixed_precision.use_sharded_grad_acc}

    # The checkpoint saved from the XLA device, loaded back there and on the CPU, both continued.
    for where in ("xla", "cpu"):
        model = make_model(7).to(device if where == "xla" else "cpu")
        opt = build("neuron", None, model)
        nxd_smp.load_checkpoint(out / "from_xla", model=model, optimizer=opt)
        sync = torch_xla.sync if where == "xla" else (lambda: None)
        train(model, opt, SCENARIO, range(SAVED_AT, STEPS), sync)
        results[f"resumed_on_{where}"] = params_of(model)
        results[f"resumed_on_{where}_backend"] = type(opt.backend).__name__
    torch.save(results, out / "results.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
