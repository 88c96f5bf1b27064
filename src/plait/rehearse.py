"""Rehearse one rank's real training program at any size on a CPU (``plait rehearse``).

Communication: none leaves this process. Each rank is rehearsed on its own, one after
another, under PyTorch's fake process group (``init_process_group("fake")``: every
collective and every ``batch_isend_irecv`` completes at once and moves nothing) with
every tensor a fake one (``FakeTensorMode``: shapes and dtypes, no storage), so the
rank's program issues exactly the calls a real run's would -- through ``comm.py``, which
logs each one (``CommStats.log``: axis, dtype, bytes, in the order issued; a batch of
point-to-point messages as one entry, and the waits on it) -- and nothing can deadlock
here. Whether the point-to-point batches recorded from every stage's rank could deadlock
under NCCL is asked of ``nccl_p2p.resolve``, the model ``schedules.validate`` uses
(``check_p2p``).

What runs is the ``Trainer`` of ``train/loop.py`` -- build, then two optimizer steps
through ``Trainer.step`` -- with two differences from ``plait train``: the batches are
synthetic (``SyntheticBatches``: zeros of the real shapes; no data preparation, no
tokenizer, the vocabulary of the model preset), and the values a step reads back on the
host are zeros (``comm.host_values``: a fake tensor has none); and a pipeline's send-only
batches are let go after the next compute, as completed sends are (the fake group's
works never report completion: every send-only batch would be held to the step's end,
0.70 GiB of 175B's first stage's warm-up activations). Then the rank saves a
checkpoint through ``Trainer.save`` and loads it back through ``checkpoint.load`` -- DCP's
planners on this rank's boxes, a storage that counts bytes instead of writing files
(``RecordedCheckpoint``: what it leaves out is said there) -- into a temporary folder.

Memory: ``torch.distributed._tools.mem_tracker.MemTracker`` sees every storage the rank
allocates and frees (a fake tensor's storage has its real size) and labels new ones by
where they are made (forward, backward, optimizer step). ``RankMemory`` adds plait's own
roles, looked up at every new peak from the trainer's objects: parameters (this rank's
shards under ZeRO-3), gradients, optimizer state, and buffers (ZeRO-3's gathered units,
gathers in flight and packed gradients awaiting their reduce-scatter, module buffers);
what is left is activations (made in a forward), temporaries (made in a backward or an
optimizer step, and a pipeline stage's received output gradients, wherever their
receive was posted) and other state made at build. The peak of each phase (build, step 1,
step 2, save, load) is reported with its split; the build's from the model's move to the
device on (``Trainer.placed``: before it, the parameters were initialised on the host).
Under ``--offload-optimizer`` AdamW's state and the fp32 masters live on the host
(``HOST``): every figure here is the device's, without them. Storages on ``meta`` (a ZeRO-3 model is
built there) hold no bytes and are not counted.

A step's micro-batches repeat: a pipeline rank runs the fewest whose schedule passes
through every state of the full step's (``schedules.shortest_equivalent``: as many
activations in flight at each kind of compute, before and after its first gradients,
the same messages unread and outputs unsent) -- 17 of 192 on 175B's first stage of 16,
3 on its last; GPipe, which holds all m, runs them all (``shortened_layout``) -- so its peaks are the full step's (tests: exactly, per phase and
category). Its step 2 calls are the full step's: the executor replays the full
schedule's items through its own posting, waiting and unpacking, each compute logging
the calls its kind (op, chunk; first, middle or last micro-batch) logged in the shortened
step (``_full_step_calls``), so the point-to-point check runs on the full step's
batches. ``--full-steps`` runs every micro-batch.

Fake tensors live on the CPU here, so the rank runs the program of its CPU twin with
three GPU choices taken: fused AdamW (``optim.build_adamw``), one host read per step, and
PyTorch's RMSNorm kernels (``transformer.rehearsing_gpu_kernels``).
Autocast follows the CPU's rules (matmuls in bf16, as on CUDA).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import tempfile
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from plait.dp_algos import volume
from plait.topology import Axis, Call, Topology, coords

CATEGORIES = ("parameters", "gradients", "optimizer", "buffers", "activations",
              "temporaries", "other")  # fmt: skip
HOST = "host"  # offloaded optimizer state: beside the device's categories, not in its peak
PHASES = ("build", "step 1", "step 2", "save", "load")
ACT_PEAK = "activations, own peak"  # ``compared``'s row: the activations at their own peak


class SyntheticBatches:
    """Stands in for ``GlobalBatchSampler``: every step's rows are zeros of the real
    shapes ((rows, T) inputs and targets, int64), every target takes a loss. A shortened
    rehearsal (``shortened_layout``) makes the rows of the full step's ``made_batch``
    and hands the step the first ``global_batch``'s: a step holds its whole batch, so its
    memory is the full step's."""

    mask = None

    def __init__(self, *, global_batch: int, seq_len: int, made_batch: int | None = None):
        self.global_batch, self.seq_len = global_batch, seq_len
        self.made_batch = made_batch or global_batch

    def rows(self, step: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (hi - lo, self.seq_len)
        return torch.zeros(shape, dtype=torch.int64), torch.zeros(shape, dtype=torch.int64)

    def local_batch(self, step: int, *, dp_rank: int, dp: int):
        per, made = self.global_batch // dp, self.made_batch // dp
        inputs, targets = self.rows(step, dp_rank * made, (dp_rank + 1) * made)
        return inputs[:per], targets[:per]

    def target_count(self, step: int) -> int:
        return self.global_batch * self.seq_len


def _trainer_class(made_batch: int | None = None, placed=None):
    """The rehearsal's ``Trainer``; ``placed()`` is called when the build has put the
    model on the device (``Trainer.placed``)."""
    from plait.train.loop import Trainer

    class RehearsalTrainer(Trainer):
        """The ``Trainer``, reading synthetic batches instead of a prepared corpus."""

        def open_data(self):
            batches = SyntheticBatches(global_batch=self.cfg.layout.global_batch_size,
                                       seq_len=self.cfg.model.seq_len,
                                       made_batch=made_batch)  # fmt: skip
            return batches, []

        def placed(self):
            if placed is not None:
                placed()

    return RehearsalTrainer


# -- memory ------------------------------------------------------------------------------


def _stable_roles(trainer) -> list[tuple[str, torch.Tensor]]:
    """(category, tensor) of the tensors that keep their role from the build on:
    parameters (this rank's rows under ZeRO-3), ZeRO-3's unit buffers and module buffers,
    optimizer state (AdamW's lazily made state is labelled by ``MemTracker`` itself, as
    it is made inside the optimizer's step)."""
    engine, model = trainer.engine, trainer.model
    out = []
    opt = getattr(engine, "optimizer", None)
    torch_opt = getattr(opt, "optimizer", opt)
    if torch_opt is not None:
        offload = getattr(opt, "offload", False)  # the state and masters on the host
        role = HOST if offload else "optimizer"
        out += [(role, t) for s in torch_opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor)]  # fmt: skip
        if offload:
            out += [(HOST, t) for t in opt.targets.values()]
    units = getattr(engine, "units", None)
    if units is not None:  # ZeRO-3: the rows are the parameters, the gathered ones buffers
        out += [("parameters", u.row) for u in units.units]
        out += [("buffers", b) for u in units.units for b in u.buffers]
    out += [("parameters", p) for p in model.parameters()]
    out += [("buffers", t) for t in model.buffers()]
    return out


