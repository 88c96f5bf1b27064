"""The control plane against a stranger (docs/security.md): who can reach the stores, what a
forged message does (nothing, and it is logged), what a crafted checkpoint does (nothing:
refused in one line before DCP unpickles its ``.metadata``), and what a link planted in a
run folder does (refused, its target untouched).

Fast tests run in this process on real stores; two real runs (one through torchrun, one
under ``--fault-tolerance``) are attacked while they train. The attacks that need another
address come from a network namespace (root only; the test says so when it cannot make one).
"""

import datetime
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from netns import Machine
from torch.distributed import TCPStore

from plait import signed_store
from plait.cli import main
from plait.errors import printable
from plait.model.config import preset
from plait.resilience import async_checkpoint, nodes, protocol
from plait.signed_store import SignedStore
from plait.topology import Topology
from plait.train import checkpoint, liveness, manifest, run_folder
from plait.train.launch import _kill, children_by_rank

SECRET = bytes(range(32))
WRONG = bytes(range(1, 33))


class Payload:
    """A pickle that, loaded, creates the folder ``marker``: the proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


class _Raw:
    """A stranger's plain store client whose ``set`` has reached the server when it
    returns (a TCPStore ``set`` does not wait for the server; a read on the same
    connection after it does)."""

    def __init__(self, port: int):
        self.store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=10))  # fmt: skip

    def set(self, key, value) -> None:
        self.store.set(key, value)
        self.store.check([key])

    def __getattr__(self, name):
        return getattr(self.store, name)


def _raw(port: int) -> _Raw:
    return _Raw(port)


# -- the signed store ------------------------------------------------------------------


def test_signed_store_refuses_unsigned_wrongly_signed_moved_and_replayed_values():
    """Breaks if a value without the run's HMAC is accepted, if a signed value can be moved
    to another key or written back after a newer one, or if refusals are not reported."""
    refused = []
    server = liveness.host(secret=SECRET, on_reject=lambda *a: refused.append(a[:2]))
    stranger = _raw(server.port)
    peer = liveness.connect(f"127.0.0.1:{server.port}", secret=SECRET)
    peer.set("ft/hold", "3 7")
    assert server.get("ft/hold") == b"3 7" and server.check(["ft/hold"])
    old = stranger.get("ft/hold")
    peer.set("ft/hold", "3 0")
    assert server.get("ft/hold") == b"3 0"
    stranger.set("ft/hold", old)  # replay of an older, genuinely signed value
    assert server.get("ft/hold") is None
    stranger.set("ft/request", old)  # a signed value moved to another key
    assert server.get("ft/request") is None
    stranger.set("ft/gen", "99")  # unsigned
    SignedStore(stranger, WRONG).set("liveness/status/0", '{"code": 2}')  # another secret
    assert server.get("ft/gen") is None and not server.check(["liveness/status/0"])
    assert server.get("absent/key") is None  # absent: None at once, never a wait
    assert refused == [("ft/hold", "replayed"), ("ft/request", "wrongly signed"),
                       ("ft/gen", "unsigned"), ("liveness/status/0", "wrongly signed")]  # fmt: skip


def test_the_run_secret_file_is_private_and_never_read_or_written_through_a_link(tmp_path):
    """Breaks if ``.run-secret`` (the other nodes' copy of the secret) is readable by others,
    written through a planted link, or read from one."""
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (tmp_path / signed_store.SECRET_FILE).symlink_to(target)
    with pytest.raises(signed_store.SecretError):
        signed_store.read_secret(tmp_path)
    path = signed_store.write_secret(tmp_path, SECRET)
    assert target.read_text() == "keep me\n" and not path.is_symlink()
    assert path.stat().st_mode & 0o777 == 0o600
    assert signed_store.read_secret(tmp_path) == SECRET


def test_text_from_outside_is_printed_with_control_characters_escaped(capsys):
    """Breaks if a worker's, store's or file's text reaches the terminal with escapes."""
    from plait.commands.common import die

    assert printable("a\x1b[2Jb\r\x07\x9b\tc") == "a\\x1b[2Jb\\x0d\\x07\\x9b\tc"
    die("train", "rank 0: \x1b]0;pwned\x07 failed\nsecond line")
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and err.count("\n") == 1, err


# -- who can reach the stores ----------------------------------------------------------


def _listening(pids) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket of the processes ``pids`` (/proc)."""
    inodes = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                addr, port = f[1].split(":")
                raw = bytes.fromhex(addr)
                if table == "tcp":
                    ip = socket.inet_ntoa(raw[::-1])
                else:
                    ip = socket.inet_ntop(socket.AF_INET6,
                                          b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))  # fmt: skip
                found.append((ip, int(port, 16)))
    return found


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [int(c) for c in children(p)]
    return out


def children(pid: int) -> list[str]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += (task / "children").read_text().split()
        except OSError:
            pass
    return kids


def test_stores_listen_on_their_one_address():
    """Breaks if a store binds every interface (a TCPStore does by itself): the liveness
    store on loopback, and one on another address is not reachable at 127.0.0.1."""
    store = liveness.host(secret=SECRET)
    assert ("127.0.0.1", store.port) in _listening([os.getpid()])
    assert ("0.0.0.0", store.port) not in _listening([os.getpid()])
    other = liveness.host(bind="127.0.0.2", secret=SECRET)  # another address of this machine
    assert ("127.0.0.2", other.port) in _listening([os.getpid()])
    # not at 127.0.0.1 nor on every interface: this process's sockets (a connection
    # attempt could reach another process that happens to hold that port on loopback)
    mine = _listening([os.getpid()])
    assert ("127.0.0.1", other.port) not in mine and ("0.0.0.0", other.port) not in mine
    from plait.train.launch import host_rendezvous, torchrun_args

    liveness.check_shared("127.0.0.1")  # an address, as given: the user's choice
    with pytest.raises(ValueError, match="loopback address no other node reaches"):
        liveness.check_shared("localhost")  # a name node 0 resolves to loopback
    rdzv = host_rendezvous(1, None)  # torchrun's, shared: nothing binds a port of its own
    assert ("127.0.0.1", rdzv.port) in _listening([os.getpid()])
    argv = torchrun_args(world=2, nnodes=1, node_rank=0, rdzv_endpoint=None, config=Path("c"),
                         rdzv_port=rdzv.port)  # fmt: skip
    assert argv[argv.index("--master-addr") + 1] == "127.0.0.1" and "--standalone" not in argv
    assert argv[argv.index("--master-port") + 1] == str(rdzv.port)


def test_the_launcher_signals_only_its_own_child_of_the_silent_rank():
    """Breaks if a silent rank's kill goes to the pid in the store (here a stranger's
    process) instead of the launcher's own child of that rank."""
    victim = subprocess.Popen(["sleep", "100"])  # outside the run: named in the store
    child = subprocess.Popen(["sleep", "100"], env={**os.environ, "RANK": "5"})
    try:
        assert children_by_rank().get(5) == child.pid
        _kill(liveness.Silence(rank=5, pid=victim.pid, silent_s=9.0))
        assert child.wait(10) == -signal.SIGKILL
        assert victim.poll() is None
        _kill(liveness.Silence(rank=6, pid=victim.pid, silent_s=9.0))  # no child of rank 6
        time.sleep(0.2)
        assert victim.poll() is None
    finally:
        for p in (victim, child):
            p.kill()
            p.wait()


