"""A folder's manifest: the size and SHA-256 of every file in it, so damage is found before
a single byte reaches the model.

``manifest.json`` sits next to the files it lists and knows nothing about what they hold
(DCP shards, RNG states, meta data, per-replica state ...)::

    {"format": "plait-manifest/1", "hash": "sha256",
     "files": {"__0_0.distcp": {"size": 1433622, "sha256": "9f2c..."}, ...},
     "signature": "hmac-sha256:5be1..."}

Signed: a checkpoint's DCP ``.metadata`` is a pickle, and loading a pickle runs whatever
code its author put in it. So the manifest carries an HMAC-SHA256, under a key of this user
(``user_key``: ``~/.config/plait/key``, mode 0600, made on first use; ``PLAIT_KEY_FILE``
names another), of everything else in it, and ``read`` refuses a manifest whose signature
does not verify -- unless the folder is under a path the user trusts (``--trust-checkpoint
PATH``). A verified manifest lists the digest of every file, ``.metadata`` included, so
nothing reaches DCP that this user's plait did not write (``docs/security.md``).

It is written last, to a temporary name, fsynced and renamed into place, so a manifest is
either absent or complete. ``check`` compares files against it: a missing file, a size that
differs (a truncated or extended file, found from ``stat`` alone), or a digest that differs
(bytes changed in place).

Why SHA-256: it is in the standard library, ``hashlib`` releases the GIL while hashing, and
with the SHA extensions of current x86 and Arm CPUs it runs at 1.8 GB/s on one core of this
machine (``zlib.crc32``: 3.5 GB/s, BLAKE2b: 0.9 GB/s; measured with ``hashlib.new(name)``
over 256 MiB in memory). Checkpoints are hashed by the ranks that wrote them, each its own
files, as the bytes go to the file (``hashing_file_system``, on a second thread beside the
write): nothing is read back, and the hash hides behind the write; a 32-bit CRC would be faster but lets one damaged file in 4 billion
through, and SHA-256 also matches the digests that model hubs publish.

Communication: none (the checkpoint module splits the work over ranks and agrees on the
result). The hashing thread of ``hashing_file_system`` only hashes bytes it is handed:
it issues no collective, so the rule of collectives from one thread holds.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

NAME = "manifest.json"
FORMAT = "plait-manifest/1"
HASH = "sha256"
SIGNATURE = "hmac-sha256:"
KEY_ENV = "PLAIT_KEY_FILE"
UNSIGNED = "is not signed with this user's plait key"


class ManifestError(ValueError):
    """A manifest that is missing or cannot be read (message is one line)."""


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One file that does not match the manifest."""

    name: str
    kind: str  # "missing" | "size" | "digest"
    expected: int = 0  # bytes, for "size"
    found: int = 0

    def describe(self) -> str:
        if self.kind == "missing":
            return f"{self.name} is missing"
        if self.kind == "size":
            return f"{self.name} is {self.found:,} bytes where {self.expected:,} were written"
        return f"{self.name} does not match its {HASH}: its bytes changed after it was written"


def digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, HASH).hexdigest()


def entries(folder: Path, names, *, known: dict[str, str] | None = None) -> dict[str, dict]:
    """Size and digest of ``names`` (paths relative to ``folder``); ``known``: digests taken
    while the files were written (``HashingFileSystem``), not read back."""
    folder, known = Path(folder), known or {}
    return {
        name: {"size": (folder / name).stat().st_size,
               HASH: known.get(name) or digest(folder / name)}
        for name in names
    }  # fmt: skip


_OVERLAP = 1 << 20  # writes from 1 MiB on hash on a second thread while this one writes


class _HashingStream:
    """A file opened for writing whose bytes are hashed as they pass: DCP writes each
    tensor sequentially (``write``, ``tell``, ``flush``, ``fileno`` for its fsync, never a
    seek back), so the digest of what went through is the file's. A large write hashes on
    the writer's helper thread while this thread writes it (``hashlib`` releases the GIL),
    and returns when both are done: the caller's buffer is not kept."""

    def __init__(self, f, pool):
        self._f, self._hash, self._pool = f, hashlib.new(HASH), pool

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        if view.nbytes < _OVERLAP:
            self._hash.update(view)
            return self._f.write(view)
        hashed = self._pool.submit(self._hash.update, view)
        try:
            return self._f.write(view)
        finally:
            hashed.result()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def __getattr__(self, name):  # tell, flush, fileno, close, writable ...
        return getattr(self._f, name)


