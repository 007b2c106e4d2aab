"""Checkpoints on object storage, against a real S3 server (SeaweedFS, ``tests/s3_server.py``) started for
this module: NxD's call shapes with ``s3://``, a round trip at DP 1 and 2 resumed at DP 3 against the run
that was never interrupted, a save killed mid-upload, two jobs racing for one commit, retention, the
server stopped and restarted mid-save, and the commit protocol's own cases, each checked from outside by
listing the bucket (what a load can see)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from nxd_smp import ConfigError, has_checkpoint, load_checkpoint, save_checkpoint
from nxd_smp.checkpoint import consolidate, inspect_checkpoint, remove_checkpoint
from nxd_smp.checkpointing import object_io, object_store
from nxd_smp.checkpointing.locations import open_store
from nxd_smp.checkpointing.object_io import S3Path
from nxd_smp.checkpointing.object_store import COMMITS
from nxd_smp.core.errors import CheckpointError
from tests.checkpoint_scenario import build, load_then_continue, params_of, save_then_continue, train
from tests.distributed import run_ranks
from tests.oracle import assert_params_close
from tests.s3_server import S3Server, quiet_port

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "ckpt"

pytestmark = pytest.mark.filterwarnings("ignore:the loaded state has no master weights")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server, reached through boto3's standard chain (``AWS_ENDPOINT_URL``) by this process and its
    children; a fresh data folder for this module."""
    server = S3Server(tmp_path_factory.mktemp("s3") / "data")
    server.start()
    server.client().create_bucket(Bucket=BUCKET)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in server.env.items():
            patch.setenv(key, value)
        object_io._client = None  # (made again from this environment)
        object_store._conditional_writes.clear()
        yield server
        object_io._client = None
    server.stop()


@pytest.fixture
def prefix(request, server):
    """A prefix of its own for each test: ``s3://ckpt/<test name>``."""
    return f"s3://{BUCKET}/{re.sub(r'[^a-z0-9]+', '-', request.node.name.lower()).strip('-')[:60]}"


def commits(server, prefix: str) -> list[str]:
    key = prefix.removeprefix(f"s3://{BUCKET}/")
    return [k.rsplit("/", 1)[-1] for k in server.keys(BUCKET, f"{key}/{COMMITS}/")]


def keys(server, prefix: str) -> list[str]:
    return server.keys(BUCKET, prefix.removeprefix(f"s3://{BUCKET}/") + "/")


