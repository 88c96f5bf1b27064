"""The run folder (``--out``): checked writable before anything else happens, and locked for
the life of the run, so a second run on the same folder is refused in one line.

The lock is an advisory POSIX record lock (``fcntl.lockf``) on ``DIR/run.lock`` (node K > 0
of a multi-node run: ``DIR/run.node-K.lock``), held by the launcher until it exits. The file
holds the owner's host, pid and start time, for the line a refused run prints. The kernel
drops the lock when its process ends, however it ends, so the file left behind by a run that
died is a stale lock and is simply taken over. POSIX locks also hold across machines on NFS
(v4, or v3 with lockd), where a multi-node run keeps its folder.

Links: a run folder may be writable by others (a shared scratch space), and a symbolic link
planted there as ``run.lock`` or ``metrics.jsonl`` would turn plait's write into an
overwrite of the link's target. So the files plait writes there are opened without
following a link (``open_nofollow``: O_NOFOLLOW, O_EXCL where created fresh), and ``claim``
refuses, in one line, a folder where one of them is a link. (A linked sub-folder, such as
``checkpoints`` on a larger disk, is the owner's choice and is followed.)

Communication: none.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

WRITTEN = ("run.lock", "config.yaml", "metrics.jsonl", ".run-secret")  # and logs/*


class RunFolderError(ValueError):
    """``--out`` cannot be used (message is one line)."""


class RunLock:
    """The held lock; ``release()`` (or process exit) frees it."""

    def __init__(self, path: Path, fd: int, *, created: bool):
        self.path, self.fd, self.created = path, fd, created

    def release(self, *, remove_if_unused: bool = False) -> None:
        """Free the lock; with ``remove_if_unused``, also remove a folder this run created
        and left empty (a run refused before it wrote anything)."""
        if self.fd < 0:
            return
        folder = self.path.parent
        if (
            remove_if_unused
            and self.created
            and [p.name for p in folder.iterdir()] == [self.path.name]
        ):
            self.path.unlink(missing_ok=True)
            folder.rmdir()
        os.close(self.fd)
        self.fd = -1


def lock_name(node_rank: int = 0) -> str:
    return "run.lock" if node_rank == 0 else f"run.node-{node_rank}.lock"


def claim(out: Path, *, node_rank: int = 0) -> RunLock:
    """Create ``out`` if needed, prove it writable and lock it for this process; one-line
    RunFolderError (a ValueError: exit code 2) when it cannot be used."""
    out = Path(out)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunFolderError(f"--out {out}: a file of that name is in the way; give a folder")
    except NotADirectoryError:
        raise RunFolderError(f"--out {out}: part of that path is a file, not a folder")
    except OSError as e:
        raise RunFolderError(f"--out {out}: cannot create the folder ({e.strerror}); "
                             "give a folder you can write to")  # fmt: skip
    path = out / lock_name(node_rank)
    refuse_links(out, [lock_name(node_rank)])
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_error(path) from None
        raise RunFolderError(f"--out {out} is not writable ({e.strerror}); "
                             "give a folder you can write to")  # fmt: skip
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise RunFolderError(
            f"--out {out} is in use by another plait train ({owner(path)}); "
            "wait for it to finish or give another --out"
        )
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "since": datetime.datetime.now().isoformat(timespec="seconds")}  # fmt: skip
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode() + b"\n", 0)
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        raise RunFolderError(f"--out {out} is not writable ({e.strerror}); "
                             "give a folder with free space you can write to")  # fmt: skip
    try:
        refuse_links(out)
    except RunFolderError:
        os.close(fd)
        raise
    return RunLock(path, fd, created=created)


def refuse_links(out: Path, names=None) -> None:
    """RunFolderError (one line) when a file plait writes in ``out`` is a symbolic link."""
    out = Path(out)
    paths = [out / n for n in (WRITTEN if names is None else names)]
    if names is None and (out / "logs").is_dir():
        paths += sorted((out / "logs").iterdir())
    for path in paths:
        if path.is_symlink():
            raise _link_error(path)


def _link_error(path: Path) -> RunFolderError:
    return RunFolderError(f"{path} is a symbolic link; plait writes no file of a run folder "
                          "through a link (it would overwrite its target): remove it")  # fmt: skip


def open_nofollow(path: Path, mode: str = "a", *, fresh: bool = False):
    """``open(path, mode)`` for "a" or "w", never through a symbolic link (RunFolderError,
    one line); ``fresh``: the file must not exist yet (O_EXCL: a temporary name)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_APPEND if mode == "a" else os.O_TRUNC
    if fresh:
        flags |= os.O_EXCL
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_error(Path(path)) from None
        raise
    return os.fdopen(fd, mode)


def write_fresh(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a fresh temporary file renamed over it (a link at
    ``path`` is replaced, never followed)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    with open_nofollow(tmp, "w", fresh=True) as f:
        f.write(text)
    os.replace(tmp, path)


def owner(path: Path) -> str:
    """Who holds the lock, in words, from the file's contents."""
    try:
        o = json.loads(Path(path).read_text())
        return f"pid {int(o['pid'])} on {o['host']}, since {o['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"see {path}"
