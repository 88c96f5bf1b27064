"""Pipeline-parallel runtime: runs this rank's list of items from ``schedules.py``.

Communication (p pipeline ranks, v chunks per rank, m micro-batches of b sequences of s
tokens, hidden h, t = tp size, e = bytes of the compute dtype: 4 for fp32, 2 under
``--dtype bf16`` / ``fp16``, in which the residual stream already is (the cast is exact);
under ``--fp32-residual`` the fp32 stream is rounded once per stage boundary):

- forward, axis pp: for each micro-batch, each virtual stage but the last sends its
  output activation to the next (one isend) and the next receives it (one irecv): b*s*h*e
  bytes, or b*s*h*e / t with t > 1 (below). A middle rank with v = 1 sends m activations.
- backward, axis pp: the same messages in reverse carry the input gradients; stage 0
  sends none. Per step 2*m*(p*v - 1) messages cross the pipeline in all.
- with t > 1, the scatter/gather of Narayanan et al. (2021, PTD-P): the activation (and
  its gradient) at a stage boundary is identical on the t ranks of a tp group, so each
  sends only its 1/t slice to its counterpart on the next stage, which rebuilds the whole
  with one all-gather over tp (b*s*h*e bytes counted, per received message).
- tied embeddings (gpt2), axis pp: after the step's backward, ranks 0 and p - 1 swap the
  gradient of their copy of the token embedding (one send and one receive of V*h*4 / t
  bytes each) and both add the two: one exchange per step, equal to an all-reduce of the
  pair, without a process group of its own.
- with sequence parallelism the boundary activation is already this rank's sequence
  shard (b, s/t, h): it is sent as it is (b*s*h*e / t bytes) and nothing is gathered.
- nothing on dp: gradients are synchronised by ``data_parallel.py`` after the step.

How the items are run, and why it cannot deadlock under NCCL. The executor posts exactly
the schedule's batches, nothing per message: a ``CommBatch`` becomes one
``comm.batch_p2p`` call (one ``batch_isend_irecv``, one NCCL group on the pp group) when
the rank reaches it, and is waited on -- as a whole, since NCCL completes a group as a
whole -- right before the first compute that reads one of its messages; batches that
only send are let go when done, or at the end of the step. That is the communication
model ``schedules.validate`` checks every schedule against before the first step (NCCL's,
in ``nccl_p2p.py``: batches in posting order on the rank's queue, a send completes only
when its receive has been posted); the same order runs on gloo. Receive buffers have the shape
known from the config, (b, s, h) in the compute dtype. Messages between two ranks are
posted in the same order on both sides (``schedules.check_channel_order``). A stage's
output is dropped once its batch is done: backward starts from its ``GradientEdge``,
which keeps the graph but not the tensor. Before the first batch, a barrier on the pp
group brings its NCCL communicator up with every member (a first batched call on a
group must include all of its ranks). ``replay_step`` (``plait rehearse`` only, with
``comm.py``'s log on) runs another step's items through the same posting and waiting
without computing, to count the calls of a step longer than the one it ran.

Zero-bubble split (zb-h1). BI computes only the input gradient and W the weight
gradients later, without redoing BI's work: before BI, the autograd graph is searched for
the nodes where each weight's subgraph joins the path from the stage input to the output
("joints"); BI runs ``autograd.grad`` to the input only (so weight GEMMs are skipped) and
captures the gradient arriving at each joint; W restarts autograd at the joints with
those gradients, towards the weights only (one autograd call per group of weights that
share joints). The same idea as ``torch.distributed.pipelining``'s
``stage_backward_input/weight``. BI and W together run exactly B's matmuls (tested) and
give bit-identical gradients. Costs: a graph walk in Python per micro-batch (about a node
per tensor op, ~10 ms for 4 layers), some 40 autograd calls for W where B is one, and
the whole graph of a micro-batch stays alive until its W. Measured on CPU (4 layers of
hidden 256, 2 x 128 tokens): B 0.13 s, BI 0.085 s + W 0.09 s, so about 1.3 x B. With
``--recompute full`` every W call would re-run the checkpointed forward, so W is then one
call over all weights: it re-runs the forward once but also redoes the input path.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from plait import comm
from plait.data.sampler import inputs_targets, model_kwargs
from plait.layout import Layout
from plait.parallel.pipeline.schedules import (
    SEND_OPS,
    Action,
    CommBatch,
    Item,
    Op,
    build_schedule,
    forward_only,
    validate,
)
from plait.parallel.pipeline.stage import PipelineStage
from plait.parallel.tensor import weight_casts
from plait.topology import Axis, Topology
from plait.viz.trace import TraceWriter, now_us

COMPUTE_LANE, COMM_LANE, STEP_LANE = 0, 1, 2


# ----------------------------------------------------------------- zero-bubble split


def _grad_node(t: torch.Tensor):
    """The autograd node t's gradient enters: its grad_fn, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _parents(root) -> dict:
    """node -> the nodes that pass it a gradient (towards the root), for the graph below root."""
    parents, todo, seen = defaultdict(list), [root], {root}
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return parents