def _passing_roles(trainer, params: list) -> list[tuple[str, torch.Tensor]]:
    """(category, tensor) of the tensors whose role lasts part of a step: gradients
    (autograd's ``p.grad``, a bucket's flat buffer, a reduce-scatter's shard), buffers
    in flight (ZeRO-3 gathers, packed gradients awaiting their reduce-scatter) and a
    pipeline stage's received output gradients, temporaries wherever their receive was
    posted (often in a forward): the backward's input, held through it."""
    from plait.parallel.zero import ReduceScatterGrads

    engine = trainer.engine
    out = [("gradients", p.grad) for p in params if p.grad is not None]
    reducer = getattr(engine, "grads", None)
    for b in getattr(reducer, "buckets", ()):
        if b.flat is not None:
            out.append(("gradients", b.flat))
        if isinstance(reducer, ReduceScatterGrads) and isinstance(b.handle, tuple):
            # a reduce-scatter in flight: (work, input, shard, last)
            out += [("buffers", b.handle[1]), ("gradients", b.handle[2])]
        elif isinstance(b.handle, tuple):  # a codec's messages in flight (compressed_grads)
            out += [("buffers", t) for t in b.handle[1:] if isinstance(t, torch.Tensor)]
    units = getattr(engine, "units", None)
    for u in units.units if units is not None else ():
        if u.pending is not None:
            out += [("buffers", t) for t in (u.pending.out, u.pending.src) if t is not None]
    algo = getattr(trainer, "dp_algo", None)
    if algo is not None:  # its state, made in the build or (PowerSGD's error) in a step
        codec = getattr(algo, "compression", None)
        own = getattr(algo, "algo_state", dict)()
        states = [own, codec.state() if codec is not None else {}]
        out += [("other", t) for state in states for d in state.values() for t in d.values()]
    received = getattr(getattr(trainer, "runner", None), "received_grads", None)
    if received is not None:  # a pipeline stage's output gradients: the backward's input
        out += [("temporaries", t) for t in received()]
    return out