# -- forged protocol messages, in this process -------------------------------------------


def test_workers_wait_through_a_forged_decision_and_take_the_signed_one():
    """Breaks if a worker acts on an unsigned or wrongly signed ``ft/gen`` / decision (a
    stranger's "stop" would end the run)."""
    server = liveness.host(secret=SECRET)
    worker = liveness.connect(f"127.0.0.1:{server.port}", secret=SECRET)
    stranger = _raw(server.port)
    stranger.set(protocol.GEN, "5")
    stranger.set(protocol.DECISION.format(5), json.dumps({"gen": 5, "stop": "pwned"}))
    SignedStore(stranger, WRONG).set(protocol.REQUEST, "9")
    assert protocol.requested(worker) == 0
    with pytest.raises(TimeoutError):
        protocol.wait_decision(worker, after=-1, timeout=0.3)
    protocol.publish(server, {"gen": 0, "start": "fresh"})
    SignedStore(stranger, WRONG).set(
        protocol.DECISION.format(0), json.dumps({"gen": 0, "stop": "x"})
    )
    with pytest.raises(TimeoutError):  # the signed decision was overwritten: nothing to act on
        protocol.wait_decision(worker, after=-1, timeout=0.3)
    protocol.publish(server, {"gen": 1, "start": "fresh"})
    assert protocol.wait_decision(worker, after=-1, timeout=5) == {"gen": 1, "start": "fresh"}
    assert set(worker.rejected) == {protocol.GEN, protocol.REQUEST, protocol.DECISION.format(0)}


