"""Checkpoint manifests, verification and fallback, in one process (no workers): every file
of a checkpoint damaged in turn is found, named in one line, and skipped for the one before."""

import errno
import os
import struct

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from plait.cli import main
from plait.model.config import preset
from plait.model.transformer import build_model
from plait.parallel.held import Held
from plait.topology import Topology
from plait.train import checkpoint, manifest

FILES = [".metadata", "__0_0.distcp", "meta.json", "rng-rank-0.pt", "manifest.json"]


def _model(seed):
    cfg = preset("tiny", n_layers=2, hidden=32, vocab_size=64, seq_len=8)
    model = build_model(cfg, seed=seed)
    state = checkpoint.model_state(model)  # + AdamW's state, as a stage-0 engine holds it
    for name, p in model.named_parameters():
        for key, t in (("step", torch.zeros(())), ("exp_avg", torch.full_like(p, seed)),
                       ("exp_avg_sq", torch.zeros_like(p))):  # fmt: skip
            state[f"optim/{name}/{key}"] = Held.whole(t)
    return model, state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of steps 1 and 2 (different weights), written once; tests copy them."""
    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    for step in (1, 2):
        model, state = _model(seed=step)
        checkpoint.save(root, step, state=state, meta={"m": step}, topo=Topology.single())
    return root


@pytest.fixture
def root(saved, tmp_path):
    import shutil

    shutil.copytree(saved, tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


def test_manifest_lists_every_file_and_is_written_last(saved):
    step = saved / "step-00000002"
    files = manifest.read(step)
    on_disk = sorted(p.name for p in step.iterdir() if p.name != manifest.NAME)
    assert sorted(files) == on_disk == sorted(f for f in FILES if f != manifest.NAME)
    for name, entry in files.items():
        assert entry["size"] == (step / name).stat().st_size
        assert entry["sha256"] == manifest.digest(step / name)
    assert not list(saved.glob("*.tmp")) and not list(step.glob(".manifest-rank-*"))
    assert checkpoint.verify(step) is None
    assert checkpoint.pick_resume(saved) == (step, f"resuming from step 2 ({step})")


def test_data_files_are_hashed_as_written_not_read_back(tmp_path, monkeypatch):
    """``save`` takes each DCP file's digest while writing it (``manifest._HashingStream``)
    and never reads the file back to hash it (at 175B a node's ranks would read ~130 GB
    back). The recorded digest must equal the file's read from disk, for a tensor large
    enough (3 MiB) that its write hashes on the helper thread. Catches a stream that drops
    or reorders bytes (a digest that differs), and a save that falls back to reading."""
    read_back = []
    plain = manifest.digest
    monkeypatch.setattr(manifest, "digest", lambda path: read_back.append(path.name) or plain(path))
    big = torch.arange(3 * 2**18, dtype=torch.float32)  # 3 MiB: one write of its storage
    state = {"big": Held.whole(big), "small": Held.whole(torch.ones(3))}
    step = checkpoint.save(tmp_path, 1, state=state, meta={}, topo=Topology.single())
    data = [n for n in os.listdir(step) if n.endswith(".distcp")]
    assert data and not [n for n in read_back if n.endswith(".distcp")], read_back
    files = manifest.read(step)
    for name in data:
        assert files[name]["sha256"] == plain(step / name)
        assert files[name]["size"] > big.numel() * 4


@pytest.mark.parametrize("name", FILES)
def test_truncated_file_is_named_and_skipped(root, name, capsys):
    (root / "step-00000002" / name).write_bytes(b"")
    problem = checkpoint.verify(root / "step-00000002")
    assert name in problem, problem
    path, note = checkpoint.pick_resume(root)
    assert path == root / "step-00000001"
    assert note.startswith("resuming from step 1") and f"skipped step-00000002: {name}" in note
    # the explicit pick refuses it in one line naming the file
    with pytest.raises(checkpoint.CheckpointError, match=f"--resume-from 2: .*{name}"):
        checkpoint.pick_resume(root, 2)
    # plait checkpoint verify: one line per checkpoint, exit 1
    assert main(["checkpoint", "verify", str(root.parent)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "step-00000001: ok" in lines[0], lines
    assert "step-00000002: damaged" in lines[1] and name in lines[1], lines


def test_flipped_bytes_refused_before_the_model_sees_them(root):
    # finite junk in the middle of the shard: without the manifest it loads and trains
    shard = root / "step-00000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096 * 4] = struct.pack("<f", 3.0) * 4096
    shard.write_bytes(data)
    assert checkpoint.verify(root / "step-00000002", hashes=False) is None  # same size
    problem = checkpoint.verify(root / "step-00000002")
    assert problem.startswith("__0_0.distcp does not match its sha256"), problem
    model, state = _model(seed=99)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(checkpoint.CheckpointError, match="step-00000002 is damaged: __0_0"):
        checkpoint.load(root / "step-00000002", state=state, topo=Topology.single())
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    path, note = checkpoint.pick_resume(root)
    assert path.name == "step-00000001" and "does not match its sha256" in note
    meta = checkpoint.load(path, state=state, topo=Topology.single())
    assert meta["m"] == 1 and meta["step"] == 1


def test_resume_errors_name_what_exists(root):
    with pytest.raises(
        checkpoint.CheckpointError, match=r"no checkpoint of step 7 .*steps there: 1, 2"
    ):
        checkpoint.pick_resume(root, 7)
    for step in ("step-00000001", "step-00000002"):
        (root / step / "rng-rank-0.pt").write_bytes(b"x")
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint in .* verifies"):
        checkpoint.pick_resume(root)
    with pytest.raises(checkpoint.CheckpointError, match="--resume: no checkpoint in"):
        checkpoint.pick_resume(root.parent / "nothing")


def test_verify_command_on_a_good_run_and_on_nothing(saved, tmp_path, capsys):
    assert main(["checkpoint", "verify", str(saved)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and all(": ok (4 files" in line for line in out), out
    assert main(["checkpoint", "verify", str(saved / "step-00000001")]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 1
    assert main(["checkpoint", "verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint there" in err[0]


def test_split_deals_files_by_size():
    files = {n: {"size": s, "sha256": ""} for n, s in [("a", 100), ("b", 60), ("c", 50), ("d", 1)]}
    parts = manifest.split(files, 2)
    assert parts == [["a", "d"], ["b", "c"]]
    assert sorted(sum(parts, [])) == sorted(files)
    assert manifest.split(files, 1) == [["a", "b", "c", "d"]]


def test_rng_round_trip_keeps_the_gpu_generator_without_a_gpu(monkeypatch):
    """A checkpoint's RNG file holds the GPU generator of a GPU rank beside the CPU one,
    and restores both (a resumed GPU run must not replay its dropout masks). The GPU's
    generator is stood in for here, on a CUDA-free machine."""
    gpu = torch.device("cuda", 3)
    fake = {"state": torch.arange(8, dtype=torch.uint8)}
    calls = []
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda d: (calls.append(("get", d)), fake["state"].clone())[1]
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda s, d: calls.append(("set", d, s.clone()))
    )
    torch.manual_seed(5)
    state = checkpoint.rng_state(gpu)
    assert set(state) == {"torch", "cuda"} and torch.equal(state["cuda"], fake["state"])
    expected = torch.rand(4)  # what the CPU generator draws next
    torch.rand(100)
    checkpoint.set_rng_state(state, gpu)
    assert torch.equal(torch.rand(4), expected)
    assert calls[0] == ("get", gpu) and calls[1][:2] == ("set", gpu)
    assert torch.equal(calls[1][2], fake["state"])
    # a CPU rank saves and restores the CPU generator only
    calls.clear()
    cpu_state = checkpoint.rng_state(torch.device("cpu"))
    assert set(cpu_state) == {"torch"}
    checkpoint.set_rng_state(state, torch.device("cpu"))
    assert calls == []


@pytest.mark.parametrize("runs_out_in", ["shard", "rng"])
def test_a_full_disk_is_one_line_and_keeps_the_previous(tmpfs, tmp_path, runs_out_in):
    """A save into a full file system raises one line naming the step that could not be
    written and the checkpoint that is intact, which still verifies and loads; nothing of
    the failed step is left. It runs out in DCP's shard (an OSError inside DCP's
    CheckpointException) or, after DCP, in torch.save's RNG file, whose zip writer may
    report a full disk as a RuntimeError ("unexpected pos") instead of the OSError
    underneath: the space left decides. Catches a full disk re-raised as it is (in
    particular torch.save's RuntimeError), a report naming the wrong step or checkpoint,
    and a half-written step left behind."""
    disk = tmpfs(tmp_path / "disk", size="2m")
    root = disk / "checkpoints"
    model, state = _model(seed=1)
    kw = dict(state=state, topo=Topology.single())
    checkpoint.save(root, 1, meta={"m": 1}, **kw)
    step1 = root / "step-00000001"
    page = os.statvfs(disk).f_frsize
    pages = {n: -(-(step1 / n).stat().st_size // page) for n in FILES}  # step 2's the same
    # "rng": room for step 2's DCP files and all but the last page of its RNG file
    dcp_and_rng = pages[".metadata"] + pages["__0_0.distcp"] + pages["rng-rank-0.pt"] - 1
    room = {"shard": 50_000, "rng": dcp_and_rng * page}[runs_out_in]
    st = os.statvfs(disk)
    (disk / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - room))
    with pytest.raises(checkpoint.CheckpointWriteError) as info:
        checkpoint.save(root, 2, meta={"m": 2}, **kw)
    report, inside_dcp = str(info.value), isinstance(info.value.__cause__, CheckpointException)
    del info  # its traceback holds the half-written file open
    assert inside_dcp == (runs_out_in == "shard")  # it ran out where this case means
    assert report == (
        f"checkpoint step 2 could not be written to {root}: no space left on device; "
        "step-00000001 is intact and --resume continues from it"
    )
    assert [p.name for p in root.iterdir()] == ["step-00000001"]
    assert checkpoint.verify(step1) is None
    assert checkpoint.load(step1, **kw)["m"] == 1


def test_a_full_disk_under_dcps_exception_is_named(tmp_path, monkeypatch):
    """DCP wraps every rank's failure in a CheckpointException (a BaseException): with
    torch.save's RuntimeError inside, the space left decides, as for a plain failure."""

    def failing_write(*a, **k):
        raise CheckpointException("save", {0: RuntimeError("unexpected pos 4096 vs 0")})

    monkeypatch.setattr(checkpoint, "_write", failing_write)
    kw = dict(state={}, meta={}, topo=Topology.single())
    monkeypatch.setattr(checkpoint, "_out_of_space", lambda root: None)
    with pytest.raises(CheckpointException):  # space left: not a full disk, re-raised
        checkpoint.save(tmp_path, 3, **kw)
    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(checkpoint, "_out_of_space", lambda root: enospc)
    with pytest.raises(checkpoint.CheckpointWriteError, match="step 3 .*no space left on device"):
        checkpoint.save(tmp_path, 3, **kw)