def assert_same_params(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "parameters differ"


# ---------------------------------------------------------------------------- round trips
def test_nxd_call_shapes_round_trip_bit_exact_at_dp1(server, prefix):
    uninterrupted = save_then_continue(0, 1, f"{prefix}/ckpt")
    assert has_checkpoint(f"{prefix}/ckpt") and has_checkpoint(prefix) and not has_checkpoint(f"{prefix}/other")
    assert_same_params(load_then_continue(0, 1, f"{prefix}/ckpt"), uninterrupted)
    # NxD's shape: a directory of tags, the newest loaded, user content back
    model, opt = build(seed=0)
    train(model, opt, 3, 0)
    version = save_checkpoint(prefix, "step_3", model, opt, user_content={"step": 3}, num_kept_ckpts=-1)
    other, other_opt = build(seed=7)
    assert load_checkpoint(prefix, model=other, optimizer=other_opt) == {"step": 3}
    assert load_checkpoint(str(version), model=other, optimizer=other_opt) == {"step": 3}  # (the version itself)
    assert_same_params(params_of(other), params_of(model))
    for mine, theirs in zip(opt.master_shards, other_opt.master_shards):
        assert torch.equal(mine, theirs)
        saved, loaded = opt.inner_optimizer.state[mine], other_opt.inner_optimizer.state[theirs]
        assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_saved_at_dp2_resumes_at_dp3_as_the_run_that_was_never_interrupted(server, prefix):
    uninterrupted = run_ranks(2, save_then_continue, f"{prefix}/ckpt")
    assert_same_params(run_ranks(2, load_then_continue, f"{prefix}/ckpt")[1], uninterrupted[1])
    assert_params_close(run_ranks(3, load_then_continue, f"{prefix}/ckpt")[0], uninterrupted[0],
                        max_ulp=2, max_flip_fraction=0.05)
    # each rank uploaded its own files into the one version
    files = {k.rsplit("/", 1)[-1] for k in keys(server, f"{prefix}/ckpt")}
    assert {"__0_0.bin", "__1_0.bin", "COMPLETE.json", "nxd_smp_index.json"} <= files


def test_a_background_save_uploads_while_training_goes_on(server, prefix):
    uninterrupted = save_then_continue(0, 1, f"{prefix}/ckpt", True)
    assert_same_params(load_then_continue(0, 1, f"{prefix}/ckpt"), uninterrupted)


def test_the_offline_tools_read_from_s3(server, prefix, tmp_path):
    model, opt = build(seed=0)
    train(model, opt, 1, 0)
    save_checkpoint(f"{prefix}/ckpt", model=model, optimizer=opt)
    assert inspect_checkpoint(prefix)["optimizer"]["dp_size_written_at"] == 1
    consolidate(f"{prefix}/ckpt", tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert all(torch.equal(plain["model"][k], v) for k, v in model.state_dict().items())
    out = subprocess.run([sys.executable, "-m", "nxd_smp", "inspect", f"{prefix}/ckpt", "--verify"],
                         capture_output=True, text=True, cwd=ROOT, env=os.environ.copy())
    assert out.returncode == 0 and f"{prefix}/ckpt/v-" in out.stdout, out.stderr


def same(a, b) -> bool:
    """Whether two state dicts hold the same structure, values and tensors (bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_nxd_trainings_state_dicts_round_trip_on_s3_as_on_local_disk(server, prefix, tmp_path):
    """NxD Training's call shape (state dicts in, dicts to fill out) with an s3:// directory, against the same
    calls into a local directory (NxD's tag folders, tested against NxD's own files elsewhere)."""
    model, opt = build(seed=0)
    train(model, opt, 2, 0)
    for where in (prefix, tmp_path / "run"):
        for step in (1, 2):
            save_checkpoint(where, f"step_{step}", model=model.state_dict(), optimizer=opt.state_dict(),
                            user_content={"step": step}, num_kept_ckpts=1)
    assert {k.split("/")[1] for k in keys(server, prefix) if f"/{COMMITS}/" not in k} == {"step_2"}
    filled = []
    for where in (prefix, tmp_path / "run"):
        model_sd: dict = {}
        optimizer_sd: dict = {}
        assert load_checkpoint(where, "step_2", model=model_sd, optimizer=optimizer_sd) == {"step": 2}
        filled.append((model_sd, optimizer_sd))
    assert filled[0][0] and filled[0][1] and same(filled[0], filled[1])
    other, other_opt = build(seed=3)  # into live objects: the rank-local state dict through its own reader
    assert load_checkpoint(prefix, model=other, optimizer=other_opt) == {"step": 2}
    assert_same_params(params_of(other), params_of(model))
    for mine, theirs in zip(opt.master_shards, other_opt.master_shards):
        saved, loaded = opt.inner_optimizer.state[mine], other_opt.inner_optimizer.state[theirs]
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    # what the completion record does not list is not seen; a listed file of another size is refused
    (version,) = {k.rsplit("/", 2)[0] for k in keys(server, f"{prefix}/step_2") if "/optim/" in k}
    client = server.client()
    client.put_object(Bucket=BUCKET, Key=f"{version}/optim/dp_rank_01_tp_rank_00_pp_rank_00.pt", Body=b"planted")
    model_sd, optimizer_sd = {}, {}
    assert load_checkpoint(prefix, "step_2", model=model_sd, optimizer=optimizer_sd) == {"step": 2}
    assert same((model_sd, optimizer_sd), filled[0])
    client.put_object(Bucket=BUCKET, Key=f"{version}/user_content.pt", Body=b"short")
    with pytest.raises(CheckpointError, match="not of the size its completion record lists"):
        load_checkpoint(prefix, "step_2", model={}, optimizer={})
    remove_checkpoint(f"{prefix}/step_2")
    assert not has_checkpoint(prefix) and not keys(server, f"{prefix}/step_2")


def test_nxd_own_tag_folders_in_a_bucket_load_as_they_do_from_disk(server, prefix, tmp_path):
    """Folders NxD itself wrote to S3 (its tag layout under the prefix, ``done`` last; no commit record of
    nxd_smp's), plain and xser: loaded from the bucket as from the same folder on local disk."""
    from nxd_smp import Zero1Optimizer
    from nxd_smp.interop.torch_xla import export_xla
    from tests.crafted import trained_run, write_nxd_tag
    from tests.nxd_layout import HYPER, TAG, param_groups, scheduler_of
    from tests.xla_export_worker import make_model

    model, _, scheduler = trained_run(tmp_path)
    (one_rank,) = export_xla(tmp_path / "nxd_smp" / "ckpt", tmp_path / "xla_dp1", dp_size=1)
    optim_state = torch.load(one_rank, weights_only=True)
    client, key = server.client(), prefix.removeprefix(f"s3://{BUCKET}/")
    for layout in ("plain", "xser"):
        tag = write_nxd_tag(tmp_path / layout, dict(model.state_dict()), optim_state, scheduler.state_dict(),
                            xser=layout == "xser")
        for file in sorted((p for p in tag.rglob("*") if p.is_file()), key=lambda p: p.name == "done"):
            client.put_object(Bucket=BUCKET, Key=f"{key}/{layout}/{TAG}/{file.relative_to(tag)}",
                              Body=file.read_bytes())
        loaded = []
        for where in (tmp_path / layout, f"{prefix}/{layout}"):
            fresh = make_model()
            with torch.no_grad():
                for p in fresh.parameters():
                    p.mul_(-1)
            opt = Zero1Optimizer(param_groups(fresh), torch.optim.AdamW, compile_update=False, bucket_cap_mb=0.0002,
                                 **HYPER)
            fresh_scheduler = scheduler_of(opt)
            content = load_checkpoint(where, model=fresh, optimizer=opt, scheduler=fresh_scheduler)
            state = [{k: v.clone() for k, v in opt.inner_optimizer.state[m].items()} for m in opt.master_shards]
            loaded.append((content, params_of(fresh), state, fresh_scheduler.last_epoch))
        assert loaded[0][0] == loaded[1][0] == {"step": 2} and loaded[0][3] == loaded[1][3]
        assert_same_params(loaded[0][1], loaded[1][1])
        assert same(loaded[0][2], loaded[1][2])
        assert has_checkpoint(f"{prefix}/{layout}") and has_checkpoint(f"{prefix}/{layout}/{TAG}")
    client.put_object(Bucket=BUCKET, Key=f"{key}/cut/{TAG}/model/dp_rank_00_tp_rank_00_pp_rank_00.pt", Body=b"x")
    assert not has_checkpoint(f"{prefix}/cut")  # (no done: NxD's save was cut off)


# ---------------------------------------------------------------------------- the commit
def test_retention_keeps_the_newest_and_removes_the_others_data(server, prefix):
    model, opt = build(seed=0)
    for step in range(1, 5):
        train(model, opt, 1, step)
        save_checkpoint(prefix, f"step_{step}", model, opt, user_content={"step": step}, num_kept_ckpts=2)
    save_checkpoint(prefix, "step_4", model, opt, user_content={"step": 44}, num_kept_ckpts=2)  # the same tag again
    names = {k.split("/")[1] for k in keys(server, prefix) if f"/{COMMITS}/" not in k}
    assert names == {"step_3", "step_4"}
    assert len(commits(server, prefix)) == 2
    assert len({k.split("/")[2] for k in keys(server, f"{prefix}/step_4")}) == 1  # the replaced version is gone
    other, other_opt = build(seed=3)
    assert load_checkpoint(prefix, model=other, optimizer=other_opt) == {"step": 44}
    assert load_checkpoint(prefix, "step_3", model=other, optimizer=other_opt) == {"step": 3}
    remove_checkpoint(f"{prefix}/step_3")
    assert not keys(server, f"{prefix}/step_3") and len(commits(server, prefix)) == 1
    with pytest.raises(FileNotFoundError):
        load_checkpoint(prefix, "step_3", model=other, optimizer=other_opt)


def test_two_jobs_racing_for_one_commit_one_wins_the_other_is_refused(server, prefix):
    """Job A begins a save; job B begins after it and commits first: both took the same commit record, so
    A's commit is refused and its version removed; B's checkpoint is the one a load finds."""
    model, opt = build(seed=0)
    train(model, opt, 1, 0)
    store = open_store(S3Path.parse(prefix))
    begun = store.begin("ckpt")
    version = store.open_version(begun)
    version.write_bytes("__0_0.bin", b"job A's bytes")
    save_checkpoint(f"{prefix}/ckpt", model=model, optimizer=opt, extra={"job": "B"})
    with pytest.raises(CheckpointError, match="another job committed"):
        store.publish("ckpt", begun, version, b"{}")
    assert not keys(server, f"{prefix}/{begun[0]}")
    other, other_opt = build(seed=3)
    assert load_checkpoint(f"{prefix}/ckpt", model=other, optimizer=other_opt) == {"job": "B"}
    assert len(commits(server, prefix)) == 1


def test_sibling_checkpoints_saved_at_once_both_commit(server, prefix):
    """Saves of other names into one root (tensor-parallel coordinates' siblings) take the same commit record
    when they begin together: the one that finds it taken by another name commits at the next."""
    model, opt = build(seed=0)
    store = open_store(S3Path.parse(prefix))
    begun = store.begin("tp1")
    version = store.open_version(begun)
    save_checkpoint(f"{prefix}/tp0", model=model, optimizer=opt, extra={"tp": 0})
    store.publish("tp1", begun, version, b"{}")
    names = [store._manifest(int(c[:16])).name for c in commits(server, prefix)]
    assert names == ["tp0", "tp1"]
    other, other_opt = build(seed=3)
    assert load_checkpoint(f"{prefix}/tp0", model=other, optimizer=other_opt) == {"tp": 0}


def test_a_save_that_passes_another_names_record_still_meets_its_own_names(server, prefix):
    """Job A begins a save of x; a sibling name takes A's record; job B begins later and commits x at the next.
    A, moving past the sibling's record, finds B's record of x: refused, not committed over it."""
    model, opt = build(seed=0)
    store = open_store(S3Path.parse(prefix))
    begun = store.begin("x")
    version = store.open_version(begun)
    save_checkpoint(f"{prefix}/c", model=model, optimizer=opt, extra={"name": "c"})
    save_checkpoint(f"{prefix}/x", model=model, optimizer=opt, extra={"job": "B"})
    with pytest.raises(CheckpointError, match="another job committed"):
        store.publish("x", begun, version, b"{}")
    other, other_opt = build(seed=3)
    assert load_checkpoint(f"{prefix}/x", model=other, optimizer=other_opt) == {"job": "B"}


def test_a_prefix_with_nothing_committed_has_no_checkpoint(server, prefix):
    """A run's prefix holding other objects, or only a first save killed before its commit: has_checkpoint is
    False (a resume starts afresh), not an error."""
    key = prefix.removeprefix(f"s3://{BUCKET}/")
    client = server.client()
    client.put_object(Bucket=BUCKET, Key=f"{key}/config.yaml", Body=b"lr: 1")
    client.put_object(Bucket=BUCKET, Key=f"{key}/step_1/v-{1:016d}-abcdefabcdef/__0_0.bin", Body=b"x")
    assert not has_checkpoint(prefix) and not has_checkpoint(f"{prefix}/step_1")
    model, opt = build(seed=0)
    with pytest.raises(CheckpointError, match="cut off before their commit"):
        load_checkpoint(f"{prefix}/step_1", model=model, optimizer=opt)


def test_a_retried_commit_that_meets_its_own_first_write_succeeds(server, prefix):
    """botocore resends a PUT whose answer was lost; the resend meets the condition its first write set."""
    store = open_store(S3Path.parse(prefix))
    begun = store.begin("ckpt")
    version = store.open_version(begun)
    manifest = object_store.Manifest(begun[1], "ckpt", begun[0].split("/")[1], begun[2], (2, 0))
    store._commit(manifest)
    store._commit(manifest)  # the resend: 412, then recognised by its save id
    assert commits(server, prefix) == [f"{begun[1]:016d}.json"]
    assert version is not None


def test_without_conditional_writes_the_single_writer_protocol_commits_and_still_refuses_a_taken_record(
        server, prefix, monkeypatch):
    endpoint = (object_io.s3_client().meta.endpoint_url, BUCKET)
    monkeypatch.setitem(object_store._conditional_writes, endpoint, False)
    model, opt = build(seed=0)
    store = open_store(S3Path.parse(prefix))
    begun = store.begin("ckpt")
    save_checkpoint(f"{prefix}/ckpt", model=model, optimizer=opt, extra={"job": "B"})
    with pytest.raises(CheckpointError, match="another job committed"):
        store.publish("ckpt", begun, store.open_version(begun), b"{}")
    other, other_opt = build(seed=3)
    assert load_checkpoint(f"{prefix}/ckpt", model=other, optimizer=other_opt) == {"job": "B"}


def test_a_manifest_or_completion_record_altered_after_the_save_is_refused(server, prefix):
    model, opt = build(seed=0)
    save_checkpoint(f"{prefix}/ckpt", model=model, optimizer=opt)
    client = server.client()
    complete = next(k for k in keys(server, f"{prefix}/ckpt") if k.endswith("COMPLETE.json"))
    body = client.get_object(Bucket=BUCKET, Key=complete)["Body"].read()
    client.put_object(Bucket=BUCKET, Key=complete, Body=body.replace(b'"files"', b'"files" '))
    other, other_opt = build(seed=3)
    with pytest.raises(CheckpointError, match="not the file its commit record names"):
        load_checkpoint(f"{prefix}/ckpt", model=other, optimizer=other_opt)
    (commit,) = commits(server, prefix)
    key = f"{prefix.removeprefix(f's3://{BUCKET}/')}/{COMMITS}/{commit}"
    client.put_object(Bucket=BUCKET, Key=key, Body=b'{"format": "nxd_smp.commit/1", "name": "../x"}')
    with pytest.raises(CheckpointError, match="not a commit record nxd_smp writes"):
        load_checkpoint(f"{prefix}/ckpt", model=other, optimizer=other_opt)
    with pytest.raises(CheckpointError, match="not a commit record nxd_smp writes"):  # (not False: a resume
        has_checkpoint(prefix)                                                      # would start over)


def test_a_save_that_fails_on_a_rank_removes_its_version_and_keeps_the_previous(server, prefix, monkeypatch):
    model, opt = build(seed=0)
    save_checkpoint(f"{prefix}/ckpt", model=model, optimizer=opt, extra={"which": "first"})
    before = keys(server, f"{prefix}/ckpt")
    real_write = object_io.Upload.write

    def failing(self, data):  # (fault injection: the server refuses one file's bytes midway)
        if self._key.endswith("__0_1.bin"):
            raise CheckpointError("injected: the upload was refused")
        return real_write(self, data)

    monkeypatch.setattr(object_io.Upload, "write", failing)
    with pytest.raises(CheckpointError, match="injected"):
        save_checkpoint(f"{prefix}/ckpt", model=model, optimizer=opt, extra={"which": "second"})
    monkeypatch.undo()
    assert keys(server, f"{prefix}/ckpt") == before and not server.uploads(BUCKET, f"{prefix[len('s3://ckpt/'):]}/")
    other, other_opt = build(seed=3)
    assert load_checkpoint(f"{prefix}/ckpt", model=other, optimizer=other_opt) == {"which": "first"}


# ---------------------------------------------------------------------------- kills and outages
KILLED_SAVER = textwrap.dedent("""
    import sys, torch, torch.nn as nn
    import nxd_smp
    prefix = sys.argv[1]
    model = nn.Sequential(nn.Linear(8, 8))
    opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    nxd_smp.save_checkpoint(prefix, "small", model=model, optimizer=opt, user_content={"which": "small"})
    big = nn.Sequential(nn.Linear(4096, 2048), nn.Linear(2048, 4096))  # ~230 MB with AdamW's state: multipart
    big_opt = nxd_smp.Zero1Optimizer(big.parameters(), torch.optim.AdamW, lr=1e-3)
    print("small saved", flush=True)
    nxd_smp.save_checkpoint(prefix, "big", model=big, optimizer=big_opt, user_content={"which": "big"})
    print("big saved", flush=True)
""")


def test_a_save_killed_mid_upload_leaves_the_previous_checkpoint_and_no_partial_one(server, prefix, tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(KILLED_SAVER)
    child = subprocess.Popen([sys.executable, str(script), prefix], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env=os.environ.copy())
    assert child.stdout.readline().strip() == "small saved"
    big = prefix.removeprefix(f"s3://{BUCKET}/") + "/big/"
    deadline = time.monotonic() + 120
    while not server.uploads(BUCKET, big):  # a multipart upload of the big save is under way
        assert child.poll() is None and time.monotonic() < deadline, "the save ended before an upload was seen"
        time.sleep(0.02)
    child.kill()
    child.wait()
    # from outside: the small checkpoint is the only commit; the big one's parts are invisible
    assert len(commits(server, prefix)) == 1
    assert server.uploads(BUCKET, big)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    import nxd_smp

    opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    assert load_checkpoint(prefix, model=model, optimizer=opt) == {"which": "small"}
    assert has_checkpoint(prefix) and not has_checkpoint(f"{prefix}/big")
    with pytest.raises(CheckpointError, match="cut off before their commit") if keys(server, f"{prefix}/big") \
            else pytest.raises(FileNotFoundError):
        load_checkpoint(f"{prefix}/big", model=model, optimizer=opt)
    # saving the tag again works, aborts the killed save's uploads and removes what it left
    save_checkpoint(prefix, "big", model=model, optimizer=opt, user_content={"which": "again"})
    assert not server.uploads(BUCKET, big)
    assert len({k.split("/")[2] for k in keys(server, f"{prefix}/big")}) == 1
    assert load_checkpoint(prefix, model=model, optimizer=opt) == {"which": "again"}


def test_the_server_restarting_mid_save_is_retried_or_a_clear_error_never_half_a_version(server, prefix):
    model, opt = build(seed=0)
    save_checkpoint(prefix, "before", model=model, optimizer=opt, user_content={"which": "before"})
    big = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    import nxd_smp

    big_opt = nxd_smp.Zero1Optimizer(big.parameters(), torch.optim.AdamW, lr=1e-3)
    outcome = {}

    def save():
        try:
            save_checkpoint(prefix, "during", model=big, optimizer=big_opt, user_content={"which": "during"})
            outcome["saved"] = True
        except CheckpointError as e:
            outcome["error"] = str(e)

    saving = threading.Thread(target=save)
    saving.start()
    time.sleep(0.3)
    server.kill()
    time.sleep(2)
    server.start()
    saving.join(timeout=400)
    assert not saving.is_alive()
    listed = commits(server, prefix)
    fresh, fresh_opt = build(seed=3)
    if outcome.get("saved"):
        assert len(listed) == 2
        loaded = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
        loaded_opt = nxd_smp.Zero1Optimizer(loaded.parameters(), torch.optim.AdamW, lr=1e-3)
        assert load_checkpoint(prefix, model=loaded, optimizer=loaded_opt) == {"which": "during"}
        assert_same_params(params_of(loaded), params_of(big))
    else:
        assert "failed" in outcome["error"] and len(listed) == 1
        assert load_checkpoint(prefix, model=fresh, optimizer=fresh_opt) == {"which": "before"}


# ---------------------------------------------------------------------------- nodes without a shared disk
def torchrun(nnodes: int, nproc: int, mode: str, prefix: str, out: Path, scratch: Path, timeout: float = 180) -> None:
    """``torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d`` on localhost, one agent per "node", each
    in a scratch folder of its own (its working directory and TMPDIR): no disk is shared but the bucket."""
    port = quiet_port()  # (no other test's bind(0) takes it while the agents start)
    agents = []
    for node in range(nnodes):
        home = scratch / f"node{node}"
        home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(home), "OMP_NUM_THREADS": "1"}
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=s3-{mode}-{port}",
             f"--rdzv-conf=is_host={node == 0}",  # (node 0 serves the store: never a client of someone else's)
             str(ROOT / "tests" / "s3_nodes_worker.py"), mode, prefix, str(out)],
            cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline, outputs = time.monotonic() + timeout, []
    try:
        for agent in agents:
            try:
                outputs.append(agent.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for other in agents:
                    other.kill()
                told = "\n".join(other.communicate()[0] for other in agents)
                raise AssertionError(f"torchrun {mode} did not end within {timeout} s:\n{told[-6000:]}") from None
    finally:
        for agent in agents:
            agent.kill()
    assert all(agent.returncode == 0 for agent in agents), "\n".join(outputs)[-6000:]


def test_two_nodes_without_a_shared_disk_save_to_s3_and_resume_at_another_world_size(server, prefix, tmp_path):
    """Two "nodes" of two ranks (torchrun's c10d rendezvous on localhost) save to S3 in the background while
    training goes on; three ranks on one other node resume from it and match the run that was never cut."""
    torchrun(2, 2, "save", prefix, tmp_path / "uninterrupted.pt", tmp_path / "first")
    torchrun(1, 3, "resume", prefix, tmp_path / "resumed.pt", tmp_path / "second")
    uninterrupted = torch.load(tmp_path / "uninterrupted.pt", weights_only=True)
    assert_params_close(torch.load(tmp_path / "resumed.pt", weights_only=True), uninterrupted, max_ulp=2,
                        max_flip_fraction=0.05)
    files = {k.rsplit("/", 1)[-1] for k in keys(server, f"{prefix}/step_3")}
    assert {f"__{rank}_0.bin" for rank in range(4)} <= files  # (every rank of both nodes uploaded its part)
    for home in (tmp_path / "first").iterdir():
        assert not [p.name for p in home.iterdir() if p.name.startswith("s3")], "a URL became a local folder"


# ---------------------------------------------------------------------------- the doors
def test_an_s3_path_without_boto3_is_refused_with_the_install_line(monkeypatch, tmp_path):
    monkeypatch.setattr(object_io, "_client", None)
    monkeypatch.setitem(sys.modules, "boto3", None)
    model, opt = build(seed=0)
    with pytest.raises(ConfigError, match=re.escape("pip install 'nxd_smp[s3]'")):
        save_checkpoint("s3://bucket/run1", model=model, optimizer=opt)


@pytest.mark.parametrize("url, why", [
    ("s3://bucket", "names a bucket only"), ("s3://B_ad/x", "not an S3 bucket name"),
    ("s3://bucket/a/../b", "'..'"), ("s3://bucket/a//b", "''"), ("s3://bucket/x/.versions/y", "hide"),
])
def test_an_s3_url_that_names_no_prefix_of_plain_names_is_refused(url, why):
    model, opt = build(seed=0)
    with pytest.raises(ConfigError, match=re.escape(why)):
        save_checkpoint(url, model=model, optimizer=opt)


def test_saving_over_objects_that_are_not_a_checkpoint_is_refused(server, prefix):
    server.client().put_object(Bucket=BUCKET, Key=f"{prefix.removeprefix(f's3://{BUCKET}/')}/ckpt/notes.txt", Body=b"x")
    model, opt = build(seed=0)
    with pytest.raises(CheckpointError, match="not nxd_smp versions"):
        save_checkpoint(f"{prefix}/ckpt", model=model, optimizer=opt)
    with pytest.raises(CheckpointError, match="not an nxd_smp checkpoint"):
        remove_checkpoint(f"{prefix}/ckpt")
    assert keys(server, f"{prefix}/ckpt") == [f"{prefix.removeprefix(f's3://{BUCKET}/')}/ckpt/notes.txt"]
