"""The run folder's lock and writability check, with plain processes (no torch)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.train import run_folder

SRC = str(Path(run_folder.__file__).parents[2])


def test_second_claim_is_refused_naming_the_owner_and_a_dead_owner_is_taken_over(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from plait.train import run_folder as r; "
         f"r.claim({str(out)!r}); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(run_folder.RunFolderError) as e:
            run_folder.claim(out)
        assert f"--out {out} is in use by another plait train (pid {holder.pid} on " in str(e.value)
    finally:
        holder.communicate("")
    # the holder is gone: its lock file stays, naming a dead pid, and is taken over
    assert json.loads((out / "run.lock").read_text())["pid"] == holder.pid
    lock = run_folder.claim(out)
    assert json.loads((out / "run.lock").read_text())["pid"] == os.getpid()
    lock.release(remove_if_unused=True)  # the folder was not created by this claim: kept
    assert (out / "run.lock").exists()


def test_other_nodes_lock_their_own_file(tmp_path):
    a = run_folder.claim(tmp_path, node_rank=0)
    b = run_folder.claim(tmp_path, node_rank=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.lock", "run.node-1.lock"]
    a.release()
    b.release()


def test_a_refused_fresh_folder_is_removed(tmp_path):
    lock = run_folder.claim(tmp_path / "new")
    lock.release(remove_if_unused=True)
    assert not (tmp_path / "new").exists()


def _read_only_dir(tmp_path, tmpfs):
    """A folder this process cannot write: a read-only tmpfs as root (root ignores file
    modes), a mode-555 folder otherwise."""
    d = tmp_path / "ro"
    if os.geteuid() == 0:
        return tmpfs(d, size="64k", read_only=True)
    d.mkdir()
    d.chmod(0o555)
    return d


def test_unwritable_out_is_one_line(tmp_path, tmpfs):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = {
        a_file: "a file of that name is in the way",
        a_file / "run": "part of that path is a file",
        Path("/proc/plait-run"): "cannot create the folder",
    }
    for out, needle in cases.items():
        _refused_in_one_line(out, needle)
    ro = _read_only_dir(tmp_path, tmpfs)  # last: it may skip (no mounting in a container)
    _refused_in_one_line(ro, "is not writable")
    _refused_in_one_line(ro / "run", "cannot create the folder")


def _refused_in_one_line(out, needle):
    with pytest.raises(run_folder.RunFolderError) as e:
        run_folder.claim(out)
    assert str(e.value).startswith(f"--out {out}") and needle in str(e.value), e.value
    assert "\n" not in str(e.value)