def _upwards(starts, parents, stop=frozenset()) -> tuple[set, set]:
    """Nodes reachable from ``starts`` towards the root, not entering ``stop``; and the
    ``stop`` nodes met on the way."""
    seen, met, todo = set(starts), set(), list(starts)
    while todo:
        for up in parents.get(todo.pop(), ()):
            if up in stop:
                met.add(up)
            elif up not in seen:
                seen.add(up)
                todo.append(up)
    return seen, met


class SavedBoxes:
    """The tensors one micro-batch's forward saves for its backward, each behind a box
    (``saved_tensors_hooks``), so that after BI those W will not read can be let go:
    ``keep_only(nodes)`` reads the saved tensors of the nodes W runs (marking their boxes)
    and empties every other box. What a nested hook packs (activation checkpointing,
    ``tensor.keeping_shard``) never reaches these boxes and stays as it is."""

    class _Box:
        __slots__ = ("t", "needed")

        def __init__(self, t):
            self.t, self.needed = t, False

    def __init__(self):
        self.boxes: list = []
        self._marking = False

    def pack(self, t):
        box = self._Box(t)
        self.boxes.append(box)
        return box

    def unpack(self, box):
        if self._marking:
            box.needed = True
        elif box.t is None:
            raise RuntimeError("a W read a saved tensor its BI let go: SavedBoxes.keep_only "
                               "missed a node W runs")  # fmt: skip
        return box.t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def keep_only(self, nodes) -> None:
        self._marking = True
        try:
            for node in nodes:
                for name in dir(node):
                    if name.startswith("_saved_"):
                        with contextlib.suppress(RuntimeError):
                            getattr(node, name)
                if hasattr(node, "saved_tensors"):  # a custom Function's
                    with contextlib.suppress(RuntimeError):
                        _ = node.saved_tensors
        finally:
            self._marking = False
        for box in self.boxes:
            if not box.needed:
                box.t = None
        self.boxes = []


@dataclass(eq=False)
class _WeightGroup:
    params: list
    joints: set
    grads: dict = field(default_factory=dict)  # joint -> gradients captured by BI


class WeightGrad:
    """The deferred W half of a split backward (see the module docstring)."""

    def __init__(self, groups: list[_WeightGroup]):
        self.groups = groups

    def run(self) -> None:
        for g in self.groups:
            joints = [j for j in g.joints if j in g.grads]
            edges, grads = [], []
            for j in joints:
                for i, grad in enumerate(g.grads[j]):
                    if grad is not None:
                        edges.append(GradientEdge(j, i))
                        grads.append(grad)
            if not edges:
                continue
            # A joint below another would also receive the upper one's gradient: pin
            # each joint to what BI captured there.
            hooks = (
                [j.register_prehook(lambda _, c=g.grads[j]: c) for j in joints]
                if len(joints) > 1
                else []
            )
            try:
                torch.autograd.backward(edges, grad_tensors=grads, inputs=g.params)
            finally:
                for h in hooks:
                    h.remove()
            g.grads = {}  # the captured gradients go as their group is done, not at the end
            del edges, grads
        self.groups = []


