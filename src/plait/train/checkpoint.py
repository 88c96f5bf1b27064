"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), written atomically.

Layout of ``OUT/checkpoints/step-00000100/``: the DCP files (``.metadata``, ``*.distcp``)
holding every parameter and its optimizer state under the parameter's global name, as the
*full* (unsharded) tensor; ``meta.json`` (step, loss scale, model config); and
``rng-rank-K.pt`` per rank. Because tensors are stored whole and cut on load by the same
sharding functions the runtime uses, a checkpoint loads into any layout: different dp, tp,
pp or ZeRO stage. DCP writes each tensor once even when several ranks hold it.

Atomicity: everything is written into ``step-N.tmp``; once all ranks are done, rank 0
renames it to ``step-N``. A crash mid-write leaves only a ``.tmp`` folder, which is
ignored and cleaned up by the next save: the previous checkpoint stays intact.

Known limit: every rank materialises full tensors of the parameters it holds while saving
and loading; fine at the sizes plait trains on CPU, wasteful for very large tp/ZeRO-3 runs.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from plait import comm
from plait.parallel.tensor import full_shape, shard_spec, tp_gather, tp_shard
from plait.topology import Topology


class CheckpointError(RuntimeError):
    """A missing, incomplete or unreadable checkpoint (message is one line)."""


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def checkpoint_dirs(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp")
    ]
    return sorted(found, key=lambda p: p.name)


def latest(root: Path) -> Path | None:
    dirs = checkpoint_dirs(root)
    return dirs[-1] if dirs else None


def read_meta(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {path} is incomplete or corrupt (meta.json: {e.__class__.__name__}); "
            "delete it to resume from the one before"
        ) from None


def full_state(model, optim_state: dict[str, dict[str, torch.Tensor]], topo: Topology) -> dict:
    """Flat DCP state: ``model/<name>`` and ``optim/<name>/<key>`` as full tensors."""
    state = {}
    for name, p in model.named_parameters():
        spec = shard_spec(p)
        state[f"model/{name}"] = tp_gather(p.detach(), spec, topo=topo)
        for key, t in optim_state.get(name, {}).items():
            state[f"optim/{name}/{key}"] = (
                tp_gather(t, spec, topo=topo) if t.dim() else t.reshape(1)
            )
    return state


def save(
    root: Path,
    step: int,
    *,
    model,
    optim_state: dict,
    meta: dict,
    topo: Topology,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` (collective: every rank calls it)."""
    root = Path(root)
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    if topo.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    comm.barrier(topo=topo)
    state = full_state(model, optim_state, topo)
    with warnings.catch_warnings():  # DCP warns that one process means no_dist; we know
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not _dist())
    torch.save({"torch": torch.get_rng_state()}, tmp / f"rng-rank-{topo.rank}.pt")
    comm.barrier(topo=topo)
    if topo.rank == 0:
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in checkpoint_dirs(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    comm.barrier(topo=topo)
    return final


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(
    path: Path,
    *,
    model,
    optim_state: dict | None,
    topo: Topology,
) -> dict:
    """Load ``path`` into ``model`` (and into the tensors of ``optim_state``, in place,
    which must already have the local shapes); returns the checkpoint's meta."""
    path = Path(path)
    meta = read_meta(path)
    targets = {}
    params = dict(model.named_parameters())
    for name, p in params.items():
        spec = shard_spec(p)
        targets[f"model/{name}"] = torch.empty(full_shape(p.shape, spec, topo.tp), dtype=p.dtype)
        for key, t in (optim_state or {}).get(name, {}).items():
            shape = full_shape(t.shape, spec, topo.tp) if t.dim() else (1,)
            targets[f"optim/{name}/{key}"] = torch.empty(shape, dtype=t.dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(targets, checkpoint_id=str(path), no_dist=not _dist())
    except (Exception, CheckpointException) as e:  # DCP's own exception is a BaseException
        first = _root_cause(e)
        raise CheckpointError(
            f"checkpoint {path} could not be loaded into this model: {first}"
        ) from None
    with torch.no_grad():
        for name, p in params.items():
            spec = shard_spec(p)
            p.copy_(tp_shard(targets[f"model/{name}"], spec, tp_rank=topo.tp_rank, tp=topo.tp))
            for key, t in (optim_state or {}).get(name, {}).items():
                full = targets[f"optim/{name}/{key}"]
                t.copy_(
                    tp_shard(full, spec, tp_rank=topo.tp_rank, tp=topo.tp)
                    if t.dim()
                    else full.reshape(())
                )
    rng = path / f"rng-rank-{topo.rank}.pt"
    if rng.exists():
        torch.set_rng_state(torch.load(rng, weights_only=True)["torch"])
    return meta
