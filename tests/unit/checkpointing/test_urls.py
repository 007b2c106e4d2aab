"""A URL is never a local folder: every entry point that takes a path refuses ``scheme://...`` (and the
``scheme:/...`` that ``pathlib.Path`` makes of it) by its scheme, before anything is made on disk, but
``s3://`` where a checkpoint itself is read or written (object storage); a relative local path with a
colon later in it still saves and loads."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import nxd_smp
from nxd_smp import ConfigError, has_checkpoint, load_checkpoint, save_checkpoint
from nxd_smp.checkpoint import consolidate, inspect_checkpoint, read_checkpoint, remove_checkpoint
from nxd_smp.checkpointing.files import Folder, local_path
from nxd_smp.cli import main
from nxd_smp.interop.accelerate import register_accelerate_hooks
from nxd_smp.interop.loop_checkpoints import REFERENCE_FORMAT, load_beside, read_reference, save_beside
from nxd_smp.interop.native_torch import export_safetensors, export_torch, import_torch
from nxd_smp.interop.torch_xla import export_xla, import_xla

#: (the path as a user hands it, its scheme)
URLS = [
    ("s3://bucket/run1", "s3"),
    ("gs://b/p", "gs"),
    ("hdfs://nn:8020/x", "hdfs"),
    ("https://host/x", "https"),
    ("file:///tmp/x", "file"),
    (Path("s3://bucket/run1"), "s3"),  # pathlib folds it into s3:/bucket/run1
]


def tiny() -> tuple[nn.Module, nxd_smp.Zero1Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    return model, nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)


def _accelerate_hook(which: int):
    """accelerate's save (0) or load (1) pre-hook, as ``register_accelerate_hooks`` hands it to the
    accelerator, called with ``url`` as accelerate's output or input folder."""
    def call(url, model, opt):
        hooks = []
        accelerator = SimpleNamespace(_optimizers=[opt], register_save_state_pre_hook=hooks.append,
                                      register_load_state_pre_hook=hooks.append)
        register_accelerate_hooks(accelerator, model, opt)
        return hooks[0]([model], [], url) if which == 0 else hooks[1]([model], url)
    return call


def _trainer_callback(event: str):
    """The Hugging Face Trainer's callback, given the trainer, with ``url`` as ``output_dir``: at the
    start of training, or at a step the Trainer saves."""
    def call(url, model, opt):
        pytest.importorskip("transformers")
        from nxd_smp.interop.hf_trainer import Zero1TrainerCallback

        trainer = SimpleNamespace(optimizer=opt, model=model, model_wrapped=model,
                                  callback_handler=SimpleNamespace(callbacks=[]))
        callback = Zero1TrainerCallback(trainer)
        args = SimpleNamespace(output_dir=url, max_grad_norm=1.0, save_strategy="steps", save_only_model=False)
        state = SimpleNamespace(global_step=0, log_history=[], is_hyper_param_search=False)
        if event == "train_begin":
            return callback.on_train_begin(args, state, None, optimizer=opt)
        return callback.on_step_end(args, state, SimpleNamespace(should_save=True))
    return call