def test_a_node_agent_starts_and_signals_only_on_signed_messages(tmp_path, monkeypatch):
    """Breaks if a forged ``ft/node/N/spawn`` starts a process, a forged ``ft/signal/W``
    signals one, a signal other than the coordinator's four is delivered, or a signal goes
    anywhere but to the process the agent started itself."""
    started = []

    def command(**kw):
        started.append(kw["worker"])
        return ["sleep", "100"], {**os.environ}

    monkeypatch.setattr(nodes, "worker_command", command)
    server = liveness.host(secret=SECRET)
    agent_store = liveness.connect(f"127.0.0.1:{server.port}", secret=SECRET)
    stranger = _raw(server.port)
    victim = subprocess.Popen(["sleep", "100"])
    lines = []
    agent = threading.Thread(target=nodes.serve, kwargs=dict(
        store=agent_store, config=tmp_path / "c.yaml", address="x", node=1, world=2,
        log=lines.append), daemon=True)  # fmt: skip
    agent.start()
    try:
        stranger.set(nodes.SPAWN.format(1), "7:0,")
        SignedStore(stranger, WRONG).set(nodes.SPAWN.format(1), "8:0")
        time.sleep(0.5)
        assert started == []
        coordinator = nodes.Remote(server, 3)
        server.set(nodes.SPAWN.format(1), "3:0")
        deadline = time.time() + 10
        while not lines and time.time() < deadline:
            time.sleep(0.05)
        assert started == [3], lines
        pid = int(lines[0].split("pid ")[1].rstrip(")"))
        stranger.set(nodes.SIGNALS.format(3), f"{signal.SIGKILL},")
        SignedStore(stranger, WRONG).set(nodes.SIGNALS.format(3), f"{signal.SIGKILL}")
        coordinator.signal(signal.SIGUSR1)  # signed, but not one the coordinator sends
        time.sleep(0.5)
        assert coordinator.poll() is None and victim.poll() is None
        coordinator.signal(signal.SIGKILL)
        while coordinator.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert coordinator.poll() == -signal.SIGKILL  # reported by the agent, signed
        assert victim.poll() is None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        server.set(nodes.STOP, "1")
        agent.join(10)
        assert not agent.is_alive()
    finally:
        victim.kill()
        victim.wait()


# -- asynchronous checkpoint posts -------------------------------------------------------


def _small_state(seed: int) -> dict:
    from plait.parallel.held import Held

    g = torch.Generator().manual_seed(seed)
    return {"model/w": Held.whole(torch.randn(4, 6, generator=g)),
            "optim/w/step": Held.whole(torch.tensor(float(seed)))}  # fmt: skip


def test_async_checkpoint_posts_are_json_and_a_planted_pickle_never_runs(tmp_path):
    """Breaks if the committer unpickles (or uses) a post it finds on the store, and if the
    JSON posts do not rebuild DCP's .metadata: the checkpoint written from them loads back
    to the same tensors."""
    marker = tmp_path / "payload-ran"
    server = liveness.host(secret=SECRET)
    stranger = _raw(server.port)
    root = tmp_path / "checkpoints"
    # world 2, but rank 1's post is a stranger's pickle (unsigned, then signed with another
    # secret): rank 0 waits, never loads it, and gives up on the checkpoint
    for store in (stranger, SignedStore(stranger, WRONG)):
        store.set(async_checkpoint.POST.format(0, 4, 1), pickle.dumps(Payload(marker)))
        saver = async_checkpoint.AsyncSaver(store=server, generation=0, rank=0, world=2, root=root,
                                            keep=2, timeout=1.0)  # fmt: skip
        saver.save(4, _small_state(1), {"m": 1})
        saver.wait()
        assert isinstance(saver.error, TimeoutError) and not marker.exists()
    assert set(server.rejected) == {async_checkpoint.POST.format(0, 4, 1)}
    # even signed, a post that is not the JSON of post_of is not used
    assert async_checkpoint.plan_of(pickle.dumps(Payload(marker)), rank=1) is None
    assert not marker.exists() and checkpoint.latest(root) is None
    # the real thing, world 1: written, committed, and loaded back
    saver = async_checkpoint.AsyncSaver(store=server, generation=0, rank=0, world=1, root=root,
                                        keep=2, timeout=10.0)  # fmt: skip
    saver.save(8, _small_state(2), {"m": 2})
    saver.wait()
    assert saver.error is None and saver.committed == [8]
    path = checkpoint.latest(root)
    assert checkpoint.verify(path) is None
    back = _small_state(3)
    checkpoint.load(path, state=back, topo=Topology.single())
    for key, held in _small_state(2).items():
        torch.testing.assert_close(back[key].flat, held.flat, rtol=0, atol=0)
    assert not server.raw.check([async_checkpoint.POST.format(0, 8, 0)])  # posts removed


