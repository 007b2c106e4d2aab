"""``nxd_smp.patch_neuronx_distributed()`` under the code that calls NxD, run against stand-ins
of NxD 2.29, NxD Training and optimum-neuron (tests/stand_ins: their module layout, import
pattern and call shapes; none of them can be installed here). NxD's own optimizer, wrapper and
checkpoint functions raise in the stand-ins, so whatever trains or saves below is nxd_smp's.

Each scenario runs in a process of its own with the stand-ins on its path (this process never
imports them; ``python -c`` forked from the tests' preloaded server, tests/distributed.py), as one
gloo process: NxD's parallel state exists only under torch.distributed."""

from __future__ import annotations

import os
from pathlib import Path

from tests.distributed import run_python

ROOT = Path(__file__).resolve().parents[3]
STAND_INS = ROOT / "tests" / "stand_ins"

_PRELUDE = '''
import importlib, json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
import nxd_smp

dist.init_process_group("gloo", init_method=f"file://{os.getcwd()}/rendezvous", rank=0, world_size=1)


def raises(fn, error, text):
    try:
        fn()
    except error as e:
        assert text in str(e), e
    else:
        raise AssertionError(f"no {error.__name__} ({text})")


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def tiny_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(torch.bfloat16)


def backward(model, step, micro=0):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + micro))
    model(x.bfloat16()).float().pow(2).mean().backward()
'''


def run_scenario(code: str, cwd: Path) -> tuple[bool, str]:
    """Run ``code`` (its own assertions) after the prelude in a process of its own in ``cwd``:
    whether it ran to its end ("checked"), and what it printed."""
    env = {**os.environ, "PYTHONPATH": f"{STAND_INS}:{ROOT}", "USE_TORCH_XLA": "0"}
    script = f"STAND_INS = {str(STAND_INS)!r}\n" + _PRELUDE + code + '\nprint("checked")\n'
    proc = run_python(["-c", script], cwd=cwd, env=env, timeout=240)
    return proc.returncode == 0 and proc.stdout.rstrip().endswith("checked"), proc.stdout + proc.stderr


_THE_PATCH = '''
# NxD's modules and the six names each binds in NxD 2.29
NXD_MODULES = {
    "neuronx_distributed": ["initialize_parallel_optimizer", "save_checkpoint", "load_checkpoint",
                            "has_checkpoint", "finalize_checkpoint"],
    "neuronx_distributed.trainer": ["initialize_parallel_optimizer", "save_checkpoint", "load_checkpoint"],
    "neuronx_distributed.trainer.trainer": ["NeuronZero1Optimizer", "initialize_parallel_optimizer"],
    "neuronx_distributed.trainer.checkpoint": ["NeuronZero1Optimizer", "save_checkpoint", "load_checkpoint",
                                               "has_checkpoint", "finalize_checkpoint"],
    "neuronx_distributed.optimizer": ["NeuronZero1Optimizer"],
    "neuronx_distributed.optimizer.zero_redundancy_optimizer": ["NeuronZero1Optimizer"],
}
OURS = {"NeuronZero1Optimizer": nxd_smp.NeuronZero1Optimizer,
        "initialize_parallel_optimizer": nxd_smp.initialize_parallel_optimizer,
        "save_checkpoint": nxd_smp.save_checkpoint, "load_checkpoint": nxd_smp.load_checkpoint,
        "has_checkpoint": nxd_smp.has_checkpoint, "finalize_checkpoint": nxd_smp.finalize_checkpoint}
STACKS = ("neuronx_distributed", "neuronx_distributed_training", "optimum")

# without NxD on the path, the patch names the package to install
sys.path.remove(STAND_INS)
raises(nxd_smp.patch_neuronx_distributed, ImportError, "neuronx-distributed")
assert "neuronx_distributed" not in sys.modules
sys.path.insert(1, STAND_INS)
importlib.invalidate_caches()

# imported before the patch: optimum-neuron's modules bind NxD's class at module level
import optimum.neuron.accelerate.accelerator as accelerator
import optimum.neuron.accelerate.optimizer as accelerated
import neuronx_distributed as nxd

MIXED = accelerator.MixedPrecisionConfig()  # optimum-neuron's defaults
modules = {name: importlib.import_module(name) for name in NXD_MODULES}
# NxD's own objects, kept in a dict (the patch rebinds module attributes, this one's too)
theirs = {name: getattr(modules[module], name) for module, names in NXD_MODULES.items() for name in names}
assert not set(map(id, theirs.values())) & set(map(id, OURS.values()))

# unpatched, NxD's own run (and fail in the stand-ins), through each caller
model = torch.nn.Linear(4, 2)
cfg = nxd.neuronx_distributed_config(optimizer_config={"zero_one_enabled": True})
raises(lambda: nxd.initialize_parallel_optimizer(cfg, torch.optim.AdamW, model.parameters(), lr=1e-3),
       RuntimeError, "NxD's own NeuronZero1Optimizer")
raises(lambda: accelerator.prepare_optimizer(torch.optim.AdamW(model.parameters()), MIXED),
       RuntimeError, "NxD's own NeuronZero1Optimizer")
raises(lambda: nxd.trainer.save_checkpoint("unused", tag="shards", model=model),
       RuntimeError, "NxD's own save_checkpoint")
assert nxd.trainer.checkpoint.g_iostate is None

nxd_smp.patch_neuronx_distributed()

for module, names in NXD_MODULES.items():
    for name in names:
        assert getattr(modules[module], name) is OURS[name], (module, name)
assert accelerator.NeuronZero1Optimizer is accelerated.NeuronZero1Optimizer is nxd_smp.NeuronZero1Optimizer
for module in list(sys.modules.values()):  # none of NxD's objects is left bound anywhere
    for attribute, value in list(getattr(module, "__dict__", {}).items()):
        assert not any(value is original for original in theirs.values()), (module.__name__, attribute)
# NxD's subclass for expert parallelism is left alone, on NxD's class
assert modules["neuronx_distributed.optimizer"].NeuronEPZero1Optimizer.__bases__ == (theirs["NeuronZero1Optimizer"],)
assert isinstance(nxd.trainer.checkpoint.g_iostate, nxd_smp.interop.nxd.patch.CheckpointIOState)

# imported after the patch: a training script's imports
script = {}
exec("from neuronx_distributed.optimizer import NeuronZero1Optimizer\\n"
     "from neuronx_distributed import initialize_parallel_optimizer, save_checkpoint, load_checkpoint, "
     "has_checkpoint, finalize_checkpoint", script)
assert all(script[name] is ours for name, ours in OURS.items())

# each caller now builds nxd_smp's optimizer
wrapped = accelerator.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), MIXED)
assert type(wrapped.optimizer) is nxd_smp.NeuronZero1Optimizer
assert isinstance(wrapped.optimizer, accelerated.NeuronZero1Optimizer)  # optimum-neuron's step takes its ZeRO-1 path
opt = nxd.initialize_parallel_optimizer(cfg, torch.optim.AdamW, model.parameters(), lr=1e-3)
assert type(opt) is nxd_smp.NxDOptimizer and isinstance(opt.optimizer, nxd_smp.Zero1Optimizer)
defaults = torch.optim.AdamW(model.parameters(), lr=1e-3).defaults
built = nxd.trainer.trainer.initialize_optimizer_from_class(cfg, torch.optim.AdamW, model.parameters(), **defaults)
assert type(built) is nxd_smp.NeuronZero1Optimizer  # NxD's own builder, with NxD's keywords

# a second call changes nothing
def bindings():
    return {(name, attribute): id(value) for name, module in list(sys.modules.items())
            if name.split(".")[0] in STACKS for attribute, value in vars(module).items()}

before = bindings()
nxd_smp.patch_neuronx_distributed()
changed = {key for key, value in bindings().items() if before.get(key) != value}
assert not changed, f"the second call rebound {sorted(changed)}"
'''