def hashing_file_system(root: Path, digests: dict[str, str]):
    """A DCP ``FileSystem`` that records in ``digests`` (name relative to ``root`` -> hex)
    the digest of every file it writes, taken while writing. Hashing a rank's shard
    afterwards read every byte back: 12 GB for a 1B model's fp32 state with AdamW (100+ s
    on the first GPU host, longer than the write), and at 175B a node's eight ranks would
    read ~130 GB back, more than its page cache holds. What the digest does not check is
    that the disk kept the bytes at the moment of writing: the manifest's check at load
    does, as before."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import contextmanager

    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path, mode: str):
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with super().create_stream(path, mode) as f, \
                    ThreadPoolExecutor(1, thread_name_prefix="plait-hash") as pool:  # fmt: skip
                stream = _HashingStream(f, pool)
                yield stream
            digests[os.path.relpath(path, root)] = stream.hexdigest()

    return HashingFileSystem()


def key_path() -> Path:
    return Path(os.environ.get(KEY_ENV) or Path.home() / ".config" / "plait" / "key")


def user_key(*, create: bool) -> bytes | None:
    """This user's checkpoint key (32 random bytes, hex, in ``key_path()``, mode 0600);
    made on first use when ``create`` (atomically: a process that loses the race reads
    the winner's), else None when there is none."""
    path = key_path()
    try:
        return _read_key(path)
    except FileNotFoundError:
        if not create:
            return None
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process made one meanwhile: use theirs
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        key = bytes.fromhex(os.read(fd, 4096).decode().strip())
    except ValueError:
        key = b""
    finally:
        os.close(fd)
    if len(key) < 16:
        raise ManifestError(f"{path} is not a plait key (set {KEY_ENV} to another file)")
    return key


def signature(data: dict, key: bytes) -> str:
    """The HMAC of a manifest's content (all but its signature), in a canonical form."""
    body = {k: v for k, v in data.items() if k != "signature"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return SIGNATURE + hmac.new(key, text, hashlib.sha256).hexdigest()


def trusted(folder: Path, trust) -> bool:
    """Whether ``folder`` is ``trust`` or inside it (``--trust-checkpoint PATH``)."""
    if not trust:
        return False
    folder, trust = Path(folder).resolve(), Path(trust).resolve()
    return folder == trust or trust in folder.parents


def write(folder: Path, files: dict[str, dict]) -> Path:
    """Write ``folder/manifest.json`` atomically (temporary name, fsync, rename), signed
    with this user's key."""
    path = Path(folder) / NAME
    tmp = path.with_name(NAME + ".tmp")
    data = {"format": FORMAT, "hash": HASH, "files": dict(sorted(files.items()))}
    data["signature"] = signature(data, user_key(create=True))
    write_synced(tmp, json.dumps(data, indent=1).encode())
    os.replace(tmp, path)
    return path


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(folder: Path, *, trust=None) -> dict[str, dict]:
    """The files listed in ``folder``'s manifest; ManifestError when it is absent, damaged,
    or not signed with this user's key (unless ``folder`` is under ``trust``)."""
    path = Path(folder) / NAME
    try:
        data = json.loads(path.read_bytes())
        files = data["files"]
        if data.get("format") != FORMAT or data.get("hash") != HASH:
            raise ValueError(f"format {data.get('format')!r}")
        for name, e in files.items():
            if not isinstance(e.get("size"), int) or not isinstance(e.get(HASH), str):
                raise ValueError(f"entry {name!r}")
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"entry {name!r} points outside the folder")
    except FileNotFoundError:
        raise ManifestError(f"{NAME} is missing (not written completely, or by an older plait)")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ManifestError(f"{NAME} is damaged ({type(e).__name__}: {str(e)[:80]})")
    if not trusted(folder, trust):
        try:
            key = user_key(create=False)
        except (OSError, ManifestError):
            key = None
        mark = data.get("signature")
        if (
            key is None
            or not isinstance(mark, str)
            or not hmac.compare_digest(mark.encode(), signature(data, key).encode())
        ):
            raise ManifestError(
                f"{NAME} {UNSIGNED} ({key_path()}), and loading a checkpoint runs code its "
                "author can choose (its DCP .metadata is a pickle): if you trust its author, "
                f"--trust-checkpoint {Path(folder)} loads it"
            )
    return files


def check(folder: Path, files: dict[str, dict], names=None, *, hashes: bool = True) -> list:
    """Problems of ``names`` (default: every listed file) against ``files``; sizes first,
    then digests (``hashes=False``: sizes only, from ``stat``)."""
    folder = Path(folder)
    problems = []
    for name in sorted(files if names is None else names):
        want = files[name]
        try:
            size = (folder / name).stat().st_size
        except OSError:
            problems.append(Problem(name=name, kind="missing"))
            continue
        if size != want["size"]:
            problems.append(Problem(name=name, kind="size", expected=want["size"], found=size))
        elif hashes:
            try:
                ok = digest(folder / name) == want[HASH]
            except OSError:
                ok = False
            if not ok:
                problems.append(Problem(name=name, kind="digest"))
    return problems


def split(files: dict[str, dict], parts: int) -> list[list[str]]:
    """Deal the files out to ``parts`` workers with about equal bytes each (largest first to
    the least loaded): the same answer on every rank, from the manifest alone."""
    loads, out = [0] * parts, [[] for _ in range(parts)]
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        k = min(range(parts), key=lambda i: (loads[i], i))
        out[k].append(name)
        loads[k] += files[name]["size"]
    return out