def _memtracker_class():
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import (
        _TOTAL_KEY,
        MemTracker,
        _MemRefType,
        _UpdateType,
    )

    label = {"parameters": _MemRefType.PARAM, "buffers": _MemRefType.BUFFER,
             "optimizer": _MemRefType.OPT, "gradients": _MemRefType.GRAD}  # fmt: skip
    category = {_MemRefType.PARAM: "parameters", _MemRefType.BUFFER: "buffers",
                _MemRefType.OPT: "optimizer", _MemRefType.GRAD: "gradients",
                _MemRefType.ACT: "activations", _MemRefType.TEMP: "temporaries",
                _MemRefType.OTH: "other"}  # fmt: skip

    class _ForwardHooks:
        """Stands in for ``MemTracker``'s ``ModTracker``, of which only two things are
        used here: whether autograd is running a backward, and forward hooks on every
        module (activation checkpointing's recompute). ``ModTracker`` also hooks every
        module's inputs and outputs for the backward (``register_multi_grad_hook``), and
        those hooks keep tensors alive: a pipeline stage's received input and its
        gradient, every micro-batch of every step -- 3.2 GB a step on 175B's last stage,
        which a real run (no tracker) does not hold."""

        parents = frozenset()  # no per-module statistics

        @property
        def is_bw(self) -> bool:
            return torch._C._current_graph_task_id() != -1

        def register_user_hooks(self, pre_fw, post_fw, pre_bw=None, post_bw=None):
            self._pre_fw, self._post_fw = pre_fw, post_fw

        def clear_user_hooks(self):
            self._pre_fw = self._post_fw = None

        def __enter__(self):
            from torch.nn.modules.module import (
                register_module_forward_hook,
                register_module_forward_pre_hook,
            )

            self._handles = (
                register_module_forward_pre_hook(lambda m, args: self._pre_fw(m, args)),
                register_module_forward_hook(lambda m, args, out: self._post_fw(m, args, out),
                                             always_call=True),
            )  # fmt: skip
            return self

        def __exit__(self, *args):
            for h in self._handles:
                h.remove()

    class RankMemory(MemTracker):
        """``MemTracker`` with plait's roles (module docstring) and a peak per phase.

        It keeps ``MemTracker``'s accounting of storages and its labels by where a
        storage is made; the tensors of lasting roles are relabelled once built
        (``built``), those of passing roles looked up at each new peak. Per-module
        statistics are not kept (module hooks only follow activation checkpointing here:
        ``_ForwardHooks``), so a module may run any number of times in a phase -- every
        micro-batch does. This leans on ``MemTracker``'s internals (``_WINFO``, ``_curr_mem_snap``,
        ``_update_snap``, the hook methods), torch 2.13's; a test rehearses a small model
        against a real run's measured peak to catch a change.
        """

        def __init__(self):
            super().__init__()
            self._mod_tracker = _ForwardHooks()
            self.trainer, self.params = None, []
            # id -> winfo of the storages on the host (``HOST``), while they live
            self.host = weakref.WeakValueDictionary()
            self.peak, self.split = 0, dict.fromkeys(CATEGORIES, 0)
            self.act_peak = 0
            # a new peak's outputs, awaiting their roles (``settle``): (winfo, category)
            self._fresh, self._fresh_split, self._fresh_act, self._act_before = None, False, None, 0

        # module hooks: activation checkpointing's recomputed forward only
        def _pre_fw_hook(self, module, inputs):
            if self._mod_tracker.is_bw and self._ac_mod is None:
                self._ac_mod, self._in_ac = weakref.ref(module), True

        def _post_fw_hook(self, module, inputs, outputs):
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod, self._in_ac = None, False

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # ``tensor.device`` of a fake tensor is an operator call too: most of the calls
            # a step makes (the autograd engine asks for every tensor's), allocating nothing
            if func is torch.ops.prim.device.default:
                return func(*args, **(kwargs or {}))
            self.settle()
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self._fresh is not None:  # this operator made a new peak: its outputs
                outputs = [(None, t) for t in torch.utils._pytree.tree_leaves(out)
                           if isinstance(t, torch.Tensor)]  # fmt: skip
                self._fresh = [(w, category[w.reftype]) for _, w in self._winfos(outputs)]
            return out

        def settle(self) -> None:
            """A new peak's outputs take their roles from the assignment that follows
            the operator making them (a gather's output, a packed gradient, a cast row):
            read at the next operator, each output a role has claimed since moves to
            that role in the peak's split, and out of the activations' own peak."""
            fresh, self._fresh = self._fresh or (), None
            act, self._fresh_act = self._fresh_act, None
            split, self._fresh_split = self._fresh_split, False
            roles = {}
            if fresh and self.trainer is not None:
                pairs = _passing_roles(self.trainer, self.params)
                roles = {id(w): r for r, w in self._winfos(pairs)}
            for winfo, was in fresh:
                role = roles.get(id(winfo), was)
                if role != was and split:
                    self.split[was] -= winfo.mem_consumed
                    self.split[role] += winfo.mem_consumed
                if role != was and act is not None and was == "activations":
                    act -= winfo.mem_consumed
            if act is not None:
                self.act_peak = max(self._act_before, act)

        def _snaps(self):
            """The per-device snapshots that are memory: not meta's. A ZeRO-3 model is
            built on meta (``Trainer.build``) and its meta tensors -- storages of a size
            and no bytes, on a GPU run as here -- live as long as something refers to
            them (a deferred ``init_value``), so ``MemTracker`` counts them."""
            return [s for dev, s in self._curr_mem_snap.items() if dev.type != "meta"]

        def current(self) -> int:
            """Bytes on the device now (a fake tensor's storage is on the CPU whatever it
            stands for: the host's are those ``built`` found in the ``HOST`` role)."""
            on_host = sum(w.mem_consumed for w in self.host.values())
            return sum(s[_TOTAL_KEY] for s in self._snaps()) - on_host

        def _update_peak_stats(self, peak_state) -> None:
            total = self.current()
            new_peak = total > self.peak
            if new_peak:
                self.peak, self.split = total, self.breakdown()
                self._fresh, self._fresh_split = [], True
            # the activations' own peak: where the phase's peak lies elsewhere (a step
            # of few micro-batches peaks in the optimizer step, its activations freed),
            # it is what the model's activation figure is to be held against
            # (the storages labelled ACT include buffers a role claims -- ZeRO-3's gathered
            # units, made in a forward -- so their sum bounds the activations from above:
            # only above the peak so far can the activations have a new one)
            act = sum(s.get(_MemRefType.ACT, 0) for s in self._snaps())
            if act > self.act_peak:
                split = self.split if new_peak else self.breakdown()
                if split["activations"] > self.act_peak:
                    self._act_before, self._fresh_act = self.act_peak, split["activations"]
                    self.act_peak, self._fresh = split["activations"], self._fresh or []

        def reset_peak(self) -> None:
            self.settle()
            self.peak, self.split = self.current(), self.breakdown()
            self.act_peak = self.split["activations"]

        def _winfos(self, pairs):
            """(category, winfo) of each storage of ``pairs``' tensors, once each."""
            seen = set()
            for role, t in pairs:
                for st in get_untyped_storages(t):
                    winfo, _ = self._WINFO.get(st, (None, None))
                    if winfo is not None and id(winfo) not in seen:
                        seen.add(id(winfo))
                        yield role, winfo

        def breakdown(self) -> dict[str, int]:
            """Bytes held now per category (module docstring)."""
            out = dict.fromkeys(CATEGORIES, 0)
            for snap in self._snaps():
                for k, v in snap.items():
                    if k != _TOTAL_KEY:
                        out[category[k]] += v
            for winfo in self.host.values():
                out[category[winfo.reftype]] -= winfo.mem_consumed
            if self.trainer is not None:
                for role, winfo in self._winfos(_passing_roles(self.trainer, self.params)):
                    if winfo.device.type == "meta":
                        continue
                    out[category[winfo.reftype]] -= winfo.mem_consumed
                    out[role] += winfo.mem_consumed
            return out

        def built(self, trainer) -> None:
            """After the build: label the lasting roles' storages; what the build made
            without a role is ``other`` state."""
            self.trainer, self.params = trainer, list(trainer.model.parameters())
            for st in list(self._WINFO.keys()):
                winfo, _ = self._WINFO.get(st, (None, None))
                if winfo is not None and winfo.reftype == _MemRefType.ACT:
                    self._relabel(winfo, _MemRefType.OTH)
            for role, winfo in self._winfos(_stable_roles(trainer)):
                if role == HOST:
                    self.host[id(winfo)] = winfo
                    role = "optimizer"
                self._relabel(winfo, label[role])

        def _relabel(self, winfo, reftype) -> None:
            if winfo.reftype != reftype:
                old, winfo.reftype = winfo.reftype, reftype
                self._update_snap(_UpdateType.REF, winfo, old_reftype=old)

    return RankMemory