def test_the_patch_binds_nxd_smp_wherever_nxd_is_bound_and_only_once(tmp_path):
    """Without NxD: ImportError naming it. Unpatched, the stand-ins' own optimizer and save run
    (and raise); patched, NxD's six names are nxd_smp's in NxD's modules, in the modules that
    bound them before (optimum-neuron's) and in what imports them after, each caller builds
    nxd_smp's optimizer, NxD's io state is the patch's; a second call rebinds nothing."""
    checked, output = run_scenario(_THE_PATCH, tmp_path)
    assert checked, output


_NXD_TRAINING = '''
nxd_smp.patch_neuronx_distributed()
import neuronx_distributed as nxd
from neuronx_distributed_training.lightning_modules.model.base import BaseModelModule
from neuronx_distributed_training.lightning_modules.nlp_overrides import NLPCheckpointIO

# precision "mixed_precision": master weights and fp32 accumulation; gradient_clip_val: null
CONFIG = {"precision": {"type": "mixed_precision"}, "distributed_strategy": {"zero1": True},
          "use_master_weights_in_ckpt": True}
LOOPS = {"fit_loop": {"epoch_progress": {"current": {"completed": 0}}}}


def build(seed):
    model = tiny_model(seed)
    # foreach: a kernel the YAML picks, which nxd_smp keeps (not its compiled CPU update: faster here)
    module = BaseModelModule(model, CONFIG, gradient_clip_val=None, optimizer_class=torch.optim.AdamW,
                             optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1, "foreach": True})
    return model, module.configure_optimizers(), module.nxd_config


def train(model, opt, steps):
    for step in steps:
        for micro in range(2):
            backward(model, step, micro)
        opt.step()
        opt.zero_grad()


def lightning_checkpoint(model, opt, step):
    return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": step,
            "epoch": 0, "loops": LOOPS}


for async_save in (False, True):
    directory = Path(f"async_{async_save}")
    io = NLPCheckpointIO(async_save=async_save)
    model, opt, cfg = build(0)
    assert cfg["optimizer_config"] == {"zero_one_enabled": True, "grad_clipping": False, "max_grad_norm": None}
    mixed = opt.optimizer.mixed_precision
    assert type(opt) is nxd_smp.NxDOptimizer and mixed.use_master_weights and mixed.use_fp32_grad_acc
    train(model, opt, range(2))
    io.save_checkpoint(lightning_checkpoint(model, opt, 2), str(directory / "step=2"))
    train(model, opt, range(2, 3))
    io.save_checkpoint(lightning_checkpoint(model, opt, 3), str(directory / "step=3"))
    train(model, opt, range(3, 4))
    reached = params(model)
    assert opt.grad_norm is not None  # measured, not clipped

    io.remove_checkpoint(str(directory / "step=2"))  # through NxD's io state: the patch's
    io.teardown()
    assert sorted(os.listdir(directory)) == ["step=3"], os.listdir(directory)
    assert nxd.has_checkpoint(str(directory))

    fresh, fresh_opt, _ = build(1)
    assert not same(params(fresh), reached)
    checkpoint = io.load_checkpoint(str(directory / "step=3"))
    assert (checkpoint["global_step"], checkpoint["loops"]) == (3, LOOPS)
    fresh.load_state_dict(checkpoint["state_dict"])  # what Lightning does with the dict
    fresh_opt.load_state_dict(checkpoint["optimizer_states"][0])
    train(fresh, fresh_opt, range(3, 4))
    assert same(params(fresh), reached)

    weights = NLPCheckpointIO(weight_init_only=True).load_checkpoint(str(directory / "step=3"))
    assert "optimizer_states" not in weights and weights["state_dict"].keys() == model.state_dict().keys()
'''


