"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), sharded: each rank writes only
what it holds and reads only what its layout needs; written atomically, each file checked
against a manifest before anything reaches the model.

Layout of ``OUT/checkpoints/step-00000100/``: the DCP files (``.metadata``, ``*.distcp``)
holding every parameter and its optimizer state under the parameter's global name
(``model/<name>``, ``optim/<name>/<key>``) at its *global* (tp-unsharded, unpadded) shape;
``meta.json`` (step, loss scale, model config); ``rng-rank-K.pt`` per rank (its CPU and GPU
generators); and ``manifest.json``, the size and SHA-256 of every other file
(``manifest.py``).

Sharded: the caller hands ``save`` and ``load`` {key: ``Held``} (``parallel/held.py``):
what this rank holds of each tensor -- its tp shard, or the ZeRO range of it -- as live
views. Each is given to DCP as the boxes of the global tensor it covers (DTensor's
checkpoint protocol, ``_Boxes``): a save writes exactly those boxes (a box several ranks
hold -- dp replicas, a tied copy -- is written once, DCP's de-duplication), and a load asks
for exactly those boxes and DCP reads them from whichever saved chunks overlap them. So no
rank ever gathers a tensor whole, a save's extra memory is one box's host copy at a time,
and a checkpoint loads into any layout (different dp, tp, pp or ZeRO stage).

Atomicity: everything is written into ``step-N.tmp``; each rank fsyncs and hashes the files
it wrote (``.manifest-rank-K.json``); once all ranks are done, rank 0 merges those into the
manifest, writes it last (temporary name, fsync, rename) and renames the folder to
``step-N``. A crash mid-write leaves only a ``.tmp`` folder, which is ignored and cleaned up
by the next save; a failed write (no space left, say) removes it at once. Either way the
previous checkpoint stays intact.

Verification (``verify``, ``pick_resume``): the manifest must be signed with this user's
key (``manifest.py``; ``trust``: a folder the user vouches for instead), and every file it
lists must exist with its size and digest -- before DCP reads ``.metadata``, a pickle.
``pick_resume`` takes the newest checkpoint that verifies and says in one line which ones
it skipped and why.

Communication: ``save`` issues three world barriers around DCP's own collectives (planning
and the final gather of write results: small objects, gathered to rank 0 and scattered
back), all on the topology's world group (never the default group: a resilient run's
generations each build their own); every rank calls it at the same step, so the order is
the same everywhere. ``load`` issues DCP's planning collectives (the same on every rank).
No tensor data moves between ranks. ``verify`` and ``pick_resume`` with a multi-rank
``topo`` issue world all-reduces of small int64 tensors on ``topo.device`` (the candidate
step; the manifest's file count; one (kind, size) row per file): each rank reads about
1/world of the bytes, and every decision is taken from the reduced values, so every rank
runs the same number of all-reduces in the same order and returns the same answer.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from plait import comm
from plait.errors import CheckpointError  # noqa: F401 (raised here, caught by name)
from plait.parallel.held import Held
from plait.parallel.tensor import shard_spec
from plait.topology import Topology
from plait.train import checkpoint_files, manifest
from plait.train.checkpoint_files import checkpoint_dirs, latest, read_meta, verify_files

PART = ".manifest-rank-"  # + rank + ".json": the files one rank wrote, merged by rank 0


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (no space left, a read-only file system); the
    message is one line and names the previous checkpoint, which is intact."""


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer (fsyncs every file), remembering which files this rank wrote and
    their digests, taken as they were written (``manifest.hashing_file_system``)."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.written: list[str] = []
        self.digests: dict[str, str] = {}
        self.fs = manifest.hashing_file_system(Path(path), self.digests)

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # already complete: written in this thread
        self.written += [r.storage_data.relative_path for r in future.value()]
        return future


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def model_state(model, *, prefix: str = "") -> dict[str, Held]:
    """{``<prefix>model/<name>``: each parameter whole} -- what a process that holds the
    whole model (``generate``, a single-process run) reads or writes."""
    return {f"{prefix}model/{n}": Held.whole(p.detach(), shard_spec(p))
            for n, p in model.named_parameters()}  # fmt: skip


class _Boxes(torch.Tensor):
    """One checkpoint tensor as DCP sees it on this rank: its global size, and the boxes of
    it this rank holds (global offsets, live view). It implements the checkpoint protocol
    DTensor implements (``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``), which DCP's default planners ask of any tensor; nothing else
    may be done with it."""

    @staticmethod
    def __new__(cls, size, dtype, boxes):
        t = torch.Tensor._make_wrapper_subclass(cls, size, dtype=dtype)
        t.boxes = boxes
        return t

    def __init__(self, size, dtype, boxes):
        super().__init__()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"a checkpoint's box list does not support {func}")

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape),
                    properties=TensorProperties.create_from_tensor(view),
                    size=self.size(),
                ),
            )
            for offsets, view in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape) for o, v in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, view in self.boxes:
            if torch.Size(offsets) == index.offset:
                return view
        raise ValueError(f"{index.fqn}: this rank holds no box at {tuple(index.offset)}")


def dcp_state(state: dict[str, Held], *, tp_rank: int, tp: int) -> dict[str, _Boxes]:
    """``state`` as DCP's state dict: each tensor the boxes of it this rank holds."""
    out = {}
    for key, held in state.items():
        boxes = held.boxes(tp_rank=tp_rank, tp=tp)
        out[key] = _Boxes(torch.Size(held.global_shape(tp)), held.flat.dtype, boxes)
    return out


def save(
    root: Path,
    step: int,
    *,
    state: dict[str, Held],
    meta: dict,
    topo: Topology,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` (collective: every rank calls it) from ``state``, what this
    rank holds of each tensor (module docstring). A write that fails for want of space or
    permission raises CheckpointWriteError with one line."""
    root = Path(root)
    previous = latest(root)
    try:
        return _write(root, step, state=state, meta=meta, topo=topo, keep=keep)
    except BaseException as e:
        # DCP's CheckpointException (a BaseException) wraps every rank's failure, which
        # may be torch.save's RuntimeError for a full disk: the space left decides too
        failed = isinstance(e, Exception | CheckpointException)
        cause = _os_error(e) or (_out_of_space(root) if failed else None)
        if topo.rank == 0:  # free the space at once; the previous checkpoint is untouched
            shutil.rmtree(root / f"step-{step:08d}.tmp", ignore_errors=True)
        if cause is None:
            raise
        kept = (
            f"{previous.name} is intact and --resume continues from it"
            if previous is not None
            else "there is no earlier checkpoint"
        )
        what = os.strerror(cause.errno).lower() if cause.errno else str(cause)
        raise CheckpointWriteError(
            f"checkpoint step {step} could not be written to {root}: {what}; {kept}"
        ) from e


def _write(root: Path, step: int, *, state, meta, topo, keep) -> Path:
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    if topo.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    comm.barrier(topo=topo)
    writer = _Writer(tmp)
    with warnings.catch_warnings():  # DCP warns that one process means no_dist; we know
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dcp_state(state, tp_rank=topo.tp_rank, tp=topo.tp), storage_writer=writer, process_group=topo.world_group,
                 no_dist=not _dist())  # fmt: skip
    torch.save(rng_state(topo.device), tmp / f"rng-rank-{topo.rank}.pt")
    manifest.fsync(tmp / f"rng-rank-{topo.rank}.pt")  # DCP fsyncs its own files
    mine = manifest.entries(tmp, [*writer.written, f"rng-rank-{topo.rank}.pt"],
                            known=writer.digests)  # fmt: skip
    manifest.write_synced(tmp / f"{PART}{topo.rank}.json", json.dumps(mine).encode())
    comm.barrier(topo=topo)
    if topo.rank == 0:
        _commit(tmp, final, {**meta, "step": step}, world=topo.world_size)
        for old in checkpoint_dirs(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    comm.barrier(topo=topo)
    return final


def _commit(tmp: Path, final: Path, meta: dict, *, world: int) -> None:
    """Rank 0, once every rank has written and hashed its files: meta.json, the manifest
    (last), then the folder's rename."""
    manifest.write_synced(tmp / "meta.json", json.dumps(meta, indent=1).encode())
    files = {}
    parts = [tmp / f"{PART}{r}.json" for r in range(world)]
    for part in parts:
        files.update(json.loads(part.read_text()))
        part.unlink()
    rest = [
        p.relative_to(tmp).as_posix()
        for p in tmp.rglob("*")
        if p.is_file() and p.relative_to(tmp).as_posix() not in files
    ]  # what rank 0 wrote besides its part: DCP's .metadata, meta.json
    files.update(manifest.entries(tmp, rest))
    manifest.write(tmp, files)
    manifest.fsync(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    manifest.fsync(final.parent)


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: ``e`` itself, one of DCP's per-rank failures, or a
    cause in its chain."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError):
            return e
        for inner in (getattr(e, "failures", None) or {}).values():
            inner = inner[0] if isinstance(inner, tuple) else inner
            if isinstance(inner, OSError):
                return inner
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _out_of_space(root: Path) -> OSError | None:
    """A failed write on a file system with (almost) no space left: torch's zip writer
    (``torch.save``) reports a full disk as a RuntimeError ("unexpected pos ..."), not as
    the OSError underneath, so the space that is left is the evidence."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if free < 1 << 20 else None


def rng_state(device: torch.device) -> dict:
    """This rank's random-number state: the CPU generator, and its GPU's when it has one
    (dropout masks on a GPU come from there; a resumed run must not replay them)."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore what ``rng_state`` saved (a CPU run's file has no GPU state to restore)."""
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _root_cause(e: BaseException) -> str:
    """One line from DCP's per-rank failure report, or from the exception itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            e = inner
    text = (str(e).strip().splitlines() or [""])[0][:160]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def verify(path: Path, *, topo: Topology | None = None, hashes: bool = True,
           trust=None) -> str | None:  # fmt: skip
    """None when every file of checkpoint ``path`` matches its manifest, signed by this
    user (or ``path`` is under ``trust``), else one line saying what is wrong
    (``hashes=False``: sizes only, from ``stat``). With a multi-rank ``topo`` this is
    collective: the files are split over the ranks by size, each rank also checks the
    ``.metadata`` it will unpickle, and every rank returns the same answer (module
    docstring)."""
    path = Path(path)
    if topo is None or topo.world_group is None:
        return verify_files(path, hashes=hashes, trust=trust)
    try:
        files, trouble = manifest.read(path, trust=trust), None
    except manifest.ManifestError as e:
        files, trouble = {}, str(e)
    n = len(files)
    head = torch.tensor([trouble is not None, n, -n], dtype=torch.int64, device=topo.device)
    comm.world_all_reduce(head, topo=topo, op=dist.ReduceOp.MAX)
    if head[0] or head[1] != -head[2]:
        return trouble or f"{manifest.NAME} could not be read the same on every rank"
    names = sorted(files)
    if not names:
        return None
    mine = manifest.split(files, topo.world_size)[topo.rank]
    mine = sorted(set(mine) | ({".metadata"} & set(files)))
    found = torch.zeros(len(names), 2, dtype=torch.int64)  # (kind + 1, size found) per file
    for p in manifest.check(path, files, mine, hashes=hashes):
        found[names.index(p.name)] = torch.tensor([_KINDS.index(p.kind) + 1, p.found])
    found = comm.world_all_reduce(found.to(topo.device), topo=topo, op=dist.ReduceOp.MAX)
    for name, (kind, size) in zip(names, found.tolist()):
        if kind:
            want, kind = files[name]["size"], _KINDS[kind - 1]
            return manifest.Problem(name=name, kind=kind, expected=want, found=size).describe()
    return None


_KINDS = ("missing", "size", "digest")


def pick_resume(
    root: Path,
    step: int | None = None,
    *,
    topo: Topology | None = None,
    hashes: bool = True,
    flag: str = "--resume",
    trust=None,
) -> tuple[Path, str]:
    """``checkpoint_files.pick_resume`` with ``verify``: with a multi-rank ``topo`` this is
    collective and every rank picks the same (the candidate step is agreed by an all-reduce
    before each check)."""
    return checkpoint_files.pick_resume(
        root, step, flag=flag, agree=lambda s: _agree_max(s, topo),
        check=lambda path: verify(path, topo=topo, hashes=hashes, trust=trust),
    )  # fmt: skip


def _agree_max(value: int, topo: Topology | None) -> int:
    if topo is None or topo.world_group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=topo.device)
    return int(comm.world_all_reduce(t, topo=topo, op=dist.ReduceOp.MAX).item())


def load(
    path: Path,
    *,
    state: dict[str, Held],
    topo: Topology,
    verified: bool = False,
    trust=None,
) -> dict:
    """Read checkpoint ``path`` into ``state``'s tensors, in place (what this rank holds of
    each tensor, module docstring); returns the checkpoint's meta. Unless ``verified`` (by
    ``pick_resume``), the files are checked against the manifest first (collective when
    ``topo`` has several ranks)."""
    path = Path(path)
    problem = None if verified else verify(path, topo=topo, trust=trust)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    meta = read_meta(path)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(dcp_state(state, tp_rank=topo.tp_rank, tp=topo.tp),
                     checkpoint_id=str(path), process_group=topo.world_group,
                     no_dist=not _dist())  # fmt: skip
    except (Exception, CheckpointException) as e:  # DCP's own exception is a BaseException
        first = _root_cause(e)
        raise CheckpointError(
            f"checkpoint {path} could not be loaded into this model: {first}"
        ) from None
    rng = path / f"rng-rank-{topo.rank}.pt"
    if rng.exists():
        set_rng_state(torch.load(rng, weights_only=True), topo.device)
    return meta