# -- checkpoint save and load -------------------------------------------------------------


class RecordedCheckpoint:
    """Stands in for ``torch.distributed.checkpoint`` inside ``train/checkpoint.py`` while a
    rank is rehearsed (``recorded_checkpoints``): ``save`` and ``load`` run DCP's own
    ``save`` and ``load`` -- its default planners asking ``checkpoint._Boxes`` for this
    rank's boxes, resolving each write item to the view it writes and each read item to
    the view it fills -- with a storage that records bytes instead of files. Two things
    differ from a real run. The planning runs on this rank alone (``no_dist``: the fake
    group carries no objects), so a box other ranks hold too (dp replicas below ZeRO-3, a
    tied copy) counts as written here, where DCP's de-duplication gives it to one holder:
    ``written`` is this rank's writes at most, exact where no box is replicated. And no
    host staging buffer is made: a real save copies each box to the host and a load reads
    it there before ``copy_`` into the view, host memory either way, not the device's."""

    def __init__(self):
        self.written = self.read = 0  # bytes of tensor data
        self.boxes: dict[tuple, int] = {}  # (key, global offsets) -> bytes written
        self.metadata = None  # the save's, which the load reads

    def save(self, state_dict, *, storage_writer=None, process_group=None, no_dist=False):
        import torch.distributed.checkpoint as dcp

        from plait.train import checkpoint

        if storage_writer is not None:
            folder = Path(storage_writer.path)
            folder.mkdir(parents=True, exist_ok=True)  # rank 0 makes it in a real run
            # the other ranks' manifest parts, which rank 0 merges: none of their files
            # is written here
            rank, world = dist.get_rank(), dist.get_world_size()
            for r in range(world):
                if r != rank:
                    (folder / f"{checkpoint.PART}{r}.json").write_text("{}")
        return dcp.save(state_dict, storage_writer=_RecordingWriter(self), no_dist=True)

    def load(self, state_dict, *, checkpoint_id=None, process_group=None, no_dist=False):
        import torch.distributed.checkpoint as dcp

        return dcp.load(state_dict, storage_reader=_RecordedReader(self), no_dist=True)


def _storage_classes():
    from torch.distributed.checkpoint import StorageReader, StorageWriter
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    def done(value):
        fut = Future()
        fut.set_result(value)
        return fut

    class Writer(StorageWriter):
        def __init__(self, book):
            self.book = book

        def reset(self, checkpoint_id=None):
            pass

        def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
            pass

        def prepare_local_plan(self, plan):
            return plan

        def prepare_global_plan(self, plans):
            return plans

        def write_data(self, plan, planner):
            out = []
            for item in plan.items:
                data = planner.resolve_data(item)  # what FileSystemWriter writes
                n = (data.getbuffer().nbytes if isinstance(data, io.BytesIO)
                     else data.numel() * data.element_size())  # fmt: skip
                self.book.written += n
                self.book.boxes[(item.index.fqn, tuple(item.index.offset))] = n
                out.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=None))
            return done(out)

        def finish(self, metadata, results):
            self.book.metadata = metadata

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id):
            return True

        def storage_meta(self):
            return None

    class Reader(StorageReader):
        def __init__(self, book):
            self.book = book

        def reset(self, checkpoint_id=None):
            pass

        def read_metadata(self, *args, **kwargs):
            return self.book.metadata

        def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
            pass

        def prepare_local_plan(self, plan):
            return plan

        def prepare_global_plan(self, plans):
            return plans

        def read_data(self, plan, planner):
            for item in plan.items:
                target = planner.resolve_tensor(item).detach()  # what FileSystemReader fills
                self.book.read += target.numel() * target.element_size()
                planner.commit_tensor(item, target)
            return done(None)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id):
            return True

    return Writer, Reader