#: Every entry point that takes a user's path, called with ``url`` where that path goes; a checkpoint
#: or output beside it is a local name that does not exist (nothing may be made there either).
ENTRY_POINTS = {
    "save_checkpoint": lambda url, m, o: save_checkpoint(url, model=m, optimizer=o),
    "save_checkpoint(dir, tag)": lambda url, m, o: save_checkpoint(url, "step_1", m, o),
    "save_checkpoint(checkpoint_dir_str=)": lambda url, m, o: save_checkpoint(checkpoint_dir_str=url, tag="step_1",
                                                                              model=m, optimizer=o),
    "save_checkpoint(state dicts)": lambda url, m, o: save_checkpoint(url, "step_1", model=m.state_dict(),
                                                                      optimizer=o.state_dict()),
    "save_checkpoint(async)": lambda url, m, o: save_checkpoint(url, model=m, optimizer=o, async_save=True),
    "load_checkpoint": lambda url, m, o: load_checkpoint(url, model=m, optimizer=o),
    "load_checkpoint(dir, tag)": lambda url, m, o: load_checkpoint(url, "step_1", model=m, optimizer=o),
    "load_checkpoint(state dicts)": lambda url, m, o: load_checkpoint(url, "step_1", model={}, optimizer={}),
    "has_checkpoint": lambda url, m, o: has_checkpoint(url),
    "remove_checkpoint": lambda url, m, o: remove_checkpoint(url),
    "inspect_checkpoint": lambda url, m, o: inspect_checkpoint(url),
    "read_checkpoint": lambda url, m, o: read_checkpoint(url),
    "consolidate": lambda url, m, o: consolidate(url, "plain.pt"),
    "consolidate(out)": lambda url, m, o: consolidate("ckpt", url),
    "export_torch": lambda url, m, o: export_torch(url, "dcp"),
    "export_torch(coordinates)": lambda url, m, o: export_torch(["ckpt", url], "dcp"),
    "export_torch(out)": lambda url, m, o: export_torch("ckpt", url),
    "import_torch": lambda url, m, o: import_torch(url, model=m, optimizer=o),
    "export_safetensors": lambda url, m, o: export_safetensors(url, "w.safetensors"),
    "export_safetensors(out)": lambda url, m, o: export_safetensors("ckpt", url),
    "export_xla": lambda url, m, o: export_xla(url, "xla", 2),
    "export_xla(out)": lambda url, m, o: export_xla("ckpt", url, 2),
    "import_xla": lambda url, m, o: import_xla([url], model=m, optimizer=o),
    "save_beside": lambda url, m, o: save_beside(url, m, o),
    "load_beside": lambda url, m, o: load_beside(url, m, o, {"format": REFERENCE_FORMAT, "checkpoint": "nxd_smp"}),
    "read_reference": lambda url, m, o: read_reference(url),
    "accelerate save_state": _accelerate_hook(0),
    "accelerate load_state": _accelerate_hook(1),
    "Trainer callback, training begins": _trainer_callback("train_begin"),
    "Trainer callback, a step saves": _trainer_callback("step_end"),
}

#: The command line, with ``URL`` where the user's path goes.
COMMANDS = {
    "inspect": ["inspect", "URL"],
    "inspect --verify": ["inspect", "URL", "--verify"],
    "consolidate": ["consolidate", "URL", "plain.pt"],
    "consolidate OUT": ["consolidate", "ckpt", "URL"],
    "export-xla": ["export-xla", "URL", "xla", "--dp-size", "2"],
    "export-xla OUT_DIR": ["export-xla", "ckpt", "URL", "--dp-size", "2"],
    "export-torch": ["export-torch", "URL", "dcp"],
    "export-torch OUT_DIR": ["export-torch", "ckpt", "URL"],
    "export-safetensors": ["export-safetensors", "URL", "w.safetensors"],
    "export-safetensors OUT": ["export-safetensors", "ckpt", "URL"],
}


#: The entry points and commands that read or write a checkpoint itself, which take ``s3://`` (object storage:
#: tests/integration/test_object_storage.py); an ``s3://`` output, a file of another tool or a loop's folder is
#: refused as any URL is.
TAKE_S3 = {"save_checkpoint", "save_checkpoint(dir, tag)", "save_checkpoint(checkpoint_dir_str=)",
           "save_checkpoint(async)", "save_checkpoint(state dicts)", "load_checkpoint", "load_checkpoint(dir, tag)",
           "load_checkpoint(state dicts)", "has_checkpoint",
           "remove_checkpoint", "inspect_checkpoint", "read_checkpoint", "consolidate", "export_torch",
           "export_torch(coordinates)", "export_safetensors", "export_xla",
           "inspect", "inspect --verify", "export-xla", "export-torch", "export-safetensors"}


