"""``plait train`` end to end through the CLI: workers started by the torchrun engine."""

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import yaml
from numerics import assert_same_run

TINY = [
    "--model", "tiny", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32",
    "--global-batch-size", "8", "--lr", "3e-3", "--warmup", "2", "--eval-every", "0",
    "--eval-batches", "1", "--tokenizer", "bytes", "--threads", "1", "--no-progress",
]  # fmt: skip


def plait(*args, timeout=180, check=False):
    proc = subprocess.run(
        [sys.executable, "-m", "plait.cli", *map(str, args)],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"plait {' '.join(map(str, args))} failed:\n{proc.stderr}")
    return proc


@pytest.fixture
def started():
    """``started(*args)``: ``plait *args`` started and not waited for (``finished`` waits),
    so that commands that do not depend on each other run at once, each a process of its
    own as ``plait`` runs it; any still running when the test ends are killed."""
    procs = []

    def start(*args) -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-m", "plait.cli", *map(str, args)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
        return procs[-1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def finished(proc: subprocess.Popen, *, timeout=180, check=False) -> subprocess.CompletedProcess:
    """What ``plait`` returns, for a process of ``started``."""
    out, err = proc.communicate(timeout=timeout)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check and done.returncode != 0:
        raise AssertionError(f"plait {' '.join(map(str, proc.args[3:]))} failed:\n{err}")
    return done


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in records(run)]


def same_run(out: Path, ref: Path, what: str, steps: int | None = None) -> None:
    """Loss and gradient norm of every step (of the first ``steps``) as the reference
    run's, within the float32 bounds of ``numerics`` for the run's own model and batch."""
    from plait.train.config import RunConfig

    cfg = RunConfig.from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    tokens = cfg.layout.global_batch_size * cfg.model.seq_len
    got, want = records(out), records(ref)
    if steps is not None:
        got, want = got[:steps], want[:steps]
    assert_same_run(got, want, cfg.model, tokens, what)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / f).read_text() for f in ("argparse.py", "dataclasses.py", "enum.py"))
    (d / "code.txt").write_text(text)
    return d


@pytest.fixture(scope="module")
def base(corpus, tmp_path_factory):
    """One uninterrupted 20-step run that several tests compare against."""
    out = tmp_path_factory.mktemp("runs") / "base"
    plait("train", *TINY, "--data", corpus / "code.txt", "--cache-dir", corpus / "cache",
          "--steps", 20, "--save-every", 10, "--out", out, check=True)  # fmt: skip
    return out


def common(corpus):
    return [*TINY, "--data", corpus / "code.txt", "--cache-dir", corpus / "cache"]


