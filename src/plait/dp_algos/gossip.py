"""Decentralised (gossip) SGD, ``--dp-algo gossip --topology ...``: each replica steps on its
own gradient, then averages with its graph neighbours only; ``--global-avg-every H``
adds an exact average every H steps (Gossip-PGA, Chen et al. 2021).

Update rule (adapt then combine; Lian et al. 2017; x_i: replica i's parameters after its
optimizer step at step t, from 1):

    x_i <- sum_j W(t)_ij x_j          (j over i and its in-neighbours of round t)
    or, when H divides t, x_i <- (1/R) sum_j x_j   (Gossip-PGA)

W(t) is ``graphs.mixing_matrix``: Metropolis-Hastings weights on the ring, torus,
exponential or complete graph, or (I + P)/2 on the one-peer exponential graph, whose
peer changes every step. W is doubly stochastic, so mixing keeps the replicas' mean; how
fast it shrinks their spread is its spectral gap. The sum runs over replica indices in
increasing order on every replica, so on the complete graph (W = J) every replica gets the
same bits: with ``--optimizer sgd`` that is plain data parallelism.

Communication (axis dp, across replicas; P = 4 x this rank's parameter elements -- its
ZeRO shard under ``--zero-shard-group``): per step, one point-to-point batch per chunk of
``--bucket-mb``: a send of the chunk to each of the d out-neighbours and a receive from
each of the d in-neighbours -- d P bytes sent, d P received, d = ``graphs.degree`` (ring 2,
torus 4, exponential about 2 log2 R, complete R - 1, one-peer 1). On a Gossip-PGA step
instead one all-reduce of P bytes (2 (R-1)/R x P sent). Memory: d receive buffers of a
chunk.

Why this cannot deadlock under NCCL: each round every replica posts one batch
(``comm.batch_p2p``: one ``batch_isend_irecv``, one NCCL group) holding all its sends and
receives of the round -- ``graphs.round_ops``, in its order --, waits for it, mixes, and
only then posts the next chunk's batch; every send of the batch has its receive in the
peer's batch of the same round, and between two replicas at most one message goes each
way per batch, so NCCL's in-order matching pairs them. The tests record the batches
``mix`` posts, for every graph and replica count up to 17, and run them through
``graphs.run_p2p``, i.e. the one model of NCCL's semantics (``plait/nccl_p2p.py``); one
send or receive at a time deadlocks there. Posted by the training thread after the optimizer step, at the same steps
on every rank; tensors on ``topo.device``.
"""

from __future__ import annotations

import torch

from plait import comm
from plait.dp_algos import graphs
from plait.dp_algos.algorithm import Replicas
from plait.topology import Axis


class Gossip(Replicas):
    """Neighbour averaging after every local step (module docstring)."""

    def rewrites_shards(self, step: int) -> bool:
        return True  # every step mixes (or averages)

    def after_step(self, step: int) -> None:
        if self.is_sync(step):  # Gossip-PGA's all-reduce
            self.average()
        else:
            self.mix(step)

    @torch.no_grad()
    def mix(self, step: int) -> None:
        n, i, topology = self.num_replicas, self.index, self.cfg.topology
        recv_from, _ = graphs.neighbours(topology, n, i, step)
        w_self, w_peer = graphs.weights(topology, n, i, step)
        order = sorted([i, *recv_from])  # the same summation order on every replica
        batch = graphs.round_ops(topology, n, i, step)  # the batch graphs.run_p2p checks
        for run in self.chunks():
            flat = self.pack(run)
            received = {j: torch.empty_like(flat) for j in recv_from}
            ops = [
                (kind, flat if kind == "send" else received[j], self.peer(j)) for kind, j in batch
            ]
            works = comm.batch_p2p(ops, topo=self.across, axis=Axis.DP)
            comm.wait(works, topo=self.across, what="gossip send/recv", axis="dp")
            mixed = torch.zeros_like(flat)
            for j in order:
                if j == i:
                    mixed.add_(flat, alpha=w_self)
                else:
                    mixed.add_(received[j], alpha=w_peer[j])
            self.unpack(mixed, run)
        self.engine.shards_changed()
