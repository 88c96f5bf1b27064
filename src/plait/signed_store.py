"""The control plane's store, signed: every message a launcher, coordinator, node agent or
worker acts on carries an HMAC-SHA256 under a secret only the run's own processes have, and
a message that fails the check is ignored and logged (``docs/security.md``).

Communication: none through process groups. ``SignedStore`` wraps a
``torch.distributed`` store (the ``TCPStore`` of ``train/liveness.py``): ``set`` writes,
``get`` / ``check`` read, one key at a time, from any thread (a store client is one
connection; callers give each thread its own, as before). What goes through the wrapped
store's raw interface is left alone: the process groups' own rendezvous keys
(``gen{G}/...``, written by torch.distributed) and nothing else.

A value is stored as ``plait1 <mac> <seq> <payload>`` where ``mac`` is
HMAC-SHA256(secret, key NUL seq NUL payload) in hex and ``seq`` a number that grows with
every message its writer sends. Binding the key stops a signed value from being moved to
another key; ``seq`` stops it from being replayed onto its own key: a reader keeps the
highest ``seq`` it accepted per key and refuses a lower one (a key has one writer in the
protocol). Counters (heartbeats, the generation number) are signed values too, never the
store's unauthenticated ``add``.

What a stranger who can reach the store can still do: read every key (nothing secret
travels there: the secret never does), and overwrite or delete keys, which stalls or ends
the run (a denial of service) but cannot make any process act on a message of theirs.

The secret: 32 random bytes made by the launcher of node 0 (``new_secret``), handed to the
processes it starts through the environment (``ENV``, hex), and, for the launchers of other
nodes, through a file of mode 0600 in the run folder (``write_secret`` / ``read_secret``),
which a multi-node run shares: whoever can read the run folder can act as the run.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from pathlib import Path

ENV = "PLAIT_RUN_SECRET"
SECRET_FILE = ".run-secret"  # in the run folder, mode 0600: for the other nodes' launchers
MAGIC = b"plait1"

log = logging.getLogger("plait.signed_store")


class SecretError(ValueError):
    """The run's secret cannot be found or read (one line)."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def secret_from_env() -> bytes:
    """This process's run secret, handed down by its launcher (``ENV``)."""
    value = os.environ.get(ENV, "")
    try:
        secret = bytes.fromhex(value)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise SecretError(f"{ENV} is not set: this process must be started by plait train "
                          "(the run's secret authenticates its control messages)")  # fmt: skip
    return secret


def write_secret(folder: Path, secret: bytes) -> Path:
    """``folder/.run-secret``, mode 0600, replacing a previous run's: written to a fresh
    temporary name (O_EXCL, never through a link) and renamed into place."""
    path = Path(folder) / SECRET_FILE
    tmp = path.with_name(f"{SECRET_FILE}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secret.hex().encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_secret(folder: Path) -> bytes:
    """The secret node 0's launcher wrote into the shared run folder."""
    path = Path(folder) / SECRET_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            secret = bytes.fromhex(os.read(fd, 1024).decode())
        finally:
            os.close(fd)
    except (OSError, ValueError) as e:
        raise SecretError(f"{path}: cannot read the run's secret ({e.__class__.__name__}); "
                          "the run folder must be shared with node 0") from None  # fmt: skip
    if len(secret) < 16:
        raise SecretError(f"{path}: not a run secret; the run folder must be shared with node 0")
    return secret


class SignedStore:
    """A store whose ``set`` signs and whose ``get`` / ``check`` verify (module docstring).

    A refused message is logged -- the first of each kind on each key, then every 100th on
    the key, so a flood cannot fill a disk -- to the ``plait.signed_store`` logger, or, when given, by
    ``on_reject(key, why, count)`` instead; ``rejected`` counts them by key."""

    def __init__(self, store, secret: bytes, *, on_reject=None):
        self.raw, self.secret, self.on_reject = store, bytes(secret), on_reject  # in-process only
        self._seen: dict[str, int] = {}  # key -> highest seq accepted
        self._seq = 0
        self._lock = threading.Lock()
        self.rejected: dict[str, int] = {}
        self._logged: set[tuple[str, str]] = set()

    @property
    def port(self) -> int:
        return self.raw.port

    def _mac(self, key: str, seq: int, payload: bytes) -> bytes:
        msg = key.encode() + b"\0" + str(seq).encode() + b"\0" + payload
        return hmac.new(self.secret, msg, hashlib.sha256).hexdigest().encode()

    def _next_seq(self) -> int:
        with self._lock:  # growing even if the wall clock steps back
            self._seq = max(self._seq + 1, time.time_ns())
            return self._seq

    def sign(self, key: str, value: str | bytes) -> bytes:
        payload = value.encode() if isinstance(value, str) else bytes(value)
        seq = self._next_seq()
        return b" ".join((MAGIC, self._mac(key, seq, payload), str(seq).encode(), payload))

    def set(self, key: str, value: str | bytes) -> None:
        self.raw.set(key, self.sign(key, value))

    def verify(self, key: str, data: bytes) -> bytes | None:
        """The payload of ``data`` read from ``key``, or None (refused, logged)."""
        parts = data.split(b" ", 3)
        if len(parts) != 4 or parts[0] != MAGIC or not parts[2].isdigit():
            return self._reject(key, "unsigned")
        _, mac, seq, payload = parts
        if not hmac.compare_digest(mac, self._mac(key, int(seq), payload)):
            return self._reject(key, "wrongly signed")
        with self._lock:
            if int(seq) < self._seen.get(key, 0):
                return self._reject(key, "replayed")
            self._seen[key] = int(seq)
        return payload

    def get(self, key: str) -> bytes | None:
        """The verified payload of ``key``; None when it is absent or refused. Never
        blocks waiting for the key (unlike a store's own ``get``)."""
        if not self.raw.check([key]):
            return None
        return self.verify(key, self.raw.get(key))

    def check(self, keys) -> bool:
        """Whether every key holds a message that verifies."""
        return all(self.get(k) is not None for k in keys)

    def delete_key(self, key: str) -> None:
        self.raw.delete_key(key)
        with self._lock:
            self._seen.pop(key, None)

    def _reject(self, key: str, why: str) -> None:
        n = self.rejected[key] = self.rejected.get(key, 0) + 1
        if (key, why) not in self._logged or n % 100 == 0:
            self._logged.add((key, why))
            if self.on_reject is not None:
                self.on_reject(key, why, n)
            else:
                log.warning("plait: ignored a message on the run's store (%s): key %r (%d so "
                            "far)", why, key, n)  # fmt: skip
        return None
