"""What every data-parallel algorithm offers the trainer, and the machinery shared by the
ones whose replicas differ (local SGD, DiLoCo, gossip).

The trainer holds one ``DPAlgorithm`` (``dp_algos.build``) and calls it at fixed points of
its step (``train/loop.py``): the engine is built on ``engine_topo`` and handed
``compression``; after the engine's ``finish()`` the trainer calls ``finish_grads(step)``;
the squared gradient norm goes into slot ``norm_slot`` of the ``norm_slots`` that the
statistics all-reduce carries; after the optimizer step it calls
``after_step(step)``. Checkpoints go through ``checkpoint_state`` / ``resume`` /
``loaded``.

``Synchronous`` is plain and compressed all-reduce: replicas stay identical, so the engine,
the norm and the checkpoint are the ordinary ones (plus the codec's error buffers).

``Replicas`` is the base of the others. The engine runs *inside* a replica (its dp axis
cut to the replica's K ranks by ``Topology.replica_grid``; K = 1 without ZeRO), so each
replica steps on its own gradient: every rank's loss is divided by the tokens of its
replica, the squared gradient norm is summed over the replica's ranks only (its own slot,
``norm_slot``, of the statistics all-reduce) and clipping uses it. The algorithm
then works on this rank's *shards* (``engine.shards()``: the parameters themselves, or
this rank's ZeRO shard of them) across replicas, on ``across``: the dp group of the R
ranks that hold the same shard in every replica.

Communication here (axis dp, on ``across``; P = bytes of this rank's shards, fp32):
``average`` all-reduces the shards in chunks of ``--bucket-mb``, P bytes counted (2 (R-1)/R
x P sent); ``consensus_distance`` the same plus one world all-reduce of a scalar;
``checkpoint_state`` one average too (the ``model/`` entries export and generate use).
All are issued by the training thread at the same step on every rank, so every rank of an
``across`` group issues the same collectives in the same order (NCCL's rule); tensors on
``topo.device``.

Checkpoints (one DCP folder, ``train/checkpoint.py``, verified by its manifest as any
other): replica r's parameters and optimizer state under ``replica-<r>/model/...`` and
``replica-<r>/optim/...``; its algorithm state under ``replica-<r>/algo/<name>/<key>``;
state the replicas share (DiLoCo's anchor and outer momentum, EF21's sum, PowerSGD's Q)
under ``algo/<name>/<key>``; and the replicas' average under ``model/<name>``, which is
what ``plait export`` and ``plait generate`` read. ``meta.json`` records the algorithm and
R. A run resumes with the same algorithm and R, continuing every replica exactly; a
replica algorithm may also start from a plain checkpoint (every replica loads it).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from plait import comm
from plait.data import IGNORE_INDEX
from plait.dp_algos import volume
from plait.dp_algos.compression import Int8Sum
from plait.dp_algos.config import DPAlgoConfig, compress_group, replicas_of
from plait.parallel.flat import FlatLayout
from plait.parallel.held import Held
from plait.parallel.tensor import shard_spec
from plait.topology import Axis, Topology

SHARED_KEYS = frozenset({"anchor", "outer_momentum", "ef21_total"})


class ResumeError(ValueError):
    """A checkpoint whose replicas this run cannot continue (one line)."""


class DPAlgorithm:
    """Plain data parallelism: the interface, doing nothing beyond the engine."""

    replicas_differ = False

    def __init__(self, cfg: DPAlgoConfig, *, topo: Topology, layout, seed: int = 0):
        self.cfg, self.topo, self.layout, self.seed = cfg, topo, layout, seed
        self.engine_topo = topo
        self.num_replicas = layout.dp  # R: ranks that hold the same shard of the model
        # one squared gradient norm for the whole run, in slot 0 of the statistics
        self.norm_slot, self.norm_slots = 0, 1
        self.compression = None
        self.engine = None

    def loss_tokens(self, sampler, step: int, global_count: int) -> int:
        """The targets each rank's loss is divided by: the global batch's
        (``global_count``) while replicas stay identical -- a share of the global mean."""
        return global_count

    def attach(self, engine, model) -> None:
        """Called once the engine exists (before any checkpoint is loaded)."""
        self.engine, self.model = engine, model
        self.names = {id(p): name for name, p in model.named_parameters()}

    def finish_grads(self, step: int) -> None:
        """After ``engine.finish()`` of step ``step`` (from 0)."""

    def after_step(self, step: int) -> None:
        """After the optimizer step of step ``step``."""

    def rewrites_shards(self, step: int) -> bool:
        """Whether ``after_step(step)`` writes every shard anew (a sync, a gossip mix) and
        so gathers the parameters itself (``engine.shards_changed``): the engine's own
        gather after the optimizer step is then skipped (``ZeroDataParallel.step``), one
        all-gather of the weights at ZeRO 1/2 saved each such step."""
        return False

    def consensus_distance(self) -> float | None:
        return None

    def meta(self) -> dict:
        return {"dp_algo": {**self.cfg.to_dict(), "replicas": self.num_replicas}}

    def checkpoint_state(self) -> dict:
        """What a checkpoint holds besides the engine's state (``Trainer.checkpoint_state``):
        ``prefix`` of this replica's model and optimizer entries and ``extra`` entries
        {key: Held} (``parallel/held.py``: what this rank holds of each)."""
        return {"prefix": "", "extra": {}}

    def resume(self, meta: dict) -> dict:
        """What to load of a checkpoint with ``meta``, as ``checkpoint_state`` says (the
        ``extra`` entries are live tensors, filled in place), or ResumeError."""
        saved = meta.get("dp_algo") or {}
        if saved.get("algo", "allreduce") != "allreduce":
            raise ResumeError(
                f"the checkpoint holds {saved.get('replicas')} differing replicas of "
                f"--dp-algo {saved['algo']}: resume with the same --dp-algo and replica "
                "count, or start from their average (plait export, then --init-hf)"
            )
        return {"prefix": "", "extra": {}}

    def loaded(self, step: int, meta: dict) -> None:
        """After a checkpoint of step ``step`` was loaded (``resume``'s tensors filled)."""

    # helpers for subclasses

    def _param_entries(self, section: str, state: dict) -> dict[str, Held]:
        """{f"{section}/{name}/{key}": what this rank holds} of per-parameter state
        {name: {key: tensor shaped like the parameter, or like this rank's shard of it}},
        as live views: a save writes them, a load fills them."""
        params = {name: p for name, p, _ in self.engine.shards()}
        out = {}
        for name, d in state.items():
            p = params[name]
            for key, t in d.items():
                out[f"{section}/{name}/{key}"] = (
                    Held.whole(t.reshape(p.shape), shard_spec(p)) if t.numel() == p.numel()
                    else self.engine.held_of(p, t)
                )  # fmt: skip
        return out


class Synchronous(DPAlgorithm):
    """``--dp-algo allreduce``, optionally ``--compress``: replicas stay identical."""

    def __init__(self, cfg: DPAlgoConfig, *, topo: Topology, layout, seed: int = 0,
                 names: dict[int, str] | None = None):  # fmt: skip
        super().__init__(cfg, topo=topo, layout=layout, seed=seed)
        if cfg.compress is not None:
            from plait.dp_algos.compressed_grads import Compression

            sender = f"dp{topo.dp_rank}.tp{topo.tp_rank}"  # QSGD's stream (compressed_grads)
            self.compression = Compression(cfg, seed=seed, names=names or {}, sender=sender)
            self.num_replicas, self.k = compress_group(layout)

    def attach(self, engine, model) -> None:
        super().attach(engine, model)
        if self.compression is None:
            return
        self.compression.names.update(self.names)
        # the codec's state up front (zeros, as it would start): a checkpoint loads into it
        codec = self.compression.codec
        for name, p, shard in engine.shards():
            t = shard if self.layout.zero >= 2 else p.detach()
            if hasattr(codec, "local"):  # EF21
                codec._state(name, t)
            if hasattr(codec, "error") and codec.matrix_shape(tuple(t.shape)) is not None:
                rows, cols = codec.matrix_shape(tuple(t.shape))
                codec.error[name] = torch.zeros(rows, cols, dtype=torch.float32, device=t.device)
                codec._q(name, cols, codec.r(tuple(t.shape)), t.device)

    def finish_grads(self, step: int) -> None:
        if self.compression is not None:
            self.compression.set_step(step + 1)  # QSGD draws the next step's stream

    def _sender(self) -> int:
        return self.topo.dp_rank // self.k

    def checkpoint_state(self) -> dict:
        if self.compression is None:
            return super().checkpoint_state()
        return {"prefix": "", "extra": self._codec_entries()}

    def _codec_entries(self) -> dict[str, Held]:
        """The codec's state: per replica (EF21's local estimate, PowerSGD's error), shared
        (EF21's sum) and per tp rank (PowerSGD's Q)."""
        state = self._codec_state()
        per = {n: {k: t for k, t in d.items() if k not in SHARED_KEYS} for n, d in state.items()}
        shared = {n: {k: t for k, t in d.items() if k in SHARED_KEYS} for n, d in state.items()}
        out = self._param_entries(f"replica-{self._sender()}/algo", per)
        out.update(self._param_entries("algo", shared))
        out.update(self._raw_entries())
        return out

    def _codec_state(self) -> dict:
        """{name: {key: tensor shaped like this rank's shard of the parameter}}."""
        shards = {name: shard for name, _, shard in self.engine.shards()}
        if self.layout.zero < 2:
            shards = {name: p.detach() for name, p, _ in self.engine.shards()}
        out = {}
        for name, d in self.compression.state().items():
            out[name] = {k: t.reshape(shards[name].shape) for k, t in d.items()}
        return out

    def _raw_entries(self) -> dict[str, Held]:
        """PowerSGD's Q: shaped (columns, rank) of this rank's tp shard, so kept per tp rank
        (a layout with another tp restarts it from the seed)."""
        q = getattr(self.compression.codec, "q", None) or {}
        return {f"algo/{name}/powersgd_q.tp{self.topo.tp_rank}of{self.topo.tp}": Held.whole(t)
                for name, t in q.items()}  # fmt: skip

    def resume(self, meta: dict) -> dict:
        plan = super().resume(meta)
        saved = meta.get("dp_algo") or {}
        if self.compression is None or saved.get("compress") != self.cfg.compress:
            return plan  # another codec (or none): its state starts afresh
        if saved.get("replicas") != self.num_replicas:
            return plan
        return {"prefix": "", "extra": self._codec_entries()}  # loaded in place

    def loaded(self, step: int, meta: dict) -> None:
        if self.compression is not None:
            self.compression.set_step(step)


def _split_key(key: str) -> tuple[str, str, str]:
    """``replica-3/algo/blocks.0.attn.q.weight/ef21_local`` -> ("replica-3/algo", name,
    "ef21_local") (parameter names hold no slash)."""
    head, _, what = key.rpartition("/")
    section, _, name = head.rpartition("/")
    return section, name, what


class Replicas(DPAlgorithm):
    """Base of the algorithms whose replicas differ (module docstring)."""

    replicas_differ = True

    def is_sync(self, step: int) -> bool:
        """Whether step ``step`` ends in a synchronisation (``volume.is_sync``, the one
        rule the runtime and the byte formulas share)."""
        return volume.is_sync(self.cfg, step)

    def rewrites_shards(self, step: int) -> bool:
        return self.is_sync(step)  # local SGD's and DiLoCo's syncs; gossip: every step

    def __init__(self, cfg: DPAlgoConfig, *, topo: Topology, layout, seed: int = 0):
        super().__init__(cfg, topo=topo, layout=layout, seed=seed)
        self.num_replicas, self.k = replicas_of(layout)
        self.index = topo.dp_rank // self.k  # this rank's replica
        self.replica_topo, self.across = topo.replica_grid(self.k)  # collective
        self.engine_topo = self.replica_topo
        self.norm_slot, self.norm_slots = self.index, self.num_replicas  # one per replica
        self.chunk_bytes = max(1, int(layout.bucket_mb * 2**20))

    def loss_tokens(self, sampler, step: int, global_count: int) -> int:
        """Each replica steps on its own mean: the targets of its rows of the global batch
        (replica b holds dp ranks [b*k, (b+1)*k), so rows [b*G/R, (b+1)*G/R))."""
        if sampler.mask is None:
            return global_count // self.num_replicas
        _, targets = sampler.local_batch(step, dp_rank=self.index, dp=self.num_replicas)
        return int((targets != IGNORE_INDEX).sum())

    def attach(self, engine, model) -> None:
        super().attach(engine, model)
        self.shards = [shard for _, _, shard in engine.shards()]
        self.shard_names = [name for name, _, _ in engine.shards()]
        # the shared point of the last sync (local SGD with --compress, DiLoCo); None here
        self.anchor: list[torch.Tensor] | None = None
        self.int8 = (
            Int8Sum(self.num_replicas, seed=self.seed) if self.cfg.sync_codec == "int8" else None
        )

    def peer(self, replica: int) -> int:
        """Global rank of the rank holding this rank's place in replica ``replica``."""
        return self.across.group_ranks[Axis.DP][replica]

    # flat chunks of the shards --------------------------------------------------------

    def chunks(self, tensors=None) -> list[list[torch.Tensor]]:
        """The shards (or ``tensors``) cut into runs of about ``--bucket-mb`` (one message
        each)."""
        out, run, size = [], [], 0
        for t in self.shards if tensors is None else tensors:
            run.append(t)
            size += t.numel() * t.element_size()
            if size >= self.chunk_bytes:
                out.append(run)
                run, size = [], 0
        if run:
            out.append(run)
        return out

    def pack(self, run: list[torch.Tensor]) -> torch.Tensor:
        """One flat tensor of the run, on the device (offloaded optimizer state is on the
        host; collectives take device tensors)."""
        return FlatLayout.of(run).pack(run, device=self.topo.device)

    @staticmethod
    def unpack(flat: torch.Tensor, run: list[torch.Tensor]) -> None:
        FlatLayout.of(run).unpack(flat, run)

    def sum_across(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The sum over replicas of each flat tensor (async all-reduces, then waited)."""
        handles = [
            comm.all_reduce(t, topo=self.across, axis=Axis.DP, async_op=True) for t in tensors
        ]
        comm.wait(handles, topo=self.across, what="all_reduce", axis="dp")
        return tensors

    @torch.no_grad()
    def average(self, extra: list[torch.Tensor] = ()) -> None:
        """Every replica's shards (and the ``extra`` tensors, after them) <- their mean
        over the replicas."""
        runs = self.chunks([*self.shards, *extra])
        flats = self.sum_across([self.pack(run) for run in runs])
        for run, flat in zip(runs, flats):
            self.unpack(flat.div_(self.num_replicas), run)
        self.engine.shards_changed()

    @torch.no_grad()
    def mean_changes(
        self, new: list[torch.Tensor], old: list[torch.Tensor], step: int
    ) -> list[torch.Tensor]:
        """The replicas' mean of ``new - old`` (one pair per shard, in the shards' order:
        the same shapes on every rank of ``across``), sent as ``--compress`` asks: fp32
        (none), bf16, or int8 (``compression.Int8Sum``: one MAX all-reduce of the block
        scales, then one int8 all-reduce of the levels, per chunk). New fp32 tensors; the
        differences are formed a chunk at a time, so what it adds at its peak is the
        packed chunks (as ``average``). Collectives in chunk order, the same on every
        rank; int8's draws are keyed by the sync's step, this replica and the shard's
        name."""
        codec = self.cfg.sync_codec
        index = {id(t): i for i, t in enumerate(new)}
        runs = self.chunks(new)
        out: list[torch.Tensor | None] = [None] * len(new)

        def diffs(run):
            return [(t - old[index[id(t)]]).reshape(-1).to(self.topo.device) for t in run]

        if codec != "int8":
            layouts = [FlatLayout.of(run) for run in runs]
            flats = [layout.pack(diffs(run)) for layout, run in zip(layouts, runs)]
            if codec == "bf16":
                flats = [f.to(torch.bfloat16) for f in flats]
            for run, layout, flat in zip(runs, layouts, self.sum_across(flats)):
                flat = flat.float().div_(self.num_replicas)
                for t, view in zip(run, layout.views(flat)):
                    out[index[id(t)]] = view.view_as(t)
            return out
        for run in runs:
            xs = diffs(run)
            scales = self.int8.scales_of(xs)
            comm.all_reduce(scales, topo=self.across, axis=Axis.DP, op=dist.ReduceOp.MAX)
            items = [(self.shard_names[index[id(t)]], x) for t, x in zip(run, xs)]
            levels = self.int8.encode_all(items, scales, step=step, sender=self.index)
            comm.all_reduce(levels, topo=self.across, axis=Axis.DP)
            for t, total in zip(run, self.int8.decode_all(levels, scales, xs)):
                out[index[id(t)]] = total.div_(self.num_replicas).view_as(t)
        return out

    @torch.no_grad()
    def mean_shards(self) -> list[torch.Tensor]:
        """The replicas' mean of each shard (new tensors; the shards are untouched)."""
        runs = self.chunks()
        flats = self.sum_across([self.pack(run) for run in runs])
        out = []
        for run, flat in zip(runs, flats):
            flat.div_(self.num_replicas)
            out += [view.view_as(t) for t, view in zip(run, FlatLayout.of(run).views(flat))]
        return out

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """sqrt((1/R) sum_i |x_i - mean|^2) over the whole model (Kong et al. 2021's
        consensus distance); a weight held by several ranks of a replica (tp-replicated,
        a tied copy) counts once. Collective over every rank."""
        sq = torch.zeros((), dtype=torch.float64, device=self.topo.device)
        for (_, p, shard), mean in zip(self.engine.shards(), self.mean_shards()):
            if self.engine.owns_grad(p):
                sq += (shard - mean).double().pow(2).sum()
        comm.world_all_reduce(sq, topo=self.topo)
        return math.sqrt(max(0.0, sq.item()) / self.num_replicas)

    # checkpoints ----------------------------------------------------------------------

    def algo_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{name: {key: shard-shaped tensor}} the algorithm keeps (subclasses)."""
        return {}

    def checkpoint_state(self) -> dict:
        shards = self.engine.shards()  # the replicas' average first (collective), then ...
        extra = {f"model/{name}": self.engine.held_of(p, mean)
                 for (name, p, _), mean in zip(shards, self.mean_shards())}  # fmt: skip
        extra.update(self._algo_entries())  # ... this replica's and the shared state
        return {"prefix": f"replica-{self.index}/", "extra": extra}

    def _algo_entries(self) -> dict[str, Held]:
        state = self.algo_state()
        per = {n: {k: t for k, t in d.items() if k not in SHARED_KEYS} for n, d in state.items()}
        shared = {n: {k: t for k, t in d.items() if k in SHARED_KEYS} for n, d in state.items()}
        out = self._param_entries(f"replica-{self.index}/algo", per)
        out.update(self._param_entries("algo", shared))
        return out

    def resume(self, meta: dict) -> dict:
        saved = meta.get("dp_algo") or {}
        if saved.get("algo", "allreduce") == "allreduce":
            self._resumed = None  # a plain checkpoint: every replica starts from it
            return {"prefix": "", "extra": {}}
        if saved.get("algo") != self.cfg.algo or saved.get("replicas") != self.num_replicas:
            raise ResumeError(
                f"the checkpoint holds {saved.get('replicas')} replicas of --dp-algo "
                f"{saved.get('algo')}; this run has {self.num_replicas} of --dp-algo "
                f"{self.cfg.algo}: resume with the same, or start from their average "
                "(plait export, then --init-hf)"
            )
        if self.cfg.algo == "local-sgd" and (saved.get("compress") is None) != (
            self.cfg.compress is None
        ):  # a compressed sync needs the anchor, which only a compressed run keeps
            raise ResumeError(
                f"the checkpoint's local SGD ran with --compress {saved.get('compress')}, this "
                f"run with --compress {self.cfg.compress}: resume with the checkpoint's setting"
            )
        targets = self._algo_entries()  # live: loaded in place
        self._resumed = bool(targets)
        return {"prefix": f"replica-{self.index}/", "extra": targets}

    def loaded(self, step: int, meta: dict) -> None:
        """The algorithm state came in place; what it did not hold starts afresh."""
        self.fresh_state(loaded=bool(getattr(self, "_resumed", False)))
        self._resumed = None

    @torch.no_grad()
    def fresh_state(self, *, loaded: bool) -> None:
        """After a resume: state the checkpoint did not hold starts from the parameters --
        from a plain checkpoint, its weights are the anchor (the shared point)."""
        if self.anchor is not None and not loaded:
            for a, shard in zip(self.anchor, self.shards):
                a.copy_(shard)