class FullBackward:
    """A W with no BI before it (stage 0 has no input gradient): the whole backward."""

    def __init__(self, root, grad):
        self.root, self.grad = root, grad

    def run(self) -> None:
        torch.autograd.backward(self.root, grad_tensors=self.grad)
        self.root = self.grad = None


def backward_input(
    root, grad, x: torch.Tensor, params, *, one_call: bool = False,
    boxes: SavedBoxes | None = None,
) -> tuple[torch.Tensor, WeightGrad]:  # fmt: skip
    """BI: the gradient of ``x`` only; returns it and the W that completes the backward.

    ``root`` is the stage output (a tensor or its GradientEdge) with gradient ``grad``, or
    the loss with ``grad`` None. W runs one autograd call per group of weights that share
    joints, which touches nothing on the input path. ``one_call``: one call for all of
    them instead -- for ``--recompute full``, where every call would re-run the
    checkpointed forward; one call re-runs it once but also redoes the input path.
    ``boxes``: the micro-batch's saved tensors (``SavedBoxes``): after BI, those no node
    of W's reads are let go (the graph stays, W's nodes keep theirs)."""
    root_node = root.node if isinstance(root, GradientEdge) else root.grad_fn
    parents = _parents(root_node)
    path, _ = _upwards([_grad_node(x)], parents)  # what BI runs
    owner: dict = {}
    groups: list[_WeightGroup] = []
    w_nodes: set = set()  # what W runs: the joints and the nodes below them to the weights
    for p in params:
        acc = _grad_node(p)
        if acc not in parents:
            continue  # not used by this micro-batch's graph
        below, joints = _upwards([acc], parents, stop=path)
        w_nodes |= below | joints
        group = _WeightGroup([p], set(joints))
        for other in {id(owner[j]): owner[j] for j in joints if j in owner}.values():
            group.params += other.params
            group.joints |= other.joints
            groups.remove(other)
        for j in group.joints:
            owner[j] = group
        groups.append(group)

    def capture(joint):
        def hook(grad_outputs):
            owner[joint].grads[joint] = grad_outputs

        return hook

    if one_call and groups:
        merged = _WeightGroup([p for g in groups for p in g.params], set(owner))
        owner = dict.fromkeys(owner, merged)
        groups = [merged]
    hooks = [j.register_prehook(capture(j)) for j in owner]
    try:
        (dx,) = torch.autograd.grad(root, x, grad_outputs=grad, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    if boxes is not None:
        boxes.keep_only(w_nodes)
    return dx, WeightGrad(groups)


# ----------------------------------------------------------------------------- runner


@dataclass
class _Step:
    """What one step's actions hand each other, keyed by (micro-batch, chunk)."""

    micro_batches: list
    train: bool
    loss_scale: float
    tokens_global: int
    received: dict = field(default_factory=dict)  # (kind, mb, chunk) -> tensor, unpacked
    outputs: dict = field(default_factory=dict)  # stage outputs awaiting their send
    inputs: dict = field(default_factory=dict)  # stage inputs awaiting their backward
    roots: dict = field(default_factory=dict)  # where backward starts: edge or scaled loss
    input_grads: dict = field(default_factory=dict)  # awaiting their send
    deferred: dict = field(default_factory=dict)  # BI done, W to run
    boxes: dict = field(default_factory=dict)  # (mb, chunk) -> SavedBoxes, until its BI
    batches: dict = field(default_factory=dict)  # item index -> _Posted, not yet waited on
    holder: dict = field(default_factory=dict)  # (kind, mb, chunk) -> its batch's item index
    grad_in: torch.Tensor | None = None  # the received output gradient a backward runs on
    # last stage: the loss shares summed on the device as each micro-batch's forward ends
    # (in micro-batch order, as a sum over a list of them: one scalar held, not m)
    loss: torch.Tensor | None = None
    busy_s: float = 0.0  # compute time on this rank
    cuda_spans: list = field(default_factory=list)  # (start, end) events of compute, on CUDA
    cuda_step: torch.cuda.Event | None = None  # CUDA: the event at the step's start


@dataclass
class _Posted:
    """A posted batch: its handles, the buffers its receives land in, and the tensors its
    sends read (kept alive until the batch is done)."""

    works: list
    recvs: list  # ((kind, mb, chunk), buffer)
    sends: list


class PipelineRunner:
    """Runs one step's micro-batches through this rank's pipeline chunks, following the
    schedule's list of items. Same interface as the loop's ``LocalRunner``: gradients
    accumulate in ``.grad``; ``train_step`` returns this rank's share of the global mean
    loss (a device scalar, non-zero on the last stage only) and leaves the measured
    ``bubble_fraction`` (1 - compute time / step time, on this rank) of the step -- on
    CUDA of the step before, whose events have completed by then: reading this step's
    would wait for the device (``_read_completed``).
    """

    def __init__(
        self,
        stage: PipelineStage,
        *,
        topo: Topology,
        layout: Layout,
        seq_len: int,
        autocast: Callable,
        trace_dir: Path | None = None,
    ):
        self.stage, self.topo, self.layout, self.autocast = stage, topo, layout, autocast
        p, v = layout.pp, layout.vpp
        if topo.pp != p:
            raise ValueError(f"topology has pp={topo.pp} but the layout --pp {p}")
        self.num_stages = p * v
        self.num_microbatches = layout.num_microbatches
        kw = dict(num_ranks=p, num_microbatches=self.num_microbatches, num_chunks=v)
        schedule = build_schedule(layout.schedule, **kw)
        validate(schedule, **kw)  # matched, in order, and no deadlock under NCCL
        # NCCL: the first batched point-to-point call on a group must involve every rank
        # of it; a barrier on the pp group brings its communicator up with all of them.
        comm.barrier(topo=topo, axis=Axis.PP)
        self.train_actions = schedule[topo.pp_rank]
        # a split backward (BI, then W): each forward's saved tensors go in boxes, so BI
        # can let go of those W does not read (``SavedBoxes``); with --recompute full the
        # checkpoints' own hooks hold them, and W is one call
        self.split = layout.recompute == "none" and any(
            isinstance(a, Action) and a.op is Op.BACKWARD_INPUT for a in self.train_actions
        )
        self._eval_actions: dict[int, list[Item]] = {}
        cfg, tp = stage.chunks[0].cfg, topo.tp
        sp = layout.sequence_parallel and tp > 1  # boundaries carry sequence shards already
        if sp and seq_len % tp:
            raise ValueError(
                f"--sequence-parallel needs --seq-len {seq_len} divisible by --tp {tp}"
            )
        self.act_shape = (layout.micro_batch_size, seq_len // tp if sp else seq_len, cfg.hidden)
        # messages travel in the compute dtype (bf16 / fp16 halve the bytes); the residual
        # stream is in it too, unless --fp32-residual keeps it in the weights' fp32 (and
        # the wire rounds it, as before that flag existed)
        self.wire_dtype = WIRE_DTYPES[layout.dtype]
        low = layout.dtype != "fp32" and not layout.fp32_residual
        self.act_dtype = self.wire_dtype if low else next(stage.parameters()).dtype
        self.scatter = tp > 1 and not sp  # PTD-P scatter/gather
        numel = self.act_shape[0] * self.act_shape[1] * self.act_shape[2]
        assert numel % tp == 0, "hidden is a multiple of tp (heads are)"
        self.shard = numel // tp
        self.params = [[p for p in c.parameters() if p.requires_grad] for c in stage.chunks]
        self.bubble_fraction = 0.0
        self.steps = 0
        # ``plait rehearse``, with ``comm.py``'s log on: (item, start, end) in the log of
        # the calls each compute made, and (start, end) of the last ``_run``'s calls
        self.compute_spans: list | None = None
        self.run_span: tuple[int, int] | None = None
        # ``plait rehearse``: the fake process group's works never report completion, so
        # a send-only batch would be held to the step's end; a real one lets go once sent
        self.sends_done_when_reaped = False
        self._live: _Step | None = None  # the step ``_run`` is running (``received_grads``)
        # On CUDA compute is asynchronous: its time comes from events, read once they
        # have completed (``_read_completed``); the trace shows when the CPU issued each
        # action.
        self.cuda_timing = topo.device.type == "cuda"
        self._unread: list[tuple] = []  # CUDA: (start, end, spans) of steps not read yet
        self.trace = None
        if trace_dir is not None:
            self.trace = TraceWriter(
                Path(trace_dir) / f"rank-{topo.rank}.json",
                pid=topo.rank,
                process_name=(
                    f"rank {topo.rank} (pp {topo.pp_rank}, dp {topo.dp_rank}, tp {topo.tp_rank})"
                ),
                lanes={COMPUTE_LANE: "compute", COMM_LANE: "comm", STEP_LANE: "step"},
            )

    # -- the interface the loop uses ---------------------------------------------------

    def train_step(self, micro_batches, *, loss_scale: float, tokens_global: int):
        st = _Step(list(micro_batches), True, loss_scale, tokens_global)
        if len(st.micro_batches) != self.num_microbatches:
            raise ValueError(
                f"the schedule was built for {self.num_microbatches} micro-batches, "
                f"got {len(st.micro_batches)}"
            )
        self.steps += 1
        start = now_us()
        if self.cuda_timing:
            st.cuda_step = _event()
        with weight_casts():  # one compute-dtype copy of each weight, not one per micro-batch
            self._run(self.train_actions, st)
        self._sync_tied_grads()
        end = now_us()
        if self.cuda_timing:  # GPU time, read once the events have completed: no host wait
            self._unread.append((st.cuda_step, _event(), st.cuda_spans))
            self._read_completed()
        else:
            self.bubble_fraction = bubble_of(st.busy_s, (end - start) / 1e6)
        if self.trace is not None:
            self.trace.add(
                f"step {self.steps}",
                start,
                end,
                tid=STEP_LANE,
                cat="step",
                args={"step": self.steps, "bubble_fraction": round(self.bubble_fraction, 4)},
            )
            self.trace.flush()
        return self._loss(st)

    def eval_step(self, micro_batches, *, tokens_global: int):
        st = _Step(list(micro_batches), False, 1.0, tokens_global)
        m = len(st.micro_batches)
        if m not in self._eval_actions:
            kw = dict(num_ranks=self.layout.pp, num_microbatches=m, num_chunks=self.layout.vpp)
            schedule = forward_only(**kw)
            validate(schedule, **kw, train=False)
            self._eval_actions[m] = schedule[self.topo.pp_rank]
        with torch.no_grad():
            self._run(self._eval_actions[m], st)
        return self._loss(st)

    def _loss(self, st: _Step) -> torch.Tensor:
        """This rank's share of the loss, summed on the device (0 off the last stage)."""
        if st.loss is None:
            return torch.zeros((), dtype=torch.float64, device=self.topo.device)
        return st.loss

    def _read_completed(self) -> None:
        """CUDA: the bubble of the newest earlier step whose events have completed (the
        loop's statistics sync after each step guarantees the previous one's), so that
        nothing waits for the device here: the step reported is one behind on CUDA."""
        while len(self._unread) > 1 and self._unread[0][1].query():
            start, end, spans = self._unread.pop(0)
            busy_ms = sum(a.elapsed_time(b) for a, b in spans)
            self.bubble_fraction = bubble_of(busy_ms / 1e3, start.elapsed_time(end) / 1e3)

    # -- running the items -------------------------------------------------------------

    def _run(self, items: list[Item], st: _Step, handlers: dict | None = None) -> None:
        """Compute actions in order; each batch is posted when reached and waited on right
        before the first compute that reads one of its messages (schedules' model)."""
        handlers = handlers or {
            Op.FORWARD: self._forward,
            Op.BACKWARD: self._backward,
            Op.BACKWARD_INPUT: self._backward_input,
            Op.BACKWARD_WEIGHT: self._backward_weight,
        }
        self._live = st
        try:
            self._run_items(items, st, handlers)
        finally:
            self._live = None

    def _run_items(self, items: list[Item], st: _Step, handlers: dict) -> None:
        log = self.topo.stats.log
        run_start = None if log is None else len(log)
        for i, item in enumerate(items):
            t0 = now_us()
            if isinstance(item, CommBatch):
                self._post(i, item, st)
                self._traced(item, t0, now_us(), st, cat="comm")
                continue
            self._await_input(item, st)
            t0 = now_us()
            if self.cuda_timing:
                span = _event()
            mark = None if log is None else len(log)
            handlers[item.op](item, st)
            if self.compute_spans is not None and log is not None:
                self.compute_spans.append((item, mark, len(log)))
            t1 = now_us()
            if self.cuda_timing:  # GPU time, read once the events have completed
                st.cuda_spans.append((span, _event()))
            else:
                st.busy_s += (t1 - t0) / 1e6
            self._traced(item, t0, t1, st, cat="compute")
            self._reap(st)
        t0 = now_us()
        for index in list(st.batches):  # the last sends
            self._complete(index, st)
        if self.trace is not None and st.train:
            self.trace.add("wait sends", t0, now_us(), tid=COMM_LANE, cat="wait", args={})
        leftover = [d for d in (st.outputs, st.inputs, st.roots, st.input_grads, st.deferred) if d]
        assert not leftover and not st.received and not st.holder, "schedule left work undone"
        if log is not None:
            self.run_span = (run_start, len(log))

    def received_grads(self) -> list[torch.Tensor]:
        """The output gradients this rank has received, or posted a receive for, and not
        yet run the backward of, in the step being run: the backward's input, made
        wherever its receive was posted or unpacked (``plait rehearse`` files them with
        the backward's temporaries, as the memory model does)."""
        st = self._live
        if st is None:
            return []
        out = [t for (kind, *_), t in st.received.items() if kind == "grad"]
        out += [st.grad_in] if st.grad_in is not None else []
        out += [w.grad for w in st.deferred.values()  # stage 0's W: the whole backward
                if isinstance(w, FullBackward) and w.grad is not None]  # fmt: skip
        return out + [buf for posted in st.batches.values()
                      for (kind, *_), buf in posted.recvs if kind == "grad"]  # fmt: skip

    def replay_step(self, items: list[Item], calls_of: Callable[[Action], list]) -> None:
        """``plait rehearse``: run a training step's ``items`` (another number of
        micro-batches than this runner's) through the executor's own posting, waiting
        and unpacking -- every batch, wait and tp all-gather as ``_run`` issues them --
        without computing: each compute leaves a tensor of the boundary's shape where its
        send reads one, and logs the calls ``calls_of(action)`` (what a compute of its
        kind logged in a real step). Needs ``comm.py``'s log; nothing is trained."""
        assert self.topo.stats.log is not None, "a replay only logs"
        m = 1 + max(a.microbatch for a in items if isinstance(a, Action))
        st = _Step([None] * m, True, 1.0, 1)
        spans, self.compute_spans = self.compute_spans, None

        def boundary() -> torch.Tensor:
            return torch.empty(self.act_shape, dtype=self.act_dtype, device=self.topo.device)

        def forward(a: Action, st: _Step) -> None:
            key = (a.microbatch, a.chunk)
            if not self._is_first(a.chunk):
                st.inputs[key] = st.received.pop(("act", *key))
            if not self._is_last(a.chunk):
                st.outputs[key] = boundary()
            st.roots[key] = None
            self._note(calls_of(a))

        def backward(a: Action, st: _Step) -> None:
            key = (a.microbatch, a.chunk)
            st.roots.pop(key)
            if not self._is_last(a.chunk):
                st.received.pop(("grad", *key))
            if st.inputs.pop(key, None) is not None:
                st.input_grads[key] = boundary()
            if a.op is Op.BACKWARD_INPUT:
                st.deferred[key] = None
            self._note(calls_of(a))

        def weight(a: Action, st: _Step) -> None:
            st.deferred.pop((a.microbatch, a.chunk))
            self._note(calls_of(a))

        handlers = {Op.FORWARD: forward, Op.BACKWARD: backward, Op.BACKWARD_INPUT: backward,
                    Op.BACKWARD_WEIGHT: weight}  # fmt: skip
        try:
            self._run(items, st, handlers)
        finally:
            self.compute_spans = spans

    def _note(self, calls: list) -> None:
        for c in calls:
            self.topo.stats.note(c)

    def _traced(self, item: Item, t0: float, t1: float, st: _Step, *, cat: str) -> None:
        if self.trace is None or not st.train:
            return
        if isinstance(item, CommBatch):
            name, mb, chunk = str(item), -1, -1
        else:
            name, mb, chunk = (
                f"{item.op.value} m{item.microbatch} c{item.chunk}",
                item.microbatch,
                item.chunk,
            )
        self.trace.add(
            name,
            t0,
            t1,
            tid=COMPUTE_LANE if cat == "compute" else COMM_LANE,
            cat=cat,
            args={"op": item.op.value, "microbatch": mb, "chunk": chunk, "step": self.steps},
        )

    def _is_first(self, chunk: int) -> bool:
        return self.stage.stages[chunk] == 0

    def _is_last(self, chunk: int) -> bool:
        return self.stage.stages[chunk] == self.num_stages - 1

    # -- compute -----------------------------------------------------------------------

    def _forward(self, a: Action, st: _Step) -> None:
        key = (a.microbatch, a.chunk)
        chunk = self.stage.chunks[a.chunk]
        mb = st.micro_batches[a.microbatch]
        inputs, targets = inputs_targets(mb)  # (B, T) each
        kw = model_kwargs(mb)  # documents (B, s), for every chunk's attention
        if self._is_first(a.chunk):
            x = inputs
        else:
            x = st.received.pop(("act", *key))
            if st.train:
                x.requires_grad_(True)
                st.inputs[key] = x
        saved = contextlib.nullcontext()
        if st.train and self.split and not self._is_first(a.chunk):  # BI, then W: module doc
            st.boxes[key] = SavedBoxes()
            saved = st.boxes[key].hooks()
        with self.autocast(), saved:
            out = chunk(x, targets, **kw) if self._is_last(a.chunk) else chunk(x, **kw)
        if self._is_last(a.chunk):  # out: per-token loss (B*T,)
            loss = out.sum() / st.tokens_global
            if st.loss is None:
                st.loss = torch.zeros((), dtype=torch.float64, device=self.topo.device)
            st.loss += loss.detach()
            if st.train:
                st.roots[key] = loss * st.loss_scale
        else:  # out: (B, T, C)
            st.outputs[key] = out
            if st.train:
                st.roots[key] = get_gradient_edge(out)

    def _backward(self, a: Action, st: _Step) -> None:
        key = (a.microbatch, a.chunk)
        root = st.roots.pop(key)
        grad = None if self._is_last(a.chunk) else st.received.pop(("grad", *key))
        st.grad_in = grad
        torch.autograd.backward(root, grad_tensors=grad)
        st.grad_in = grad = None
        x = st.inputs.pop(key, None)
        if x is not None:
            st.input_grads[key] = x.grad

    def _backward_input(self, a: Action, st: _Step) -> None:
        key = (a.microbatch, a.chunk)
        root = st.roots.pop(key)
        grad = None if self._is_last(a.chunk) else st.received.pop(("grad", *key))
        x = st.inputs.pop(key, None)
        if x is None:  # stage 0: nobody waits for an input gradient; all of it in W
            st.deferred[key] = FullBackward(root, grad)
            return
        st.grad_in = grad
        dx, st.deferred[key] = backward_input(
            root, grad, x, self.params[a.chunk], one_call=self.layout.recompute == "full",
            boxes=st.boxes.pop(key, None),
        )  # fmt: skip
        st.grad_in = grad = None
        st.input_grads[key] = dx

    def _backward_weight(self, a: Action, st: _Step) -> None:
        w = st.deferred.pop((a.microbatch, a.chunk))
        st.grad_in = getattr(w, "grad", None)  # a ``FullBackward``'s: held as it runs
        w.run()
        st.grad_in = w = None

    # -- communication -----------------------------------------------------------------

    def _post(self, index: int, batch: CommBatch, st: _Step) -> None:
        """Post every message of ``batch`` in one call (one NCCL group); do not wait."""
        ops, recvs, sends = [], [], []
        for m in batch.messages:
            peer = self.topo.pp_peer(m.peer)
            key = ("act" if m.op in (Op.SEND_ACT, Op.RECV_ACT) else "grad", m.microbatch, m.chunk)
            if m.op in SEND_OPS:
                t = self._outgoing(m, st)
                ops.append(("send", t, peer))
                sends.append(t)
            else:
                shape = (self.shard,) if self.scatter else self.act_shape
                buf = torch.empty(shape, dtype=self.wire_dtype, device=self.topo.device)
                ops.append(("recv", buf, peer))
                recvs.append((key, buf))
                st.holder[key] = index
        works = comm.batch_p2p(ops, topo=self.topo, axis=Axis.PP)
        st.batches[index] = _Posted(works, recvs, sends)

    def _outgoing(self, m: Action, st: _Step) -> torch.Tensor:
        """The tensor a send reads: the stage output or input gradient it names, in the
        wire dtype, and with tp > 1 only this rank's 1/tp slice (PTD-P scatter)."""
        key = (m.microbatch, m.chunk)
        t = st.outputs.pop(key) if m.op is Op.SEND_ACT else st.input_grads.pop(key)
        if t.shape != self.act_shape or t.dtype != self.act_dtype:
            raise RuntimeError(
                f"rank {self.topo.rank}: {m} would send {tuple(t.shape)} {t.dtype}, but "
                f"receivers expect {self.act_shape} {self.act_dtype}"
            )
        t = t.detach().to(self.wire_dtype)
        if self.scatter:
            t = t.reshape(-1)[self.topo.tp_rank * self.shard :][: self.shard]
        return t.contiguous()

    def _await_input(self, a: Action, st: _Step) -> None:
        """Before a compute: wait for the batch that holds the message it reads."""
        if a.op is Op.FORWARD:
            key = ("act", a.microbatch, a.chunk)
        elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            key = ("grad", a.microbatch, a.chunk)
        else:
            return
        if key in st.holder and key not in st.received:
            t0 = now_us()
            self._complete(st.holder[key], st)
            if self.trace is not None and st.train:
                self.trace.add("wait", t0, now_us(), tid=COMM_LANE, cat="wait", args={})

    def _complete(self, index: int, st: _Step) -> None:
        """Wait for a posted batch (all of it: on NCCL it completes as a group) and
        unpack its receives (tp > 1: all-gather the slices; back to the compute dtype)."""
        posted = st.batches.pop(index)
        comm.wait(posted.works, topo=self.topo, what="pipeline send/recv", axis=Axis.PP.value)
        for key, buf in posted.recvs:
            del st.holder[key]
            if self.scatter:
                buf = comm.all_gather(buf, topo=self.topo, axis=Axis.TP).view(self.act_shape)
            st.received[key] = buf.to(self.act_dtype)

    def _reap(self, st: _Step) -> None:
        """Let go of send-only batches that are done (and so of the tensors they read)."""
        for index, posted in list(st.batches.items()):
            done = self.sends_done_when_reaped or all(w.is_completed() for w in posted.works)
            if not posted.recvs and done:
                self._complete(index, st)

    def _sync_tied_grads(self) -> None:
        """Ranks 0 and p - 1 add their tied embedding copies' gradients (module doc)."""
        w = self.stage.tied_copy
        if w is None:
            return
        t0 = now_us()
        peer = self.topo.pp_peer(self.layout.pp - 1 if self.topo.pp_rank == 0 else 0)
        mine = w.grad if w.grad is not None else torch.zeros_like(w)
        theirs = torch.empty_like(mine)
        works = comm.batch_p2p(
            [("send", mine, peer), ("recv", theirs, peer)], topo=self.topo, axis=Axis.PP
        )
        comm.wait(works, topo=self.topo, what="pipeline send/recv", axis=Axis.PP.value)
        w.grad = mine.add_(theirs)  # a + b == b + a exactly: both copies stay equal
        if self.trace is not None:
            self.trace.add("tied grads", t0, now_us(), tid=COMM_LANE, cat="comm", args={})


WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def bubble_of(busy_s: float, step_s: float) -> float:
    """The fraction of a step this rank did not compute: 1 - busy / step time."""
    return max(0.0, 1.0 - busy_s / step_s) if step_s > 0 else 0.0


def _event() -> torch.cuda.Event:
    """A timing event recorded on the current stream (no host wait)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
