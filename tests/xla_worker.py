"""Run on the XLA CPU device (PJRT_DEVICE=CPU) by test_xla.py in a child process.

Trains the oracle's parameters with the same optimizer on plain CPU and on the XLA
device and reports the parameters, gradient norms and XLA metrics as a torch.save'd
dict. The loss is ``sum(p * g)`` with fixed bf16 tensors ``g``, so both devices see
bit-identical gradients: XLA computes bf16 model code with other intermediate rounding
than eager, and this test is about the optimizer. It also runs tests/unfreezing.py's schedule on
the device (each parameter's own Adam ``step``).
"""

from __future__ import annotations

import sys
import tempfile

import torch


def variants():
    from nxd_smp import MixedPrecisionConfig, NeuronZero1Optimizer, Zero1Optimizer
    from nxd_smp.optim.loss_scaler import DynamicLossScaler

    def smp(params, on_xla):
        return Zero1Optimizer(params, torch.optim.AdamW, max_norm=0.5, bucket_cap_mb=0.0004)

    def legacy(params, on_xla):
        mp = MixedPrecisionConfig(use_master_weights=False, use_fp32_grad_acc=False)
        return Zero1Optimizer(params, torch.optim.SGD, mixed_precision=mp, momentum=0.9, max_norm=0.05)

    def neuron(params, on_xla):
        return NeuronZero1Optimizer(
            params, torch.optim.AdamW, use_grad_acc_hook=True, higher_cc_precision=True,
            pin_layout=False, sharding_groups=[[0]] if on_xla else None, max_norm=0.5,
        )

    def scaler(params, on_xla):
        return Zero1Optimizer(params, torch.optim.AdamW, max_norm=0.5,
                              loss_scaler=DynamicLossScaler(init_scale=16.0, hysteresis=1))

    return {
        "smp": smp, "legacy": legacy, "neuron": neuron, "scaler": scaler,
        # the gradient lifecycle: the loop only calls model.zero_grad(), as the HF Trainer
        "smp_model_zero_grad": smp,
        # weights changed in place after the optimizer was built are taken up
        "smp_weights_changed_after_build": smp,
    }


def run(name, build, device, steps, warmup):
    import torch_xla
    import torch_xla.debug.metrics as met

    from tests.oracle import make_model, param_groups

    on_xla = device.type == "xla"
    model = make_model(0).to(device)
    opt = build(param_groups(model, lr_a=1e-2, lr_b=3e-2), on_xla)
    trained = [p for p in model.parameters() if p.requires_grad]
    if name == "smp_weights_changed_after_build":
        with torch.no_grad():
            for i, p in enumerate(trained):
                p.mul_(0.5 + 0.1 * i)
    g = torch.Generator().manual_seed(0)
    grads = [
        [[(torch.randn(p.shape, generator=g) * 0.3).bfloat16().to(device) for p in trained] for _ in range(2)]
        for _ in range(steps)
    ]
    if opt.loss_scaler is not None:  # an overflow after warm-up: skipped inside the graph
        grads[steps - 2][0][0].view(-1)[0] = float("inf")
    if on_xla:
        torch_xla.sync()
    norms, marks = [], {}
    for step in range(steps):
        for micro in grads[step]:
            opt.scale_loss(sum((p * d).sum() for p, d in zip(trained, micro))).backward()
        opt.step()
        if name == "smp_model_zero_grad":
            model.zero_grad()
        else:
            opt.zero_grad()
        norms.append(opt.grad_norm)
        if on_xla:
            torch_xla.sync()
            if step + 1 in (warmup, steps):
                marks[step + 1] = {
                    "compiles": (met.metric_data("CompileTime") or [0])[0],
                    "from_device": (met.metric_data("TransferFromDeviceTime") or [0])[0],
                    "item_calls": met.counter_value("xla::_local_scalar_dense") or 0,
                }
    if opt.loss_scaler is not None:
        marks["scale"] = float(opt.loss_scaler.scale.cpu())
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    return params, [float(n.cpu()) for n in norms], marks


def unfreezing(device, tmp: str) -> dict[str, dict]:
    """tests/unfreezing.py's schedule on the XLA device, without and with a loss scaler (whose step
    counters live on the device): trained through, and resumed from a checkpoint saved midway, on the
    device and on the CPU. Each run's parameters and reported counters."""
    import torch_xla

    from nxd_smp import DynamicLossScaler, load_checkpoint, save_checkpoint
    from tests.unfreezing import STEPS, counters, model, train, zero1

    def build(on, scaled):
        net = model().to(on)
        scaler = DynamicLossScaler(init_scale=1.0, growth_interval=10**6) if scaled else None
        return net, zero1(net, loss_scaler=scaler)

    out = {}
    for scaled in (False, True):
        net, opt = build(device, scaled)
        train(net, opt, 0, 6, torch_xla.sync)
        path = f"{tmp}/{'scaled' if scaled else 'plain'}"
        save_checkpoint(path, model=net, optimizer=opt)
        saved = counters(net, opt)
        train(net, opt, 6, STEPS, torch_xla.sync)
        out[f"through_{scaled}"] = ({n: p.detach().cpu() for n, p in net.named_parameters()}, counters(net, opt), saved)
        for on in (device, torch.device("cpu")):
            net, opt = build(on, scaled)
            load_checkpoint(path, model=net, optimizer=opt)
            loaded = counters(net, opt)
            train(net, opt, 6, STEPS, torch_xla.sync if on.type == "xla" else lambda: None)
            out[f"resumed_{scaled}_on_{on.type}"] = ({n: p.detach().cpu() for n, p in net.named_parameters()},
                                                     counters(net, opt), loaded)
    return out


def main(out_path: str) -> None:
    import torch_xla

    # The XLA device must exist before the first backward, or autograd's engine has no
    # queue for it.
    device = torch_xla.device()
    steps, warmup = 6, 3
    results = {}
    for name, build in variants().items():
        results[name] = {
            "cpu": run(name, build, torch.device("cpu"), steps, warmup),
            "xla": run(name, build, device, steps, warmup),
        }
    results["steps"], results["warmup"] = steps, warmup
    with tempfile.TemporaryDirectory() as tmp:
        results["unfreezing"] = unfreezing(device, tmp)
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