def test_train_writes_run_folder_and_loss_falls(base):
    records = [json.loads(x) for x in (base / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    for key in ("loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s",
                "tflops_per_device", "mfu", "peak_mem_bytes"):  # fmt: skip
        assert key in records[0], key
    assert records[0]["tokens"] == 8 * 32
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert "val_loss" in records[-1]
    assert (base / "config.yaml").exists()
    assert sorted(p.name for p in (base / "checkpoints").iterdir()) == [
        "step-00000010",
        "step-00000020",
    ]


def test_generate_samples_from_checkpoint(base):
    proc = plait("generate", "--run", base, "--prompt", "def ", "--max-new-tokens", 20, check=True)
    assert proc.stdout.startswith("def ") and len(proc.stdout) > 10


def _flip_middle_of_shard(step: Path) -> None:
    """Finite junk in the middle of a shard (3.0 written 4,096 times): same size, loads."""
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4 * 4096] = struct.pack("<f", 3.0) * 4096
    shard.write_bytes(data)


def test_damaged_checkpoint_falls_back_and_a_second_run_is_refused(base, corpus, tmp_path):
    """The newest checkpoint's shard has bytes changed in its middle: --resume (under dp 2,
    where each rank hashes half the files and they agree) skips it in one line, resumes
    from the one before and continues the uninterrupted curve. Meanwhile a second run on
    the same folder is refused in one line naming the first, which finishes normally."""
    run = tmp_path / "resumed"
    shutil.copytree(base, run)
    _flip_middle_of_shard(run / "checkpoints" / "step-00000020")
    first = subprocess.Popen(
        [sys.executable, "-m", "plait.cli", "train", "--config", str(run / "config.yaml"),
         "--out", str(run), "--resume", "--dp", "2", "--micro-batch-size", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 60
        while time.time() < deadline and f'"pid": {first.pid}' not in _read(run / "run.lock"):
            time.sleep(0.05)
        second = plait("train", *common(corpus), "--steps", 5, "--out", run)
        _one_line_error(second, f"--out {run} is in use by another plait train (pid {first.pid} ")
        out, err = first.communicate(timeout=180)
    finally:
        first.kill()
    assert first.returncode == 0, err
    notes = [line for line in out.splitlines() if "resuming" in line]
    assert notes == [
        f"plait: resuming from step 10 ({run / 'checkpoints' / 'step-00000010'}); skipped "
        "step-00000020: __0_0.distcp does not match its sha256: its bytes changed after it "
        "was written"
    ], out
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    assert losses(run) == pytest.approx(losses(base), rel=1e-5)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.mark.parametrize("buckets", [[], ["--bucket-mb", "0.25"]], ids=["one-bucket", "buckets"])
def test_dp2_matches_single_process(base, corpus, tmp_path, buckets):
    """dp 2 reproduces the single-process curve, with the default bucket (the tiny model's
    gradients fit one) and with --bucket-mb small enough for several, overlapped."""
    out = tmp_path / "dp2"
    plait("train", *common(corpus), "--steps", 20, "--dp", 2, "--out", out, *buckets, check=True)
    same_run(out, base, "dp2")
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["layout"]["bucket_mb"] == (0.25 if buckets else 25.0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_match(base, corpus, tmp_path):
    out = tmp_path / "two-nodes"
    port = _free_port()
    args = [sys.executable, "-m", "plait.cli", "train", *map(str, common(corpus)),
            "--steps", "20", "--dp", "2", "--out", str(out), "--nnodes", "2",
            "--rdzv-endpoint", f"127.0.0.1:{port}"]  # fmt: skip
    nodes = [
        subprocess.Popen(
            [*args, "--node-rank", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in (0, 1)
    ]
    for node in nodes:
        _, err = node.communicate(timeout=180)
        assert node.returncode == 0, err
    same_run(out, base, "two nodes")


def _one_line_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--data", "/nonexistent/corpus.txt"], ["--data", "/nonexistent/corpus.txt"]),
        (["--hidden", "66"], ["--heads 4 does not divide --hidden 66"]),
        (
            ["--global-batch-size", "6", "--micro-batch-size", "4"],
            ["--global-batch-size 6 is not divisible"],
        ),  # fmt: skip
        (["--model", "gpt5"], ["--model 'gpt5' is not a preset"]),
        (["--tp", "3"], ["--tp 3 does not divide --heads 4"]),
        (["--resume", "--out", "/tmp/plait-no-such-run"], ["--resume: no checkpoint"]),
        (["--config", "/nonexistent.yaml"], ["--config /nonexistent.yaml"]),
        (["--bucket-mb", "0"], ["--bucket-mb must be positive"]),
        (["--profile", "3:2"], ["--profile 3:2", "A:B"]),
        (["--cp", "3"], ["--cp 3 needs --seq-len (32) divisible by 2 x --cp = 6"]),
        (["--cp", "8", "--cp-mode", "a2a"], ["--cp-mode a2a splits", "4 attention heads"]),
        (["--cp", "2", "--dropout", "0.1"], ["--dropout 0"]),
        (["--cp", "2", "--fault-tolerance", "1", "--dp", "2"], ["--fault-tolerance with --cp"]),
        (
            ["--cp", "2", "--dp", "2", "--dp-algo", "diloco", "--sync-every", "4"],
            ["--dp-algo diloco with --cp"],
        ),
    ],
)
def test_bad_input_one_line(extra, needles, tmp_path):
    proc = plait("train", *TINY, "--out", tmp_path / "run", *extra)
    _one_line_error(proc, *needles)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [(["--hidden", "66"], "--hidden"), (["--lora-rank", "0"], "--lora-rank"),
     (["--qat", "int4", "--quant-group-size", "1"], "--quant-group-size"),
     (["--steps", "0"], "--steps"), (["--tp", "3"], "--tp"),
     (["--data", "/nonexistent/corpus.txt"], "no such file"),
     (["--data", "a.txt:1,b.txt"], "has no weight"),
     (["--resume"], "no checkpoint in"), (["--resume-from", "3"], "no checkpoint of step 3"),
     (["--pp", "0"], "--pp must be at least 1"), (["--global-batch-size", "-4"],
     "--global-batch-size must be at least 1"), (["--nnodes", "0"], "--nnodes must be at least 1"),
     (["--dp", "2", "--nnodes", "2", "--node-rank", "5"], "numbered 0 to 1"),
     (["--grad-clip", "-1"], "--grad-clip must be >= 0"), (["--lr", "nan"], "--lr must be a"),
     (["--weight-decay", "-1"], "--weight-decay"), (["--eval-batches", "0"], "--eval-batches"),
     (["--peak-tflops", "-5"], "--peak-tflops"), (["--qat", "int4", "--quant-group-size", "0"],
     "--quant-group-size must be"), (["--tokenizer", "bytes", "--vocab-size", "10"],
     "--tokenizer bytes has 256 ids"),
     (["--recompute-layers", "1"], "use it with --recompute full"),
     (["--recompute", "full", "--recompute-layers", "0"], "--recompute-layers must be at least 1")],
)  # fmt: skip
def test_bad_flags_are_refused_before_torch_loads(extra, needle, tmp_path):
    """A mistyped flag, a --data path that is not there or a --resume with nothing to resume
    from is answered in the time it takes to read the flags (about half a second), not
    after loading torch (two seconds more). Catches a torch import creeping into the modules
    ``plait train`` reads before these checks: the flag values' classes (``LoRAConfig``,
    ``QuantConfig``, ...), --data's parser (``data/sources.py``) and the checkpoint folder's
    reader (``train/checkpoint_files.py``) live apart from the torch code for this. The
    later cases were tracebacks, a 56-line usage block, or runs that started with a
    negative learning-rate knob or ignored a flag; --recompute-layers without --recompute
    full would have recomputed nothing, silently."""
    code = (
        "import sys\nfrom plait.cli import main\n"
        f"rc = main(['train', '--out', {str(tmp_path / 'run')!r}, *{extra!r}])\n"
        "print(rc, 'torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.stdout.split() == ["2", "False"], (proc.stdout, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr, proc.stderr


def _in_process(args: list[str]) -> subprocess.CompletedProcess:
    code = f"import sys\nfrom plait.cli import main\nsys.exit(main({args!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    ("text", "needle"),
    [("layers: abc\n", "layers: expected an integer, got 'abc'"),
     ("layers: 2.5\n", "layers: expected an integer, got 2.5"),
     ("layers: true\n", "layers: expected an integer, got True"),
     ("hidden: {a: 1}\n", "hidden: expected an integer"),
     ("lr: fast\n", "lr: expected a number, got 'fast'"),
     ("dtype: fp8\n", "dtype: expected one of fp32, bf16, fp16"),
     ("no-progress: 3\n", "no_progress: expected true or false"),
     ("model: {n_layers: 2}\nlora: [1]\n", "lora: expected a mapping"),
     ("model: {n_layers: 2}\ntrain: [1, 2]\n", "train: expected a mapping")],
)  # fmt: skip
def test_a_config_files_values_are_checked_like_flags(text, needle, tmp_path):
    """A value of the wrong kind in a --config file is one line naming the file and the
    key, as the flag would have been (they were tracebacks from deep in the model's checks,
    or trained one layer for ``layers: true``)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    proc = _in_process(["train", "--config", str(cfg), "--dry-run"])
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert f"--config {cfg}: " in proc.stderr and needle in proc.stderr, proc.stderr


def test_a_config_files_list_serves_a_comma_separated_flag(tmp_path):
    """``pp-layout: [3, 1]`` in a --config file reads as ``--pp-layout 3,1`` (the type
    checks of the test above must not refuse it)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("pp: 2\nlayers: 4\npp-layout: [3, 1]\nglobal-batch-size: 8\n")
    proc = _in_process(["train", "--config", str(cfg), "--dry-run"])
    assert proc.returncode == 0, proc.stderr


def test_a_new_run_is_not_written_over_an_old_one(tmp_path):
    """``plait train --out DIR`` where DIR holds a run's metrics or checkpoints, without
    --resume, is one line and writes nothing: the new run wrote its metrics and
    checkpoints over the old ones, leaving a mix of both. An empty or new folder is fine."""
    out = tmp_path / "old"
    (out / "checkpoints" / "step-00000004").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    proc = _in_process(["train", *TINY, "--steps", "2", "--out", str(out)])
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"plait train: error: --out {out} already holds a run "
                                   "(checkpoints up to step-00000004); --resume continues it, "
                                   "or name a new --out"), proc.stderr  # fmt: skip
    after = sorted(p.relative_to(out) for p in out.rglob("*") if p.name != "run.lock")
    assert after == before


@pytest.mark.parametrize(
    "args",
    [["train", "--dtype", "fp8"], ["train", "--layers", "abc"], ["generate"],
     ["viz", "bogus"], ["checkpoint"], ["simulate", "--gpu", "nosuch"]],
)  # fmt: skip
def test_a_mistyped_flag_is_one_line_not_the_usage(args):
    """argparse's own errors (an unknown choice, a non-number, a missing argument) are one
    line naming the flag, with a pointer to --help: they printed the whole usage first (56
    lines for ``plait train``)."""
    proc = _in_process(args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"plait {args[0]}"), proc.stderr
    assert "error: " in lines[0] and lines[0].endswith("--help)"), proc.stderr


def test_empty_corpus_and_short_corpus(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(plait("train", *TINY, "--data", empty, "--cache-dir", tmp_path / "c"), "--data")
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n" * 10)
    _one_line_error(plait("train", *TINY, "--data", short, "--cache-dir", tmp_path / "c"), "--data")


def test_damaged_checkpoints_named_before_any_worker_starts(base, tmp_path):
    """Truncated or overwritten files change a file's size: the launcher finds it from the
    manifest before preparing data and says which file of which checkpoint, in one line."""
    run = tmp_path / "corrupt"
    shutil.copytree(base, run)
    (run / "checkpoints" / "step-00000020" / "__0_0.distcp").write_bytes(b"not a checkpoint")
    proc = plait("train", "--config", run / "config.yaml", "--out", run, "--resume-from", 20)
    _one_line_error(proc, "--resume-from 20: checkpoint step-00000020", "__0_0.distcp is 16 bytes")
    (run / "checkpoints" / "step-00000010" / ".metadata").write_bytes(b"")
    proc = plait("train", "--config", run / "config.yaml", "--out", run, "--resume")
    _one_line_error(proc, "no checkpoint in", "verifies", "step-00000010: .metadata is 0 bytes")
    assert "preparing data" not in proc.stdout


def test_unwritable_out_exits_2_before_data_preparation(corpus, tmp_path, capsys):
    from plait.cli import main

    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out, needle in [(a_file / "run", "part of that path is a file"),
                        ("/proc/plait-run", "cannot create the folder")]:  # fmt: skip
        code = main(["train", *map(str, common(corpus)), "--cache-dir", str(tmp_path / "cache"),
                     "--out", str(out)])  # fmt: skip
        captured = capsys.readouterr()
        assert code == 2
        lines = captured.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"plait train: error: --out {out}: "), lines
        assert needle in lines[0], lines[0]
        assert "preparing data" not in captured.out
    assert not (tmp_path / "cache").exists()  # no data was prepared


def test_disk_full_during_save_is_one_line_and_keeps_the_previous(base, tmp_path, tmpfs):
    """A save that runs out of space (dp 2) ends in one line naming the step and the
    checkpoint that is intact, which still verifies and loads."""
    disk = tmpfs(tmp_path / "disk", size="4m")
    run = disk / "run"
    shutil.copytree(base, run, ignore=shutil.ignore_patterns("step-00000020"))
    st = os.statvfs(disk)  # leave 200 kB: room for metrics and logs, not a checkpoint
    (disk / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 200_000))
    proc = plait("train", "--config", run / "config.yaml", "--out", run, "--resume",
                 "--dp", 2, "--micro-batch-size", 4, "--steps", 12, "--save-every", 2)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        f"plait train: error: checkpoint step 12 could not be written to {run / 'checkpoints'}"
        ": no space left on device; step-00000010 is intact and --resume continues from it"
    ), lines[0]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000010"]
    from plait.generate import load_model
    from plait.train import checkpoint

    assert checkpoint.verify(run / "checkpoints" / "step-00000010") is None
    _, path, _ = load_model(run)
    assert path.name == "step-00000010"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        found += kids
        todo += kids
    return found


