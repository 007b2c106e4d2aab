"""Run by test_xla_downcast.py in a child process with ``PJRT_DEVICE=CPU XLA_DOWNCAST_BF16=1``:
NxD Training's default precision on the XLA CPU device, where torch float32 is bf16 and float64
is fp32. The model stays torch float32; nxd_smp's masters, states and accumulation are float64.

The gradient is constant (1.0) and the learning rate 2**-13, below half a bf16 ulp of the
weights (in [1, 2): an ulp of 2**-7): every step moves an fp32 master exactly (the
update is exact in fp32) while a bf16 master would never move. Writes a torch.save'd dict of
what the run reached, read back and resumed.
"""

from __future__ import annotations

import sys

import torch

LR = 2.0**-13
STEPS = 40  # 40 * 2**-13 is more than half a bf16 ulp: the parameters move too
SHAPES = {"a": (33,), "b": (4, 6)}


def initial() -> dict[str, torch.Tensor]:
    """Weights in [1, 2), exactly bf16 (the device rounds float32 to bf16)."""
    g = torch.Generator().manual_seed(0)
    return {n: (1 + torch.rand(s, generator=g)).bfloat16().float() for n, s in SHAPES.items()}


class Params(torch.nn.Module):
    def __init__(self, values: dict[str, torch.Tensor]):
        super().__init__()
        for n, v in values.items():
            self.register_parameter(n, torch.nn.Parameter(v.clone()))


def main(out: str, ckpt_dir: str, cpu_ckpt: str) -> None:
    import torch_xla
    import torch_xla.debug.metrics as met

    import nxd_smp
    from nxd_smp.checkpoint import read_checkpoint

    device = torch_xla.device()
    results: dict = {}

    def build(api: str):
        model = Params(initial()).to(device)  # torch float32: bf16 on the device
        params = list(model.parameters())
        if api == "nxd_config":  # NxD Training's precision.type mixed_precision
            cfg = nxd_smp.neuronx_distributed_config(
                optimizer_config={"zero_one_enabled": True, "grad_clipping": False, "max_grad_norm": None},
                mixed_precision_config={"use_master_weights": True, "use_fp32_grad_acc": True,
                                        "use_master_weights_in_ckpt": True})
            opt = nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.SGD, params, lr=LR)
        else:  # what NxD's initialize_parallel_optimizer builds under XLA_DOWNCAST_BF16=1
            opt = nxd_smp.NeuronZero1Optimizer(params, torch.optim.SGD, optimizer_dtype=torch.double,
                                               grad_clipping=False, pin_layout=False, use_grad_acc_hook=True,
                                               higher_cc_precision=True, save_master_weights=True, lr=LR)
        return model, opt

    def train(model, opt, steps: int) -> list[int]:
        compiles = []
        for _ in range(steps):
            sum((p * torch.ones_like(p)).sum() for p in model.parameters()).backward()  # gradient 1.0
            opt.step()
            opt.zero_grad()
            torch_xla.sync()
            compiles.append(met.metric_data("CompileTime")[0])
        return compiles

    for api in ("nxd_config", "neuron"):
        model, opt = build(api)
        compiles = train(model, opt, STEPS)
        masters = [m.cpu() for m in opt.master_shards]
        results[api] = {
            "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
            "param_dtypes": {n: str(p.dtype) for n, p in model.named_parameters()},
            "master_dtypes": sorted({str(m.dtype) for m in masters}),
            "masters": masters,
            "layouts": [(layout.param_indices, layout.numels) for layout in opt.bucket_layouts],
            "norm": float(opt.grad_norm),
            "compiles": compiles,
        }
        if api == "nxd_config":
            nxd_smp.save_checkpoint(ckpt_dir, model=model, optimizer=opt)
            saved = read_checkpoint(ckpt_dir)
            results["saved"] = {"model": saved["model"], "masters": saved["optimizer"]["master_weights"],
                                "state": saved["optimizer"]["state"]}
            fresh, fresh_opt = build("nxd_config")
            nxd_smp.load_checkpoint(ckpt_dir, model=fresh, optimizer=fresh_opt)
            train(fresh, fresh_opt, 1)
            results["resumed"] = {n: p.detach().cpu() for n, p in fresh.named_parameters()}
            results["resumed_masters"] = [m.cpu() for m in fresh_opt.master_shards]
    # a checkpoint saved without downcast (a bf16 model on the CPU) resumes here
    model, opt = build("nxd_config")
    nxd_smp.load_checkpoint(cpu_ckpt, model=model, optimizer=opt)
    train(model, opt, 1)
    results["from_cpu"] = {n: p.detach().cpu() for n, p in model.named_parameters()}
    results["from_cpu_masters"] = [m.cpu() for m in opt.master_shards]
    try:
        nxd_smp.Zero1Optimizer(Params(initial()).to(device).parameters(), torch.optim.SGD, lr=LR,
                               mixed_precision=nxd_smp.MixedPrecisionConfig(use_param_remainders=True))
        results["remainders_refused"] = ""
    except nxd_smp.ConfigError as e:
        results["remainders_refused"] = str(e)
    torch.save(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
