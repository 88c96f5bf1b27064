"""Communication-efficient data parallelism on the dp axis: less often (``local_sgd``:
local SGD, DiLoCo), with fewer peers (``gossip`` over the graphs of ``graphs``), or with
fewer bits (``compression`` codecs moved by ``compressed_grads``). ``config`` says what was
asked for, ``volume`` how many bytes each algorithm sends per step (the tests and the
simulator use the same formulas), ``algorithm`` what they share.

The trainer builds one algorithm per run::

    algo = dp_algos.build(cfg.dp_algo, topo=topo, layout=layout, seed=seed)  # collective
    engine = build_data_parallel(model, topo=algo.engine_topo, ...,
                                 compression=algo.compression)
    algo.attach(engine, model)
"""

from __future__ import annotations

from plait.dp_algos.config import DPAlgoConfig


def build(cfg: DPAlgoConfig, *, topo, layout, seed: int = 0):
    """The ``DPAlgorithm`` for ``cfg`` (``algorithm.py``). Collective over the world when
    replicas differ (``Topology.replica_grid`` creates their groups)."""
    from plait.dp_algos import algorithm

    cfg.check_layout(layout)
    if cfg.algo == "allreduce":
        return algorithm.Synchronous(cfg, topo=topo, layout=layout, seed=seed)
    if cfg.algo == "gossip":
        from plait.dp_algos.gossip import Gossip

        return Gossip(cfg, topo=topo, layout=layout, seed=seed)
    from plait.dp_algos.local_sgd import DiLoCo, LocalSGD

    cls = DiLoCo if cfg.algo == "diloco" else LocalSGD
    return cls(cfg, topo=topo, layout=layout, seed=seed)


__all__ = ["DPAlgoConfig", "build"]
