"""State copy when a generation forms: every unit a worker now holds, parameters *and*
AdamW moments, from its own previous trainer or from a surviving replica.

Communication (axis "world": the generation's world group): a barrier (it brings NCCL's
communicator up with every member: the first batched point-to-point call on a
communicator must involve all of its ranks, and a rank with nothing to move posts no
batch at all), then one batched point-to-point call per rank (``comm.batch_p2p``: one
``batch_isend_irecv``, one NCCL group) holding every send and every receive of that rank
-- for each unit moved, its parameters, then each one's ``exp_avg`` and ``exp_avg_sq``,
12 bytes per parameter in fp32 (ZeRO inside a replica: the pipeline's shards of them, 12 / K
bytes per parameter) -- then one world all-reduce (MAX) of three numbers: the loss scale,
its clean-step count and AdamW's step count, which every survivor holds alike and a new
worker does not; sharded, last, one all-gather per bucket on each stage group rebuilds
whole parameters from the shards (``engines.py``: the same bucket order on its K ranks,
after the world all-reduce on every rank).

With tensor parallelism (``--tp T``) the unit of failure and of the copy is a tp group:
a unit moves from a group holding the same stage with the same tp sharding (every
template keeps ``--tp``), tp rank r of the sender to tp rank r of the receiver, each its
tp shard r (``blocks.3@r``), so T pairs move 12 / T bytes a parameter each, at once, and
no rank ever gathers a layer whole. The decision lists those T moves as T entries of the
one list (``assignment.expand_moves``): nothing below changes.

Why it cannot deadlock under NCCL: the moves are one list in the decision every member
read from the store, and every rank walks it in the same order, posting a send where it
is the sender and a receive where it is the receiver, each message of a unit in the order
``names_in_unit`` gives on both sides (the same model, the same names). All of a rank's
messages go in one batch, so no send waits on a receive posted later; NCCL matches a
pair's messages in posting order, which is the same on both sides. Receives land in the
new trainer's own tensors (no staging copy); sends read the previous trainer's, which
nothing else touches until the batch completes. The group's tp peers take no part in
each other's messages (each pair is tp rank r to tp rank r), and the counters' all-reduce
and the gathers come after every rank's batch has completed, on every rank alike.
"""

from __future__ import annotations

import torch

from plait import comm
from plait.resilience.assignment import names_in_unit


def copy_state(*, gen, moves, keep: frozenset[str], old, new) -> int:
    """Fill ``new`` (a Trainer built for ``gen``) with the run's state: the units in
    ``keep`` from ``old`` (this worker's previous trainer, up to date), the others from
    the senders of ``moves`` [(receiver, unit, sender), ...]; this worker also sends what
    ``moves`` asks of it from ``old``. A unit's tensors are what its engine's
    ``unit_tensors`` lists: parameters and moments, or (ZeRO inside a replica) this pipeline's
    shards of them, after which the stage group gathers whole parameters from the shards
    (``materialize``). Collective over the generation. Returns the bytes this worker
    received."""
    me, members = gen.worker, gen.assignment.members
    new_names = [n for n, _ in new.engine.named]
    old_names = [n for n, _ in old.engine.named] if old is not None else []
    with torch.no_grad():
        for unit in sorted(keep & gen.assignment.units_of(me)):  # already held: a local copy
            names = names_in_unit(unit, new_names)
            for dst, src in zip(new.engine.unit_tensors(names), old.engine.unit_tensors(names)):
                dst.copy_(src)
        ops, received = [], 0
        for receiver, unit, sender in moves:
            if sender == me:
                peer = members.index(receiver)
                tensors = old.engine.unit_tensors(names_in_unit(unit, old_names))
                ops += [("send", t.contiguous(), peer) for t in tensors]
            if receiver == me:
                peer = members.index(sender)
                for t in new.engine.unit_tensors(names_in_unit(unit, new_names)):
                    ops.append(("recv", t, peer))
                    received += t.numel() * t.element_size()
        topo = gen.world_topology()
        # NCCL: the first batched point-to-point call on a communicator must involve all
        # of its ranks; a barrier brings the world's up with every member first
        comm.barrier(topo=topo, axis="world")
        works = comm.batch_p2p(ops, topo=topo, axis="world")
        comm.wait(works, topo=topo, what="state copy", axis="world")
        agree_counters(gen, new, old)
        new.engine.materialize()
    return received


def agree_counters(gen, new, old) -> None:
    """Loss scale, clean steps and AdamW's step count: the survivors' values (all equal)
    for everyone, by one all-reduce (MAX) in which a new worker contributes zeros."""
    topo = gen.world_topology()
    mine = [0.0, 0.0, 0.0]
    if old is not None:
        mine = [old.scaler.scale, float(old.scaler.good_steps), old.engine.adam_step()]
    t = torch.tensor(mine, dtype=torch.float64, device=topo.device)
    comm.world_all_reduce(t, topo=topo, op=comm.ReduceOp.MAX)
    scale, good, step = t.tolist()
    if new.scaler.enabled:
        new.scaler.load_state_dict({"scale": scale, "good_steps": int(good)})
    new.engine.set_adam_step(step)