def _start_long_run(corpus, out, *extra, dp=2, ready=None):
    """A run that would take hours, once ``ready(out)`` (default: two steps done)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait.cli", "train", *map(str, common(corpus)), "--dp", str(dp),
         "--micro-batch-size", str(8 // dp), "--steps", "100000", "--log-every", "1",
         "--out", str(out), *map(str, extra)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    ready = ready or (lambda out: _read(out / "metrics.jsonl").count("\n") >= 2)
    deadline = time.time() + 120
    while time.time() < deadline and not ready(out):
        time.sleep(0.05)
    workers = [p for p in _descendants(proc.pid) if "plait.train.worker" in _cmdline(p)]
    if not ready(out):
        proc.kill()
        raise AssertionError(f"the run did not start: {proc.communicate()[1]}")
    return proc, workers


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_killed_worker_one_message_no_orphans(corpus, tmp_path):
    proc, workers = _start_long_run(corpus, tmp_path / "killed")
    os.kill(workers[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "killed by SIGKILL" in lines[0], err
    assert _all_gone(workers)


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "plait" in _cmdline(pid)


def _all_gone(pids, timeout: float = 10.0) -> bool:
    """Whether every one of ``pids`` has exited within ``timeout`` seconds (a killed
    process leaves /proc a moment after its parent has reported it)."""
    deadline = time.time() + timeout
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


def test_hung_worker_is_named_and_killed_within_the_timeout(corpus, tmp_path):
    """A worker that stops (SIGSTOP: alive, silent) is found by its stale heartbeat: the run
    ends within the collective timeout plus a few seconds, naming that rank, and kills it."""
    proc, workers = _start_long_run(corpus, tmp_path / "hang", "--collective-timeout", "5")
    assert len(workers) == 2
    hung = workers[1]
    rank = int(dict(x.split("=", 1) for x in Path(f"/proc/{hung}/environ").read_text()
                    .split("\0") if "=" in x)["RANK"])  # fmt: skip
    t0 = time.time()
    os.kill(hung, signal.SIGSTOP)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    elapsed = time.time() - t0
    assert proc.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"plait train: error: rank {rank} stopped responding: no heartbeat "
                               "for 5."), lines[0]  # fmt: skip
    assert f"(--collective-timeout 5); killed it (pid {hung})" in lines[0], lines[0]
    assert elapsed < 15, elapsed
    assert not any(_alive(w) for w in workers)


@pytest.mark.parametrize(
    "sig, target, when",
    [
        ("SIGTERM", "launcher", "start"),
        ("SIGTERM", "launcher", "training"),
        ("SIGINT", "group", "training"),
    ],  # fmt: skip
    ids=["sigterm-before-first-step", "sigterm", "ctrl-c"],
)
def test_signals_end_with_one_line_and_the_conventional_code(corpus, tmp_path, sig, target, when):
    """SIGTERM to the launcher, or Ctrl-C (SIGINT to the whole process group): exit 143 or
    130, one line saying where the run was and which checkpoint is kept (a folder that
    exists), no torch warning on the terminal, no worker left behind."""
    out = tmp_path / "sig"
    if when == "start":  # as soon as the run holds its folder (data preparation, start-up)
        proc, workers = _start_long_run(
            corpus, out, dp=1, ready=lambda out: '"pid"' in _read(out / "run.lock")
        )
    else:  # once a checkpoint exists
        proc, workers = _start_long_run(
            corpus, out, "--save-every", 2, dp=1 if sig == "SIGTERM" else 2,
            ready=lambda out: any((out / "checkpoints").glob("step-0*[0-9]")),
        )  # fmt: skip
    signum = getattr(signal, sig)
    os.killpg(proc.pid, signum) if target == "group" else os.kill(proc.pid, signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    what = "interrupted" if sig == "SIGINT" else "terminated"
    assert lines[0].startswith(f"plait train: {what} ({sig}) "), lines[0]
    if when == "start":
        assert lines[0].endswith("; no checkpoint was written"), lines[0]
    else:
        kept = re.search(r"after step \d+; (\S+) is the newest checkpoint: --resume continues "
                         "from it$", lines[0])  # fmt: skip
        assert kept and Path(kept.group(1)).is_dir(), lines[0]
    assert _all_gone(workers)


def test_export_reads_and_writes_one_part_at_a_time(base, tmp_path, monkeypatch):
    """plait export streams: each read of the checkpoint asks for exactly one part (the
    embedding, one block, the rest: hf.export_groups) and each part becomes one file of
    Hugging Face's sharded safetensors. Catches an export that loads the whole model (one
    read of everything) or writes it as one file."""
    from plait import export
    from plait.generate import build_as_trained, locate
    from plait.model import hf
    from plait.train import checkpoint

    asked, real = [], checkpoint.load

    def load(path, *, state, **kw):
        asked.append(sorted(k.removeprefix("model/") for k in state))
        return real(path, state=state, **kw)

    monkeypatch.setattr(checkpoint, "load", load)
    out, _ = export.export(base, tmp_path / "hf", export.ExportOptions())
    names = [n for n, _ in build_as_trained(locate(base)[0], device="meta").named_parameters()]
    assert asked == [sorted(g) for g in hf.export_groups(names)]
    assert len(asked) >= 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(files) == len(asked)


def test_export_to_hugging_face_and_train_from_it(base, corpus, tmp_path, started):
    """A run's checkpoint goes out as a Hugging Face folder that transformers loads with
    the same logits, and comes back in with --init-hf under other layouts: the first step
    starts from the trained weights (its loss is the trained model's, well below a fresh
    start) and is the same for one process, tp 2 and dp 2 with ZeRO-3."""
    import torch
    import transformers

    from plait.generate import load_run

    out = tmp_path / "hf"
    proc = plait("export", "--run", base, "--out", out, check=True)
    assert "wrote" in proc.stdout and (out / "model.safetensors.index.json").exists()
    # the runs from the folder and the refusals depend on nothing but it: all at once, each
    # its own `plait` process (their first steps are compared once all have ended)
    layouts = {"one": [], "tp2": ["--tp", 2], "dp2z3": ["--dp", 2, "--zero", 3]}
    runs = {name: started("train", *common(corpus), "--steps", 2, "--init-hf", out,
                          "--out", tmp_path / name, *flags)
            for name, flags in layouts.items()}  # fmt: skip
    # a size flag that contradicts the folder is refused in one line
    bad = started("train", *common(corpus), "--init-hf", out, "--hidden", 128, "--heads", 4,
                  "--out", tmp_path / "bad")  # fmt: skip
    none = started("export", "--run", tmp_path / "none")
    _, _, model = load_run(base)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(
        0, model.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert (model(ids) - ref(ids).logits).abs().max().item() < 1e-5
    for proc in runs.values():
        finished(proc, check=True)
    for name in layouts:
        if name != "one":  # every layout starts from the same weights: the same first step
            same_run(tmp_path / name, tmp_path / "one", name, steps=1)
    assert losses(tmp_path / "one")[0] < losses(base)[0] - 0.5
    _one_line_error(finished(bad), "--hidden 128 disagrees with --init-hf")
    _one_line_error(finished(none), "no config.yaml")


def test_export_carries_the_bpe_tokenizer(corpus, tmp_path, started):
    """A BPE run's export holds its tokenizer: transformers' AutoTokenizer encodes as plait
    does, and the folder serves as --init-hf and --tokenizer of a fine-tuning run."""
    import transformers

    from plait.generate import load_run

    run, out = tmp_path / "bpe", tmp_path / "hf"
    plait("train", *common(corpus), "--tokenizer", "bpe", "--vocab-size", 300, "--steps", 2,
          "--out", run, check=True)  # fmt: skip
    proc = plait("export", "--run", run, "--out", out, check=True)
    assert "tokenizer.json" in proc.stdout
    again = tmp_path / "again"  # runs while this process compares the tokenizers
    proc = started("train", *common(corpus), "--init-hf", out, "--tokenizer", out, "--steps", 1,
                   "--out", again)  # fmt: skip
    _, tok, _ = load_run(run)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x + 1  # héllo"
    assert theirs(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert theirs.eos_token_id == tok.eot_id and len(theirs) == tok.vocab_size == 300
    finished(proc, check=True)
    assert yaml.safe_load((again / "config.yaml").read_text())["model"]["vocab_size"] == 300


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["generate", "--run", "/nonexistent", "--temperature", "nan"], "--temperature must be"),
     (["generate", "--run", "/nonexistent", "--max-new-tokens", "0"], "--max-new-tokens must"),
     (["generate", "--run", "/nonexistent", "--seed", "-1"], "--seed must be >= 0"),
     (["viz", "schedule", "--micro-batches", "0", "-o", "x.png"], "--micro-batches must be"),
     (["viz", "schedule", "--p2p", "nan", "-o", "x.png"], "--p2p must be a number"),
     (["plan", "--model", "tiny", "--global-batch-size", "16", "--gpus", "2", "--gpu", "cpu",
       "--top", "0"], "--top must be at least 1"),
     (["plan", "--model", "tiny", "--global-batch-size", "16", "--gpus", "8", "--gpu", "cpu",
       "--tp", "3"], "--tp 3 does not divide --heads 4"),
     (["simulate", "--runs", "BINARY"], "not a CSV text file"),
     (["report", "RUN", "--out", "RUN/config.yaml"], "the report is an HTML page"),
     (["report", "BADRUN"], "config.yaml: not readable YAML")],
)  # fmt: skip
def test_other_commands_bad_input_one_line(args, needle, tmp_path):
    """Bad input to the other commands is one line naming the flag or file. Were: a
    traceback (NaN temperature, an undecodable CSV, a run whose config.yaml is damaged), a
    silent run (no tokens, a negative seed, 0 taken as "the default" by plan), a message
    naming another flag (plan blamed --gpus for an impossible --tp), or lost data (a
    report written over the run's config.yaml)."""
    run, bad = tmp_path / "run", tmp_path / "badrun"
    for folder, config in ((run, "out: x\n"), (bad, "a: [1\n")):
        folder.mkdir()
        (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
        (folder / "config.yaml").write_text(config)
    (tmp_path / "b.csv").write_bytes(bytes(range(128, 256)))
    swap = {"RUN": str(run), "BADRUN": str(bad), "BINARY": str(tmp_path / "b.csv")}
    args = [swap.get(a, a.replace("RUN", str(run))) for a in args]
    proc = _in_process(args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert (run / "config.yaml").read_text() == "out: x\n"
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_node_waiting_for_node_0_stops_on_sigterm(tmp_path):
    """A node other than 0 started before (or without) node 0 waits for its rendezvous,
    and SIGTERM stops it: exit 143 and one line. torchrun's store client retried inside
    C++ through the signal, and the node could only be killed for its 900 s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and nothing listens on it
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait.cli", "train", *TINY, "--dp", "2", "--nnodes", "2",
         "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--out", str(tmp_path / "n1")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 60
        lock = tmp_path / "n1" / "run.node-1.lock"  # node 1's own lock (run_folder.lock_name)
        while time.time() < deadline and '"pid"' not in _read(lock):
            time.sleep(0.1)
        assert '"pid"' in _read(lock), "node 1 never took its run folder's lock"
        time.sleep(3)  # past data preparation, into the wait
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert len(err.strip().splitlines()) == 1 and "terminated (SIGTERM)" in err, err
