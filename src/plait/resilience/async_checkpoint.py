"""Asynchronous checkpoints (``--async-checkpoint``): the same folder, DCP files and manifest
as ``checkpoint.save`` writes, written by a side thread on each rank that issues no
collective, so training goes on while the files are written.

Communication: none through process groups (so a side thread may do it: DESIGN.md section
8). The training thread copies this rank's share of the state to host memory and returns.
Each tensor is written by the workers of the first replica that count it in the gradient
norm, each its own part (``engine.held_state``: the whole tensor, or its ZeRO shard inside
the replica's stage group), so no planning collective is needed to deduplicate (the
scalar AdamW ``step`` each shard holder writes is de-duplicated by rank 0's plan). The side thread runs the steps of ``dcp.save`` without its collectives: its
local plan, the file prefix ``__{rank}_`` the global plan would give it, the writes
(fsynced), then hashes its files into ``.manifest-rank-K.json`` and posts its plan and
write results to the coordinator's store. Rank 0's thread waits for every rank's post,
builds DCP's ``.metadata`` from the plans, and commits as every checkpoint is committed
(``checkpoint._commit``: ``meta.json``, the manifest last, the folder renamed).

A post is JSON, signed like every message on the store (``signed_store.py``), and read
back field by field into DCP's dataclasses (``post_of`` / ``plan_of``): nothing read from
the store is unpickled, and a post that does not verify or parse is never used (rank 0
then gives up on that checkpoint as if the rank had not written).

Atomic as the synchronous path: until the rename there is only ``step-N.tmp``. A rank that
dies mid-write leaves it so; rank 0 gives up when its generation is dropped (or after the
collective timeout), and the previous checkpoint stays the newest. One write is in flight
per worker: a save waits for the previous one. Loading needs nothing new
(``checkpoint.load`` reads any DCP folder; ``verify`` checks the manifest).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import threading
import time
from pathlib import Path

import torch

from plait.parallel.held import Held
from plait.train import checkpoint, manifest

POST = "ft/ckpt/{}/{}/{}"  # generation, step, rank: JSON of (local plan, write results)


class AsyncSaver:
    """One worker's asynchronous checkpoint writer for one generation."""

    def __init__(self, *, store, generation: int, rank: int, world: int, root: Path,
                 keep: int, timeout: float):  # fmt: skip
        self.store, self.generation, self.rank, self.world = store, generation, rank, world
        self.root, self.keep, self.timeout = Path(root), keep, timeout
        self._thread: threading.Thread | None = None
        self._abandon = threading.Event()
        self.error: BaseException | None = None
        self.committed: list[int] = []

    def save(self, step: int, state: dict[str, Held], meta: dict) -> None:
        """Hand ``state`` (what this rank writes, by checkpoint key) over to the side thread:
        the training thread only copies it to host memory."""
        self.wait()
        staged = {k: dataclasses.replace(h, flat=h.flat.detach().to("cpu", copy=True))
                  for k, h in state.items()}  # fmt: skip
        rng = torch.get_rng_state()
        self._thread = threading.Thread(
            target=self._run, args=(step, staged, meta, rng), name="plait-ckpt", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def abandon(self) -> None:
        """The generation is dropped: stop waiting for posts that will not come."""
        self._abandon.set()

    def _run(self, step: int, state, meta: dict, rng) -> None:
        tmp = self.root / f"step-{step:08d}.tmp"
        try:
            self._write(tmp, step, state, rng)
            if self.rank == 0:
                self._commit(tmp, step, meta)
        except BaseException as e:  # noqa: BLE001 - a side thread: kept for the caller
            self.error = e
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)

    def _write(self, tmp: Path, step: int, state, rng) -> None:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.filesystem import _StoragePrefix

        tmp.mkdir(parents=True, exist_ok=True)
        writer = FileSystemWriter(str(tmp))
        digests: dict[str, str] = {}  # taken while writing: nothing is read back
        writer.fs = manifest.hashing_file_system(tmp, digests)
        planner = DefaultSavePlanner(flatten_state_dict=False)
        state = checkpoint.dcp_state(state, tp_rank=0, tp=1)  # no tensor parallelism here
        planner.set_up_planner(state_dict=state, storage_meta=None, is_coordinator=self.rank == 0)
        writer.set_up_storage_writer(self.rank == 0)
        plan = writer.prepare_local_plan(planner.create_local_plan())
        final = planner.finish_plan(
            type(plan)(
                items=plan.items,
                storage_data=_StoragePrefix(f"__{self.rank}_"),
                planner_data=plan.planner_data,
            )  # fmt: skip
        )
        future = writer.write_data(final, planner)
        future.wait()
        results = future.value()
        rng_name = f"rng-rank-{self.rank}.pt"
        torch.save({"torch": rng}, tmp / rng_name)
        manifest.fsync(tmp / rng_name)
        names = [r.storage_data.relative_path for r in results] + [rng_name]
        part = json.dumps(manifest.entries(tmp, names, known=digests)).encode()
        manifest.write_synced(tmp / f"{checkpoint.PART}{self.rank}.json", part)
        post = json.dumps(post_of(plan, results))
        self.store.set(POST.format(self.generation, step, self.rank), post)

    def _commit(self, tmp: Path, step: int, meta: dict) -> None:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        keys = [POST.format(self.generation, step, r) for r in range(self.world)]
        deadline = time.monotonic() + self.timeout
        posts = {}
        while len(posts) < self.world:
            for r, key in enumerate(keys):
                if r not in posts:
                    payload = self.store.get(key)  # verified, or None
                    post = plan_of(payload, rank=r) if payload is not None else None
                    if post is not None:
                        posts[r] = post
            if len(posts) == self.world:
                break
            if self._abandon.is_set() or time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint step {step}: not every rank wrote its share")
            time.sleep(0.01)
        posts = [posts[r] for r in range(self.world)]
        for key in keys:
            self.store.delete_key(key)
        planner = DefaultSavePlanner(flatten_state_dict=False)
        _, metadata = planner.create_global_plan([p for p, _ in posts])
        writer = FileSystemWriter(str(tmp))
        writer.set_up_storage_writer(True)
        writer.finish(metadata=metadata, results=[r for _, r in posts])
        final = self.root / f"step-{step:08d}"
        checkpoint._commit(tmp, final, {**meta, "step": step}, world=self.world)
        for stale in self.root.glob("step-*.tmp"):
            if stale.name < tmp.name:
                shutil.rmtree(stale, ignore_errors=True)
        for old in checkpoint.checkpoint_dirs(self.root)[: -self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        self.committed.append(step)


def post_of(plan, results) -> dict:
    """What rank 0 needs of a rank's local plan and write results, as JSON: each box it
    writes (name, offsets, sizes, the tensor's size and dtype) and where it went."""
    items = []
    for item in plan.items:
        data = item.tensor_data
        assert data is not None and item.index.offset is not None  # boxes only (dcp_state)
        items.append({"fqn": item.index.fqn, "offsets": list(data.chunk.offsets),
                      "sizes": list(data.chunk.sizes), "size": list(data.size),
                      "dtype": str(data.properties.dtype).removeprefix("torch.")})  # fmt: skip
    writes = [{"fqn": r.index.fqn, "offsets": list(r.index.offset), "bytes": r.size_in_bytes,
               "file": r.storage_data.relative_path, "offset": r.storage_data.offset,
               "length": r.storage_data.length,
               "transforms": list(r.storage_data.transform_descriptors or [])}
              for r in results]  # fmt: skip
    return {"items": items, "writes": writes}


def plan_of(payload: bytes, *, rank: int):
    """(SavePlan, [WriteResult]) from rank ``rank``'s post; None unless every field has the
    type ``post_of`` gives it, every dtype is a torch dtype and every file one this rank
    writes (``__{rank}_N.distcp``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )
    from torch.distributed.checkpoint.storage import WriteResult

    try:
        post = json.loads(payload)
        items, writes = post["items"], post["writes"]
        plan = SavePlan(items=[
            WriteItem(
                index=MetadataIndex(_text(i["fqn"]), torch.Size(_dims(i["offsets"]))),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(_dims(i["offsets"])),
                                               sizes=torch.Size(_dims(i["sizes"]))),
                    properties=TensorProperties(dtype=_dtype(i["dtype"])),
                    size=torch.Size(_dims(i["size"])),
                ),
            )
            for i in items
        ])  # fmt: skip
        file = re.compile(rf"__{rank}_\d+\.distcp")
        results = [
            WriteResult(
                index=MetadataIndex(_text(w["fqn"]), torch.Size(_dims(w["offsets"]))),
                size_in_bytes=_dims([w["bytes"]])[0],
                storage_data=_StorageInfo(
                    relative_path=_text(w["file"], file), offset=_dims([w["offset"]])[0],
                    length=_dims([w["length"]])[0],
                    transform_descriptors=[_text(t) for t in w["transforms"]] or None,
                ),
            )
            for w in writes
        ]  # fmt: skip
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return plan, results


def _text(value, pattern: re.Pattern | None = None) -> str:
    if not isinstance(value, str) or (pattern is not None and not pattern.fullmatch(value)):
        raise ValueError(f"not a name here: {value!r:.40}")
    return value


def _dims(values) -> list[int]:
    if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
        raise ValueError("not a list of sizes")
    return values


def _dtype(name) -> torch.dtype:
    dtype = getattr(torch, _text(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {name!r:.40}")
    return dtype


def owned_state(trainer) -> dict[str, Held]:
    """What this rank writes (module docstring): what it holds (``engine.held_state``) of
    the parameters it counts in the gradient norm, and of their optimizer state."""
    counted = {name for name, p in trainer.model.named_parameters()
               if any(p is q for q in trainer.engine.counted)}  # fmt: skip
    return {key: held for key, held in trainer.engine.held_state().items()
            if key.split("/", 2)[1] in counted}  # fmt: skip