# -- crafted checkpoints ---------------------------------------------------------------


@pytest.fixture
def crafted(tmp_path):
    """A run folder whose checkpoint's .metadata is a pickle that would create
    ``payload-ran`` and whose manifest lists its new digest (the manifest recomputed, as
    anyone can); and a copy of the genuine, signed one."""
    from plait.data import DataConfig
    from plait.layout import Layout
    from plait.train.config import RunConfig, TrainConfig
    from plait.train.loop import Trainer

    run = tmp_path / "run"
    cfg = RunConfig(
        model=preset("tiny", n_layers=1, hidden=32, n_heads=2, seq_len=16, vocab_size=256),
        layout=Layout(global_batch_size=2, micro_batch_size=1),
        data=DataConfig(tokenizer="bytes", cache_dir=str(tmp_path / "cache")),
        train=TrainConfig(steps=1, warmup=0, eval_every=0, eval_batches=1, progress=False),
        out=str(run),
    )
    run.mkdir()
    trainer = Trainer(cfg, topo=Topology.single())
    trainer.step(0)
    cfg.save(run / "config.yaml")
    trainer.save(1)
    genuine = tmp_path / "genuine"
    shutil.copytree(run, genuine)
    step = run / "checkpoints" / "step-00000001"
    marker = tmp_path / "payload-ran"
    (step / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    files = manifest.read(step)
    files[".metadata"] = manifest.entries(step, [".metadata"])[".metadata"]
    data = {"format": manifest.FORMAT, "hash": manifest.HASH, "files": files}
    (step / manifest.NAME).write_text(json.dumps(data))  # no signature at all
    return run, genuine, marker


def test_a_crafted_checkpoint_is_refused_by_every_command_before_it_is_unpickled(
    crafted, tmp_path, capsys, monkeypatch
):
    """Breaks if generate, export, checkpoint verify or train --resume reads a .metadata
    whose manifest is not signed by this user's key (the payload would create its folder),
    or says so in more than one line."""
    run, genuine, marker = crafted
    step = run / "checkpoints" / "step-00000001"
    commands = [
        (["generate", "--run", str(run), "--max-new-tokens", "2"], 2),
        (["export", "--run", str(run), "--out", str(tmp_path / "hf")], 2),
        (["checkpoint", "verify", str(run)], 1),
        (["train", "--out", str(run), "--resume", "--steps", "2", "--tokenizer", "bytes",
          "--cache-dir", str(tmp_path / "cache")], 2),
    ]  # fmt: skip
    for argv, code in commands:
        assert main(argv) == code, argv
        captured = capsys.readouterr()
        text = (captured.err or captured.out).strip()
        assert len(text.splitlines()) == 1 and manifest.UNSIGNED in text, (argv, text)
        assert "--trust-checkpoint" in text and not marker.exists(), argv
    # the same manifest signed with another user's key: refused alike
    monkeypatch.setenv(manifest.KEY_ENV, str(tmp_path / "someone-else" / "key"))
    manifest.write(step, manifest.read(step, trust=step))
    monkeypatch.undo()
    assert manifest.UNSIGNED in checkpoint.verify(step) and not marker.exists()
    # a genuine checkpoint from another user's plait loads with --trust-checkpoint
    monkeypatch.setenv(manifest.KEY_ENV, str(tmp_path / "someone-else" / "key"))
    assert manifest.UNSIGNED in checkpoint.verify(genuine / "checkpoints" / "step-00000001")
    assert main(["generate", "--run", str(genuine), "--max-new-tokens", "2"]) == 2
    assert main(["generate", "--run", str(genuine), "--max-new-tokens", "2",
                 "--trust-checkpoint", str(genuine)]) == 0  # fmt: skip
    assert main(["checkpoint", "verify", str(genuine), "--trust-checkpoint",
                 str(genuine / "checkpoints")]) == 0  # fmt: skip


# -- links in the run folder ------------------------------------------------------------


def test_symlinked_run_files_are_refused_and_their_targets_untouched(tmp_path, capsys):
    """Breaks if run.lock, metrics.jsonl, config.yaml or a log planted as a link makes
    plait write through it (the target is somebody's file), or if the refusal is more
    than one line."""
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    for name in ("run.lock", "metrics.jsonl", "config.yaml", "logs/rank-0.log"):
        out = tmp_path / name.replace("/", "-")
        (out / "logs").mkdir(parents=True)
        (out / name).symlink_to(target)
        with pytest.raises(run_folder.RunFolderError, match="is a symbolic link"):
            run_folder.claim(out)
        assert main(["train", "--out", str(out), "--steps", "1", "--tokenizer", "bytes",
                     "--cache-dir", str(tmp_path / "cache")]) == 2  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "is a symbolic link" in err, err
        assert target.read_text() == "keep me\n" and (out / name).is_symlink()
    # planted after the claim (a race): each writer refuses the link itself
    from plait.train.metrics import MetricsWriter

    out = tmp_path / "race"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to(target)
    with pytest.raises(run_folder.RunFolderError):
        MetricsWriter(out / "metrics.jsonl", enabled=True)
    with pytest.raises(run_folder.RunFolderError):
        MetricsWriter(out / "metrics.jsonl", enabled=True, truncate_after=3)
    link = out / "config.yaml"
    link.symlink_to(target)
    run_folder.write_fresh(link, "x: 1\n")  # replaces the link, never writes through it
    assert not link.is_symlink() and target.read_text() == "keep me\n"


# -- real runs, attacked while they train --------------------------------------------------

TINY = [
    "--model", "tiny", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "32",
    "--global-batch-size", "8", "--micro-batch-size", "1", "--tokenizer", "bytes",
    "--threads", "1", "--eval-every", "0", "--eval-batches", "1", "--no-progress",
]  # fmt: skip


def _attack_run(out: Path, flags: list, forge) -> dict:
    """Start ``plait train`` into ``out``; once it trains, list its listening sockets, probe
    them from a network namespace, and call ``forge(ports, victim_pid)``; then let it end."""
    victim = subprocess.Popen(["sleep", "300"])  # a process outside the run
    cmd = [sys.executable, "-m", "plait.cli", "train", *TINY, "--cache-dir",
           str(out.parent / "cache"), "--out", str(out), *map(str, flags)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = {"victim": victim}
    ns = None
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and metrics.read_text().count("\n") >= 2:
                break
            time.sleep(0.05)
        seen["sockets"] = _listening(_tree(proc.pid))
        seen["launcher"] = [port for _, port in _listening([proc.pid])]
        forge(seen["launcher"], victim.pid)
        ns = Machine("sec", "10.213.77")  # another address, the attacker's
        seen["namespace_why"], seen["namespace_allowed"] = ns.why, ns.why is None
        if ns.why is None:
            seen["reachable"] = [p for _, p in seen["sockets"] if ns.reachable(p)]
        # an attack on a run that had already ended proves nothing: the tests check this
        seen["outlived_the_attack"] = proc.poll() is None
        seen["stdout"], seen["stderr"] = proc.communicate(timeout=300)
        seen["code"] = proc.returncode
        seen["victim_alive"] = victim.poll() is None
    finally:
        if ns is not None:
            ns.close()
        for p in (proc, victim):
            if p.poll() is None:
                p.kill()
                p.wait()
    return seen


def _plant(raw, key: str, value, *, wrong: bool) -> None:
    """A forged value where a real one never is overwritten (overwriting a real last word or
    checkpoint post is a denial of service, not what these tests are after): unsigned where
    the key is absent, then signed with the wrong secret where the unsigned plant still is."""
    value = value.encode() if isinstance(value, str) else value
    if wrong:
        raw.compare_set(key, value, SignedStore(raw, WRONG).sign(key, value))
    else:
        raw.compare_set(key, "", value)


def _await(seen_yet, timeout: float = 60.0) -> None:
    """Wait until ``seen_yet()`` holds: a forged message stays until the run has read it
    (a fixed pause raced a run that finished first). Gives up after ``timeout`` seconds;
    the test's own assertions then say what was never read."""
    deadline = time.time() + timeout
    while time.time() < deadline and not seen_yet():
        time.sleep(0.05)


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _forge_liveness(ports, victim_pid, *, out: Path):
    raws = [_raw(port) for port in ports]  # the launcher's stores: liveness, rendezvous
    log = out / "logs" / "launcher.log"
    for wrong in (False, True):  # each kind stays until the watchdog has read it
        for raw in raws:
            store = SignedStore(raw, WRONG) if wrong else raw
            for rank in (0, 1):
                store.set(liveness.PID.format(rank), str(victim_pid))
                _plant(raw, liveness.STATUS.format(rank), json.dumps(
                    {"code": 2, "message": "\x1b[31mpwned\x1b[0m", "log": None, "detail": None}),
                    wrong=wrong)  # fmt: skip
                store.set(liveness.BEAT.format(rank), "1")
        why = "wrongly signed" if wrong else "unsigned"
        _await(lambda why=why: all(f"({why}): key {liveness.STATUS.format(r)!r}" in _text(log)
                           for r in (0, 1)))  # fmt: skip


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    """A --dp 2 run through torchrun, attacked on its stores while it trains."""
    out = tmp_path_factory.mktemp("attacked") / "run"
    seen = _attack_run(out, ["--dp", 2, "--steps", 600],
                       lambda ports, pid: _forge_liveness(ports, pid, out=out))  # fmt: skip
    return out, seen


@pytest.mark.slow
def test_a_run_listens_on_loopback_only_and_ignores_forged_liveness_messages(torchrun_run):
    """Breaks if a store or process group of a single-node run listens beyond 127.0.0.1, if
    a forged last word ends the run (with its terminal escapes), if a forged pid is
    signalled, or if the refusals are not logged."""
    out, seen = torchrun_run
    assert seen["code"] == 0, seen["stdout"][-2000:] + seen["stderr"][-3000:]
    assert seen["outlived_the_attack"], "the run ended before the attack did: more --steps"
    # the launcher's two stores (liveness, rendezvous) and the workers' gloo sockets
    assert len(seen["launcher"]) == 2 and len(seen["sockets"]) > 2, seen["sockets"]
    assert {ip for ip, _ in seen["sockets"]} == {"127.0.0.1"}, seen["sockets"]
    assert "pwned" not in seen["stdout"] + seen["stderr"] and seen["victim_alive"]
    log = (out / "logs" / "launcher.log").read_text()
    for key in ("liveness/status/0", "liveness/status/1"):
        for why in ("unsigned", "wrongly signed"):
            assert f"ignored a message on the run's store ({why}): key {key!r}" in log, log
    assert "plait: done: step 600" in seen["stdout"]


@pytest.mark.slow
def test_a_runs_ports_are_closed_to_another_address(torchrun_run):
    """From a network namespace (another address, another interface): every port the run
    listens on refuses the connection. Breaks if any binds a non-loopback interface."""
    _, seen = torchrun_run
    if not seen["namespace_allowed"]:  # a namespace needs root and ip(8), nothing else
        pytest.skip(f"no network namespace here: {seen['namespace_why']}")
    assert seen["namespace_why"] is None, seen["namespace_why"]
    assert seen["outlived_the_attack"], "the run's ports were probed after it ended"
    assert seen["reachable"] == [], seen["sockets"]


@pytest.mark.slow
def test_a_resilient_run_ignores_forged_protocol_messages(tmp_path):
    """--fault-tolerance with --async-checkpoint: a stranger on the coordinator's store
    writes a "stop" decision, a hold, a request to re-form, a worker's report of leaving,
    signals, a spawn, last words, pids and pickled checkpoint posts. Breaks if any of it
    is acted on (the run re-forms, stops, holds, signals the stranger's pid or runs the
    pickle) or if the refusals are not logged; the run must finish as if untouched."""
    out = tmp_path / "run"
    marker = tmp_path / "payload-ran"

    def rejected() -> set:
        lines = _text(out / "logs" / "coordinator.jsonl").splitlines()
        events = [json.loads(x) for x in lines if x.endswith("}")]
        return {(e["key"], e["why"]) for e in events if e["event"] == "rejected"}

    def forge(ports, victim_pid):
        (port,) = ports  # the coordinator's one store
        raw = _raw(port)
        for store in (raw, SignedStore(raw, WRONG)):  # each kind stays until it is read
            store.set(protocol.GEN, "40")
            store.set(protocol.DECISION.format(40), json.dumps({"gen": 40, "stop": "pwned"}))
            store.set(protocol.REQUEST, "40")
            store.set(protocol.HOLD, "0 1")
            store.set(protocol.LEFT.format(0, 0), json.dumps(
                {"done": 1, "units": [], "t": time.time(), "stats": None, "why": "pwned"}))  # fmt: skip
            store.set(protocol.TIMING.format(1), json.dumps({"line": "\x1b[2Jpwned"}))
            store.set(nodes.SIGNALS.format(0), f"{signal.SIGKILL},")
            store.set(nodes.SPAWN.format(1), "9:0,")
            for w in (0, 1):
                store.set(liveness.PID.format(w), str(victim_pid))
                _plant(raw, liveness.STATUS.format(w), json.dumps({"code": 2, "message": "pwned"}),
                       wrong=store is not raw)  # fmt: skip
            for step in (30, 60, 90, 120):  # never over a rank's real post: that is a
                for rank in (0, 1):  # denial of service, not what this test is after
                    key = async_checkpoint.POST.format(0, step, rank)
                    _plant(raw, key, pickle.dumps(Payload(marker)), wrong=store is not raw)
            why = "unsigned" if store is raw else "wrongly signed"
            keys = (
                protocol.LEFT.format(0, 0),
                liveness.STATUS.format(0),
                liveness.STATUS.format(1),
            )
            _await(lambda why=why, keys=keys: {(k, why) for k in keys} <= rejected())
            _await(lambda: any(f"key {protocol.REQUEST!r}" in p.read_text()
                               for p in (out / "logs").glob("rank-*.log")))  # fmt: skip

    seen = _attack_run(out, ["--dp", 2, "--steps", 120, "--fault-tolerance", 1, "--save-every", 30,
                             "--async-checkpoint", "--heartbeat-timeout", 3], forge)  # fmt: skip
    assert seen["code"] == 0, seen["stdout"][-2000:] + seen["stderr"][-3000:]
    assert seen["outlived_the_attack"], "the run ended before the attack did: more --steps"
    assert {ip for ip, _ in seen["sockets"]} == {"127.0.0.1"}, seen["sockets"]
    if seen["namespace_allowed"]:
        assert seen["namespace_why"] is None, seen["namespace_why"]
        assert seen["reachable"] == [], seen["sockets"]
    assert "pwned" not in seen["stdout"] + seen["stderr"] and seen["victim_alive"]
    assert not marker.exists()
    assert "plait: generation" not in seen["stdout"]  # never re-formed
    assert "plait: done: step 120" in seen["stdout"]
    events = [json.loads(x) for x in (out / "logs" / "coordinator.jsonl").read_text().splitlines()]
    refused = rejected()
    for key in (protocol.LEFT.format(0, 0), liveness.STATUS.format(0), liveness.STATUS.format(1)):
        assert {(key, "unsigned"), (key, "wrongly signed")} <= refused, refused
    assert not any(e["event"] in ("decision", "death", "chaos", "spawn") and e.get("worker", 0) > 1
                   for e in events)  # fmt: skip
    worker_logs = "".join(p.read_text() for p in (out / "logs").glob("rank-*.log"))
    assert f"key {protocol.REQUEST!r}" in worker_logs, worker_logs[-2000:]
    ckpts = checkpoint.checkpoint_dirs(out / "checkpoints")
    assert [c.name for c in ckpts] == ["step-00000090", "step-00000120"]
    assert all(checkpoint.verify(c) is None for c in ckpts)