def test_nxd_trainings_flow_saves_removes_and_resumes_bit_for_bit(tmp_path):
    """NxD Training's model setup (``**torch_optimizer.defaults``, a null ``gradient_clip_val``)
    and checkpoint IO, with synchronous and with asynchronous saves: two tags saved, the older
    removed through NxD's io state, the newer loaded into fresh dicts and from them into a fresh
    model and optimizer: the next step is the uninterrupted run's, bit for bit."""
    checked, output = run_scenario(_NXD_TRAINING, tmp_path)
    assert checked, output


_OPTIMUM_NEURON = '''
# optimum-neuron's modules are imported first: they bind NxD's class before the patch
from optimum.neuron.accelerate.accelerator import MixedPrecisionConfig, prepare_optimizer
from optimum.neuron.models.training.modeling_utils import create_parameter_metadata, save_pretrained

nxd_smp.patch_neuronx_distributed()

MIXED = MixedPrecisionConfig(optimizer_use_master_weights=True, optimizer_use_fp32_grad_acc=True,
                             optimizer_save_master_weights_in_ckpt=True)
MAX_NORM = 0.1


def build(seed):
    model = tiny_model(seed)
    return model, prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), MIXED)


def train(model, opt, steps):
    """The trainer's loop: backward, the accelerator's clip_grad_norm_, step, zero_grad."""
    norms = []
    for step in steps:
        backward(model, step)
        opt.prepare_clip_grad_norm(model.parameters(), max_norm=MAX_NORM)
        opt.step()
        norms.append(opt.grad_norm)
        assert opt.optimizer.grad_clipping is False  # switched off again after the step
        opt.zero_grad()
    return norms


model, opt = build(0)
assert type(opt.optimizer) is nxd_smp.NeuronZero1Optimizer
train(model, opt, range(1))
save_pretrained(model, "checkpoint-1", optimizer=opt, async_save=True)
train(model, opt, range(1, 2))
save_pretrained(model, "checkpoint-2", optimizer=opt, async_save=True)  # waits for checkpoint-1 first
norms = train(model, opt, range(2, 3))
reached = params(model)
assert norms[-1] > MAX_NORM  # the step clipped
nxd_smp.finalize_checkpoint()

for saved in ("checkpoint-1", "checkpoint-2"):
    shards = Path(saved) / "shards"
    assert shards.is_symlink(), os.listdir(saved)  # nxd_smp's checkpoint, in place of the folder the wait made
    metadata = shards.resolve() / "mp_metadata_pp_rank_0.json"  # inside the checkpoint's version
    assert json.loads(metadata.read_text()) == create_parameter_metadata(model)

for saved, steps in (("checkpoint-2", range(2, 3)), ("checkpoint-1", range(1, 3))):
    fresh, fresh_opt = build(1)
    assert not same(params(fresh), reached)
    nxd_smp.load_checkpoint(saved, "shards", model=fresh, optimizer=fresh_opt)
    resumed_norms = train(fresh, fresh_opt, steps)
    assert same(params(fresh), reached), saved
    assert torch.equal(resumed_norms[-1], norms[-1])
'''


def test_optimum_neurons_flow_saves_asynchronously_and_resumes_bit_for_bit(tmp_path):
    """optimum-neuron's ZeRO-1 build from the user's AdamW and its clipped step; two asynchronous
    ``save_pretrained`` (NxD's io state waited for, ``shards/done`` touched, the metadata written
    as soon as the save returns, its background part possibly still writing); each checkpoint
    resumes into a fresh model and wrapper, and training goes on as the uninterrupted run, bit
    for bit."""
    checked, output = run_scenario(_OPTIMUM_NEURON, tmp_path)
    assert checked, output
