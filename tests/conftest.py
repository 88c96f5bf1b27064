import atexit
import ctypes
import errno
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# tests/ holds helpers (distributed.py) imported by the test modules.
sys.path.insert(0, str(Path(__file__).parent))

# Checkpoints are signed with a key of the user (train/manifest.py): the tests' own, made on
# first use in a folder of this session, never ~/.config/plait/key. Worker processes inherit it.
if "PLAIT_KEY_FILE" not in os.environ:
    _KEYS = tempfile.mkdtemp(prefix="plait-key-")
    os.environ["PLAIT_KEY_FILE"] = str(Path(_KEYS) / "key")
    atexit.register(shutil.rmtree, _KEYS, True)

MS_RDONLY, MNT_DETACH = 1, 2  # <sys/mount.h>


@pytest.fixture
def tmpfs():
    """``tmpfs(path, size="1m", read_only=False)`` mounts a small tmpfs at ``path`` (made if
    missing) and returns ``path``; every one is unmounted after the test. Where mounting
    is not permitted -- not root, or a container without CAP_SYS_ADMIN: mount(2) fails
    with EPERM -- the test is skipped, saying why; any other failure is an error."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
    mounted = []

    def mount(path: Path, *, size: str, read_only: bool = False) -> Path:
        if libc is None:
            pytest.skip(f"tmpfs is Linux's and this is {sys.platform}")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        flags = MS_RDONLY if read_only else 0
        if libc.mount(b"tmpfs", bytes(path), b"tmpfs", flags, f"size={size}".encode()) != 0:
            err = ctypes.get_errno()
            if err == errno.EPERM:
                uid = os.geteuid()
                why = "as root: no CAP_SYS_ADMIN, a container?" if uid == 0 else f"uid {uid}"
                pytest.skip(f"mounting a tmpfs is not permitted here (EPERM {why})")
            raise OSError(err, f"mount -t tmpfs {path}: {os.strerror(err)}")
        mounted.append(path)
        return path

    yield mount
    gc.collect()  # a failed write's traceback may still hold a file open on the tmpfs
    for path in reversed(mounted):
        if libc.umount2(bytes(path), 0) != 0:  # still busy: detach, freed once let go
            libc.umount2(bytes(path), MNT_DETACH)
