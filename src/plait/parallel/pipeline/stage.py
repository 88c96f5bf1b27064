"""This pipeline rank's model chunks: which layers it holds, built with global names.

Communication: none here (the executor moves activations; see ``executor.py``).

With p pipeline ranks and v chunks per rank the model is cut into S = p * v virtual
stages (``partition.py`` decides how many layers each gets) and rank r holds chunks
c = 0 .. v - 1, chunk c being virtual stage c * p + r (``schedules.virtual_stage``).
Worked example, 8 layers, p = 2, v = 2, uniform: stages hold layers [0, 1] [2, 3] [4, 5]
[6, 7]; rank 0 holds stages 0 and 2 (layers 0, 1 and 4, 5, plus the embedding), rank 1
stages 1 and 3 (layers 2, 3 and 6, 7, plus the final norm, head and loss).

Every chunk is a ``Transformer`` over its global block indices, so parameters are named
(and therefore initialised, checkpointed and loaded) exactly as in the whole model. Tied
embeddings (gpt2): the last stage keeps its own copy of ``embed.tokens.weight``; the
executor adds the two copies' gradients after each step's backward so they stay equal,
and the last stage's copy is marked ``grad_owner = False`` so the global gradient norm
counts the weight once. A checkpoint stores it once (DCP keeps one of equal keys).
"""

from __future__ import annotations

from torch import nn

from plait.layout import Layout
from plait.model.config import ModelConfig
from plait.model.transformer import Transformer, build_model
from plait.parallel.pipeline.partition import partition_layers, stage_costs_from_model
from plait.parallel.pipeline.schedules import build_schedule, validate, virtual_stage
from plait.topology import Topology

PARTITIONS = ("uniform", "balanced")


def stage_layers(model_cfg: ModelConfig, layout: Layout, *, method: str = "uniform") -> list[range]:
    """Global layer indices of every virtual stage, in stage order.

    ``layout.pp_layout`` (``--pp-layout 1,3``) wins; else ``method``: ``uniform`` or
    ``balanced`` (FLOP costs from the model, the head counted on the last stage).
    """
    stages = layout.num_stages
    if layout.pp_layout is not None:
        return partition_layers(
            model_cfg.n_layers, stages, method="explicit", explicit=layout.pp_layout
        )
    if method == "balanced":
        costs, first, last = stage_costs_from_model(model_cfg, model_cfg.seq_len)
        return partition_layers(
            model_cfg.n_layers,
            stages,
            method="balanced",
            layer_costs=costs,
            first_extra=first,
            last_extra=last,
        )
    if method != "uniform":
        raise ValueError(f"--pp-partition {method!r}: choose one of {', '.join(PARTITIONS)}")
    return partition_layers(model_cfg.n_layers, stages, method="uniform")


def check_pipeline(model_cfg: ModelConfig, layout: Layout, *, method: str = "uniform") -> None:
    """Everything about a pipeline layout that can fail, checked before any worker starts:
    the partition and the schedule (built and ``validate``d: matched sends and receives,
    no deadlock). Raises ValueError (one line naming the flag). Cheap: pure Python."""
    if layout.pp == 1:
        return
    stage_layers(model_cfg, layout, method=method)
    kw = dict(num_ranks=layout.pp, num_microbatches=layout.num_microbatches, num_chunks=layout.vpp)
    validate(build_schedule(layout.schedule, **kw), **kw)


class PipelineStage(nn.Module):
    """This rank's chunks, seen as one module whose parameter names are global.

    ``chunks[c]`` runs virtual stage ``stages[c]``. The chunks' submodules are registered
    here under the whole model's names (``blocks.<i>``, ``embed``, ``norm``, ``head``) so
    ``named_parameters``, ``train()``, ``to()`` and the checkpoint code see one model
    with global names; the chunks themselves are kept in a plain list (not registered
    twice) and used for the forward passes.
    """

    def __init__(self, chunks: list[Transformer], stages: list[int], *, num_stages: int):
        super().__init__()
        self.chunks = list(chunks)
        self.stages = list(stages)
        self.num_stages = num_stages
        self.blocks = nn.ModuleDict()
        for chunk in self.chunks:
            self.blocks.update(chunk.blocks)
            for name in ("embed", "norm", "head"):
                if hasattr(chunk, name):
                    assert not hasattr(self, name), f"two chunks on one rank hold {name}"
                    self.add_module(name, getattr(chunk, name))

    def train(self, mode: bool = True):
        super().train(mode)
        for chunk in self.chunks:
            chunk.training = mode
        return self

    @property
    def tied_copy(self) -> nn.Parameter | None:
        """The token embedding when this rank holds one of the two tied copies and trains
        it (a frozen one, under LoRA, has no gradient to exchange), else None."""
        first, last = 0 in self.stages, self.num_stages - 1 in self.stages
        if self.chunks[0].cfg.tied_embeddings and (first or last) and hasattr(self, "embed"):
            w = self.embed.tokens.weight
            return w if w.requires_grad else None
        return None


def build_stage(
    model_cfg: ModelConfig,
    layout: Layout,
    *,
    topo: Topology,
    seed: int,
    method: str = "uniform",
    device="cpu",
    ep=None,
) -> PipelineStage:
    """Build this rank's chunks (``topo.pp_rank``) with their deterministic initial weights
    (``ep``: the MoE layers' expert-parallel group, as ``build_model`` takes it)."""
    check_pipeline(model_cfg, layout, method=method)
    parts = stage_layers(model_cfg, layout, method=method)
    num_stages = layout.num_stages
    chunks, stages = [], []
    for c in range(layout.vpp):
        s = virtual_stage(topo.pp_rank, c, layout.pp)
        chunk = build_model(
            model_cfg,
            seed=seed,
            topo=topo,
            layers=parts[s],
            pre=s == 0,
            post=s == num_stages - 1,
            recompute=layout.recompute,
            recompute_layers=layout.recompute_layers,
            sequence_parallel=layout.sequence_parallel,
            fp32_residual=layout.fp32_residual,
            cp_mode=layout.cp_mode,
            device=device,
            ep=ep,
        )
        if model_cfg.tied_embeddings and s == num_stages - 1:
            chunk.embed.tokens.weight.grad_owner = False  # rank 0's copy is counted
        chunks.append(chunk)
        stages.append(s)
    return PipelineStage(chunks, stages, num_stages=num_stages)