def _RecordingWriter(book):
    return _storage_classes()[0](book)


def _RecordedReader(book):
    return _storage_classes()[1](book)


@contextlib.contextmanager
def recorded_checkpoints():
    """``train/checkpoint.py``'s DCP replaced by a ``RecordedCheckpoint`` (yielded) for the
    duration: everything else of a save and a load runs as in ``plait train``."""
    from plait.train import checkpoint

    book, real = RecordedCheckpoint(), checkpoint.dcp
    checkpoint.dcp = book
    try:
        yield book
    finally:
        checkpoint.dcp = real


def _save_and_load(trainer, step: int, out: Path, mem, report) -> None:
    """Save checkpoint ``step`` through ``Trainer.save`` into ``out`` and load it back into
    the same rank through ``checkpoint.load`` and the engine's ``state_loaded`` -- what
    ``Trainer.restore`` runs once ``pick_resume`` has chosen and verified the folder (host
    files only; its agreement over ranks reads values a fake tensor has not). Each a
    phase; the bytes each moves go to ``report``."""
    from plait.train import checkpoint

    trainer.out = out
    with recorded_checkpoints() as book:
        mem.reset_peak()
        t0 = time.perf_counter()
        trainer.save(step)
        mem.settle()
        report.phases.append(Phase("save", mem.peak, mem.split, time.perf_counter() - t0))
        path = out / "checkpoints" / f"step-{step:08d}"
        if not path.exists():  # rank 0 commits the folder (and its meta.json) in a real run
            path = path.with_name(path.name + ".tmp")
            meta = {"step": step, **trainer.dp_algo.meta()}
            (path / "meta.json").write_text(json.dumps(meta))
        # the generators' state: host bytes, read back as a fake tensor here (no value)
        (path / f"rng-rank-{trainer.topo.rank}.pt").unlink()
        mem.reset_peak()
        t0 = time.perf_counter()
        entries = trainer.dp_algo.resume(checkpoint.read_meta(path))
        checkpoint.load(path, state=trainer.checkpoint_state(**entries), topo=trainer.topo,
                        verified=True)  # fmt: skip
        trainer.engine.state_loaded()
        mem.settle()
        report.phases.append(Phase("load", mem.peak, mem.split, time.perf_counter() - t0))
    report.bytes_written, report.bytes_read = book.written, book.read
    report.boxes_written = book.boxes


# -- one rank ----------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    peak: int  # bytes
    split: dict[str, int]  # category -> bytes at that peak
    seconds: float
    activations_peak: int = 0  # the activations' own peak in the phase (bytes)


@dataclass
class RankReport:
    """What rehearsing one rank found."""

    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    phases: list[Phase] = field(default_factory=list)
    cp_rank: int = 0
    calls: list[Call] = field(default_factory=list)  # build and both steps as run, in order
    step_calls: list[Call] = field(default_factory=list)  # step 2's only, of the full step
    microbatches: int = 1  # a step's, the layout's
    microbatches_run: int = 1  # what the executor ran a step (``shortened_layout``)
    bytes_written: int = 0  # tensor data of the checkpoint save (``RecordedCheckpoint``)
    bytes_read: int = 0  # ... and of its load
    boxes_written: dict[tuple, int] = field(default_factory=dict)  # (key, offsets) -> bytes
    moe_imbalance: float = 1.0  # how its MoE layers routed (``moe.modelled_routing``)
    # the optimizer step (from 0) "step 2" ran: 1, or a --dp-algo's first sync or a
    # codec's second compressed step (``dp_algos.volume.characteristic_step``)
    second_step: int = 1

    def training_peak(self) -> int:
        return max(p.peak for p in self.phases if p.name.startswith("step"))

    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.peak)

    def bytes_per_axis(self) -> dict[str, int]:
        """Counted bytes per axis of one step (step 2's), ``comm.py``'s convention. An
        all-to-all over dp is expert parallelism's (its group is a dp sub-group,
        ``parallel/expert.py``): counted as "ep", as the model counts it."""
        out = Counter()
        for c in self.step_calls:
            axis = "ep" if c.op == "all_to_all" and c.axis == "dp" else c.axis
            out[axis] += c.nbytes  # a wait counts 0
        return dict(out)

    def to_dict(self) -> dict:
        return {
            "rank": self.rank, "pp_rank": self.pp_rank, "dp_rank": self.dp_rank,
            "tp_rank": self.tp_rank,
            "microbatches": self.microbatches, "microbatches_run": self.microbatches_run,
            "second_step": self.second_step + 1,  # the optimizer step "step 2" ran, from 1
            "phases": [dataclasses.asdict(p) for p in self.phases],
            "calls": [c._asdict() for c in self.step_calls],
            "bytes_per_axis": self.bytes_per_axis(),
            "checkpoint": {"bytes_written": self.bytes_written, "bytes_read": self.bytes_read},
        }  # fmt: skip