def refusing(doors: dict) -> list:
    """(door, url, scheme) for every URL a door refuses: all of them, but ``s3`` where the door takes it."""
    return [pytest.param(door, url, scheme, id=f"{door}-{url}") for door in sorted(doors) for url, scheme in URLS
            if not (scheme == "s3" and door in TAKE_S3)]


def names_scheme(scheme: str) -> str:
    """What the refusal must hold: the scheme named, quoted (``'file'``, not the word in "file system")."""
    return re.escape(f"{scheme!r}")


@pytest.mark.parametrize("entry, url, scheme", refusing(ENTRY_POINTS))
def test_every_entry_point_refuses_a_url_by_its_scheme_and_makes_nothing(entry, url, scheme, tmp_path,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, opt = tiny()
    with pytest.raises(ConfigError, match=names_scheme(scheme)):
        ENTRY_POINTS[entry](url, model, opt)
    nxd_smp.finalize_checkpoint()  # (a background save, had one started, would write now)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, url, scheme", refusing(COMMANDS))
def test_the_command_line_refuses_a_url_in_one_error_line_with_status_2(command, url, scheme, tmp_path,
                                                                         monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = [str(url) if arg == "URL" else arg for arg in COMMANDS[command]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and re.search(names_scheme(scheme), err), err
    assert "ConfigError" not in err and "s3://" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("url, scheme", URLS, ids=[str(u) for u, _ in URLS])
def test_the_folder_room_refuses_a_url_itself(url, scheme, tmp_path, monkeypatch):
    """Defense in depth: a URL that some caller let through is still no folder."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=names_scheme(scheme)):
        Folder.open(url, create=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("path", ["runs/ckpt", "ckpt/step:5", "step:5", "run:1/ckpt", "/abs/s3://x", "s3:"])
def test_a_colon_that_does_not_start_a_url_is_a_local_name(path):
    assert local_path(path) == Path(path)
    assert local_path(Path(path)) == Path(path)


@pytest.mark.parametrize("path", ["s3://", "./s3:/x", "S3+x.y-z://b"])
def test_a_url_however_written_is_refused(path):
    """``s3://`` is the folder ``s3:`` to pathlib, and ``./s3:/x`` the folded URL ``s3:/x``."""
    with pytest.raises(ConfigError, match="URL"):
        local_path(path)


def test_every_door_that_takes_s3_is_an_entry_point_or_command_here():
    assert TAKE_S3 <= set(ENTRY_POINTS) | set(COMMANDS)


def test_a_path_of_another_type_is_a_type_error():
    with pytest.raises(TypeError, match="int"):
        local_path(3)
    with pytest.raises(TypeError, match="bytes"):
        save_checkpoint(b"ckpt", model=nn.Linear(1, 1))


@pytest.mark.filterwarnings("ignore:the loaded state has no master weights")
def test_a_relative_path_with_a_colon_later_saves_and_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, opt = tiny()
    save_checkpoint("ckpt/step:5", model=model, optimizer=opt, extra={"step": 5})
    save_checkpoint("run:1", "step_1", model, opt)  # NxD's call shape: a colon in the directory
    assert (tmp_path / "ckpt" / "step:5").is_symlink() and (tmp_path / "run:1" / "step_1").is_symlink()
    assert has_checkpoint("ckpt/step:5") and has_checkpoint("run:1")
    assert inspect_checkpoint("ckpt/step:5")["optimizer"]["dp_size_written_at"] == 1
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    other_opt = nxd_smp.Zero1Optimizer(other.parameters(), torch.optim.AdamW, lr=1e-3)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert load_checkpoint("ckpt/step:5", model=other, optimizer=other_opt) == {"step": 5}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    load_checkpoint("run:1", "step_1", model=other, optimizer=other_opt)
    assert not (tmp_path / "ckpt:").exists() and not (tmp_path / "run:").exists()