def shortened_layout(cfg, rank: int):
    """The layout rank ``rank`` is rehearsed at: ``cfg.layout`` with the fewest
    micro-batches whose schedule takes this rank through the same states as the full
    step's (``schedules.shortest_equivalent``: the same activations in flight at each kind
    of compute, before and after the first gradients), so the same peaks; GPipe, or no
    pipeline, keeps them all. 175B, pp 16, 1F1B, 192 micro-batches: 17 on pipeline rank
    0, 3 on the last."""
    from plait.parallel.pipeline.schedules import shortest_equivalent

    lay = cfg.layout
    if lay.pp == 1:
        return lay
    pp_rank = coords(rank, pp=lay.pp, dp=lay.dp, cp=lay.cp, tp=lay.tp)[Axis.PP]
    # the layout asks interleaving for a multiple of pp micro-batches, even at vpp 1
    multiple = lay.pp if lay.schedule == "interleaved-1f1b" else 1
    m = shortest_equivalent(lay.schedule, num_ranks=lay.pp, num_microbatches=lay.num_microbatches,
                            num_chunks=lay.vpp, rank=pp_rank, multiple_of=multiple)  # fmt: skip
    return dataclasses.replace(lay, global_batch_size=m * lay.micro_batch_size * lay.dp)


class NotRepeating(RuntimeError):
    """Computes of one kind issued different calls in the shortened step: its calls
    cannot stand for the full step's (``rehearse_rank`` then runs all micro-batches)."""


def _kind(action, m: int) -> tuple:
    """What a compute's calls may depend on: its op and chunk, and whether it is the first,
    a middle or the last micro-batch of a step of ``m`` (the data-parallel hooks launch
    with the last backward)."""
    place = 0 if action.microbatch == 0 else 2 if action.microbatch == m - 1 else 1
    return action.op, action.chunk, place


def _full_step_calls(trainer, log: list, mark: int, layout) -> list[Call]:
    """Step 2's calls as the full step of ``layout`` would issue them, from the shortened
    step logged in ``log[mark:]``: the calls before and after the executor's run as they
    are, and the run replayed on the full schedule's items (``PipelineRunner.replay_step``:
    the executor's own batches, waits and unpacking) with each compute's calls those its
    kind made in the shortened step (``_kind``). NotRepeating if two computes of a kind
    made different calls there. Waits name batches by their index from ``mark``."""
    from plait.parallel.pipeline.schedules import build_schedule

    runner, topo = trainer.runner, trainer.topo
    run_lo, run_hi = runner.run_span
    m_run = trainer.layout.num_microbatches
    made: dict[tuple, list] = {}
    for action, lo, hi in runner.compute_spans:
        calls = log[lo:hi]
        if any(c.op == "wait" for c in calls):
            raise NotRepeating(f"{action} waited for a batch inside its compute")
        if made.setdefault(_kind(action, m_run), calls) != calls:
            raise NotRepeating(f"{action} made other calls than the computes of its kind")
    items = build_schedule(layout.schedule, num_ranks=layout.pp, num_chunks=layout.vpp,
                           num_microbatches=layout.num_microbatches)[topo.pp_rank]  # fmt: skip
    m = layout.num_microbatches

    def calls_of(action) -> list:
        return made[_kind(action, m)]

    topo.stats.log, replayed = [], topo.stats.log
    try:
        runner.replay_step(items, calls_of)
    finally:
        topo.stats.log, replayed = replayed, topo.stats.log
    grown = len(replayed) - (run_hi - run_lo)

    def moved(c: Call, by) -> Call:
        return c._replace(peers=tuple(by(i) for i in c.peers)) if c.op == "wait" else c

    before = [moved(c, lambda i: i - mark) for c in log[mark:run_lo]]
    run = [moved(c, lambda i: i + len(before)) for c in replayed]
    after = [moved(c, lambda i: i - mark + (grown if i >= run_hi else 0)) for c in log[run_hi:]]
    return before + run + after


def rehearse_rank(cfg, rank: int, *, full_steps: bool = False,
                  moe_imbalance: float = 1.0) -> RankReport:  # fmt: skip
    """Build rank ``rank`` of ``cfg``'s layout and run two optimizer steps on fake
    tensors under the fake process group (module docstring). Unless ``full_steps``, a
    pipeline rank runs the fewest micro-batches a step that reach the full step's states
    (``shortened_layout``; its peaks are the full step's) and its step calls are counted
    for the full step (``_full_step_calls``). MoE layers route as the model prices
    ``moe_imbalance`` (``moe.modelled_routing``: this rank the busiest)."""
    run = cfg.layout if full_steps else shortened_layout(cfg, rank)
    if run.num_microbatches < cfg.layout.num_microbatches:
        try:
            return _rehearse_rank(dataclasses.replace(cfg, layout=run), rank, full=cfg.layout,
                                  moe_imbalance=moe_imbalance)  # fmt: skip
        except NotRepeating:
            pass  # every micro-batch, then
    return _rehearse_rank(cfg, rank, moe_imbalance=moe_imbalance)


def _rehearse_rank(cfg, rank: int, *, full=None, moe_imbalance: float = 1.0) -> RankReport:
    """``rehearse_rank`` at ``cfg.layout``; with ``full`` (a layout of more micro-batches)
    step 2's calls are counted for ``full``'s step."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plait.model.moe import modelled_routing
    from plait.model.transformer import rehearsing_gpu_kernels

    lay = cfg.layout
    world = lay.world_size
    if dist.is_initialized():
        raise RuntimeError("plait rehearse runs in a process without a process group")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        topo = Topology.build(pp=lay.pp, dp=lay.dp, cp=lay.cp, tp=lay.tp)
        topo.stats.log = []
        c = coords(rank, pp=lay.pp, dp=lay.dp, cp=lay.cp, tp=lay.tp)
        report = RankReport(rank, c[Axis.PP], c[Axis.DP], c[Axis.TP], cp_rank=c[Axis.CP],
                            microbatches=(full or lay).num_microbatches,
                            microbatches_run=lay.num_microbatches)  # fmt: skip
        # MoE layers route as the model prices them (``moe.modelled_routing``): the counts
        # are known on the host
        report.moe_imbalance = moe_imbalance
        report.second_step = volume.characteristic_step(cfg.dp_algo)
        with (FakeTensorMode(), _memtracker_class()() as mem, modelled_routing(moe_imbalance),
              rehearsing_gpu_kernels()):  # fmt: skip
            t0 = time.perf_counter()
            made = full.global_batch_size if full is not None else None
            # the build's peak on the device: from the model's arrival there (before it,
            # its initialisation ran on the host)
            trainer = _trainer_class(made, placed=mem.reset_peak)(cfg, topo=topo)
            if lay.pp > 1:  # a send completes once posted here: let it go as a real one would
                trainer.runner.sends_done_when_reaped = True
            mem.built(trainer)
            # the build's peak came before the roles existed: its split is what the build
            # leaves, and the rest of its peak was transient (temporaries); the host's
            # state (offload), made in the build and kept, is not the device's
            mem.peak -= sum(w.mem_consumed for w in mem.host.values())
            held = mem.breakdown()
            held["temporaries"] += mem.peak - sum(held.values())
            report.phases.append(Phase("build", mem.peak, held, time.perf_counter() - t0))
            trainer.model.train()
            for step in (0, report.second_step):
                codec = getattr(trainer.dp_algo, "compression", None)
                if step > 1 and codec is not None:  # the steps between are not run: the
                    codec.set_step(step)  # codec's count jumps, as a resume at ``step`` sets it
                mem.reset_peak()
                t0 = time.perf_counter()
                mark = len(topo.stats.log)
                if full is not None and step == 1:
                    trainer.runner.compute_spans = []
                trainer.step(step)
                mem.settle()
                report.phases.append(
                    Phase(f"step {min(step, 1) + 1}", mem.peak, mem.split, time.perf_counter() - t0,
                          mem.act_peak)
                )  # fmt: skip
            report.calls = list(topo.stats.log)
            if full is not None:
                report.step_calls = _full_step_calls(trainer, report.calls, mark, full)
                trainer.runner.compute_spans = None
            else:
                report.step_calls = [  # waits name batches by their index in this slice
                    c._replace(peers=tuple(i - mark for i in c.peers)) if c.op == "wait" else c
                    for c in topo.stats.log[mark:]
                ]
            with tempfile.TemporaryDirectory(prefix="plait-rehearse-") as out:
                _save_and_load(trainer, report.second_step + 1, Path(out), mem, report)
            trainer.close()
            mem.trainer = mem.params = None
        return report
    finally:
        dist.destroy_process_group()


def rehearse(cfg, ranks: list[int], *, progress=None, full_steps: bool = False,
             moe_imbalance: float = 1.0) -> list[RankReport]:  # fmt: skip
    """``rehearse_rank`` of each rank, one after another; ``progress(line)`` is told of
    each as it starts."""
    out = []
    for rank in ranks:
        if progress is not None:
            progress(f"rank {rank} of {cfg.layout.world_size}")
        out.append(rehearse_rank(cfg, rank, full_steps=full_steps, moe_imbalance=moe_imbalance))
    return out


def parse_ranks(text: str, layout) -> list[int]:
    """``--ranks``: "all-stages" (dp 0, tp 0 of every pipeline stage), or a comma list of
    ranks and ``LAST``. ValueError (one line) on anything else."""
    from plait.topology import rank_of

    world = layout.world_size
    if text.strip() == "all-stages":
        return [rank_of(pp_rank=i, dp_rank=0, tp_rank=0, dp=layout.dp, tp=layout.tp,
                        cp=layout.cp) for i in range(layout.pp)]  # fmt: skip
    ranks = []
    for part in text.split(","):
        part = part.strip()
        if part.upper() == "LAST":
            ranks.append(world - 1)
        elif part.isdigit() and int(part) < world:
            ranks.append(int(part))
        else:
            raise ValueError(
                f"--ranks {text}: {part!r} is not a rank of this layout's {world} "
                f"(give ranks 0..{world - 1} or LAST, comma-separated, or all-stages)"
            )
    return list(dict.fromkeys(ranks))


# -- the point-to-point check ----------------------------------------------------------------


def p2p_programs(reports: list[RankReport], layout) -> list | None:
    """The recorded batches of one pipeline (one rank per stage, same dp and tp ranks) as
    ``nccl_p2p`` programs: a ``Post`` per batch (each message tagged with its bytes, so
    that a send and its receive must agree on the size) and a ``Compute`` where the
    executor waited for a batch holding a receive (waits for send-only batches are the
    executor letting them go, not waits; NCCL's model asks that every batch finish).
    None when the reports do not hold every stage of one pipeline."""
    from plait.nccl_p2p import Compute, Message, Post

    by_stage = {}
    for r in reports:
        by_stage.setdefault((r.dp_rank, r.cp_rank, r.tp_rank), {})[r.pp_rank] = r
    pipeline = next((s for s in by_stage.values() if len(s) == layout.pp), None)
    if pipeline is None or layout.pp < 2:
        return None
    programs = []
    for stage in range(layout.pp):
        report, items, where = pipeline[stage], [], {}
        for i, c in enumerate(report.step_calls):
            if c.op == "batch":
                where[i] = len(items)
                messages = tuple(
                    Message(
                        kind,
                        coords(peer, pp=layout.pp, dp=layout.dp, cp=layout.cp, tp=layout.tp)[
                            Axis.PP
                        ],
                        tag=nbytes,
                    )
                    for kind, peer, nbytes in c.peers
                )
                items.append(Post(messages))
            elif c.op == "wait":
                for b in c.peers:
                    post = items[where[b]]
                    if any(m.kind == "recv" for m in post.messages):
                        items.append(Compute(waits_for=where[b]))
        programs.append(items)
    return programs


def check_p2p(reports: list[RankReport], layout) -> str:
    """Run the recorded batches under NCCL's point-to-point model (``nccl_p2p.resolve``):
    "ok: ...", "skipped: ..." or "FAILED: ..." in one line."""
    from plait.nccl_p2p import P2PDeadlock, P2PMismatch, resolve

    if layout.pp < 2:
        return "skipped: no pipeline (nothing point-to-point)"
    programs = p2p_programs(reports, layout)
    if programs is None:
        return "skipped: needs one rank of every stage (--ranks all-stages)"
    try:
        resolve(programs, what="the recorded batches deadlock")
    except (P2PDeadlock, P2PMismatch) as e:
        return f"FAILED: {e}"
    n = sum(1 for items in programs for it in items if type(it).__name__ == "Post")
    return f"ok: {n} batches of {layout.pp} stages complete under NCCL's semantics"


# -- held against the performance model ------------------------------------------------------


def predicted(cfg, pp_rank: int, moe_imbalance: float = 1.0, step: int = 1) -> dict:
    """What the performance model says of a rank of pipeline rank ``pp_rank`` in the same
    layout, runtime ``plait`` (at ``moe_imbalance``, the busiest ep rank): memory per
    category (``sim/memory.py``'s ``memory_per_rank``, no framework overhead; a
    ``--dp-algo``'s or ``--compress``'s state, ``sim/dp_algos.state_bytes``, as "other")
    and counted bytes per axis of optimizer step ``step`` (``sim/traffic.py``)."""
    from plait.sim.dp_algos import added_at_peak, state_bytes
    from plait.sim.memory import memory_per_rank, stage_params
    from plait.sim.pipeline import compile_schedule
    from plait.sim.runtime import get_runtime
    from plait.sim.simulate import layers_per_stage
    from plait.sim.traffic import bytes_per_axis

    model, lay = cfg.model, cfg.layout
    algo = cfg.dp_algo
    rt = dataclasses.replace(get_runtime("plait"), moe_imbalance=moe_imbalance,
                             qat=cfg.qat is not None,
                             grad_codec=algo.codec if algo and algo.grad_codec else None)  # fmt: skip
    stage_layers = layers_per_stage(model, lay)
    compiled = compile_schedule(lay.schedule, lay.pp, lay.num_microbatches, lay.vpp)
    mem = memory_per_rank(model, lay, rt, stage_layers, 0.0, compiled, lora=cfg.lora)[pp_rank]
    S = lay.pp * lay.vpp
    params = sum(stage_params(model, lay, stage_layers[s], s == 0, s == S - 1)
                 for s in range(pp_rank, S, lay.pp))  # fmt: skip
    held = state_bytes(model, lay, cfg.dp_algo, params)
    algo = added_at_peak(model, lay, cfg.dp_algo, params, mem)
    # the step's weight copy is made in a forward: the rehearsal counts it an activation;
    # at the model's peak the activations are their own peak less what the gradients'
    # arrival after it takes off (``Memory.grads_apart``); the output gradients waiting for
    # a zero-bubble W were made in a backward: temporaries, as the rehearsal counts them
    act = mem.activations + mem.weight_casts + mem.tables - mem.w_gradients
    own = act if mem.forward_made_peak is None else (mem.forward_made_peak + mem.weight_casts
                                                     + mem.tables)  # fmt: skip
    memory = {"parameters": mem.weights, "gradients": mem.grads + mem.grads_moment,
              "optimizer": mem.optimizer,
              "buffers": mem.buffers, "activations": act - mem.grads_apart, ACT_PEAK: own,
              "temporaries": (mem.temporaries + mem.cp_buffers + mem.w_gradients) or None,
              "other": held or None, "total": mem.total + algo}  # fmt: skip
    return {
        "memory": memory,
        "bytes": bytes_per_axis(
            model, lay, rt, stage_layers, pp_rank, lora=cfg.lora, dp_algo=cfg.dp_algo, step=step
        ),  # fmt: skip
    }


def compared(report: RankReport, cfg) -> dict:
    """Rehearsed beside simulated for one rank: step 2's peak memory per category and
    counted bytes per axis, each with the ratio rehearsed / simulated (None where the
    model has no figure); and ``ACT_PEAK``, step 2's activations at their own peak, which
    is what the model's activation figure (its peak) is to be compared with."""
    sim = predicted(cfg, report.pp_rank, report.moe_imbalance, report.second_step)
    peak = next(p for p in report.phases if p.name == "step 2")
    rows = {}
    for cat in (*CATEGORIES, "total"):
        got = peak.peak if cat == "total" else peak.split[cat]
        want = sim["memory"].get(cat)
        rows[cat] = (got, want, got / want if want else None)
    # the model's activations at their own peak, wherever the step's peak lies
    want = sim["memory"][ACT_PEAK]
    rows[ACT_PEAK] = (peak.activations_peak, want, peak.activations_peak / want if want else None)
    got_bytes = report.bytes_per_axis()
    axes = {}
    for axis in sorted(set(got_bytes) | set(sim["bytes"])):
        got, want = got_bytes.get(axis, 0), sim["bytes"].get(axis)
        axes[axis] = (got, want, got / want if want else None)
    return {"memory": rows, "bytes": axes}
