"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): the base
weights are frozen and each targeted linear layer learns a low-rank update,
y = x W^T + (alpha / r) x A^T B^T, with A (r, in) and B (out, r).

Communication (axis tp, t = tp size; r the rank, per targeted layer): none in the forward
or backward beyond the base layer's own. A column-parallel layer's adapter reads the
input the layer already entered (its f or sequence all-gather); a row-parallel layer's
adapter output is a partial sum like the layer's product and is reduced with it by the
same g (or reduce-scatter). Per optimizer step the factor that is replicated over tp has
a gradient each tp rank holds only a part of; ``TPGradSync``'s one all-reduce sums it: 4 r
in bytes (A) per column-parallel target and 4 out r bytes (B) per row-parallel one. Over
dp only the adapters' gradients are reduced (the frozen base has none), so the
data-parallel bytes of ``data_parallel.py`` / ``zero.py`` apply with N = adapter
parameters. Nothing here issues a collective itself, so nothing can deadlock under NCCL.

How the factors are split, to match the base layer (``tensor.py``):

| base layer | A (r, in) | B (out, r) | replicated factor's gradient |
|---|---|---|---|
| column-parallel (q, k, v, up, gate) | replicated | rows, as the weight | A: summed over tp |
| row-parallel (o, down) | columns, as the weight | replicated | B: summed over tp |

Why it is exact: for a column-parallel layer each rank computes its rows of B A x (its
slice of the output) from the whole A; A's gradient is the sum over the ranks' slices.
For a row-parallel layer x A^T = sum over ranks of x_r A_r^T, so B (A_r x_r) summed by
the layer's g is B A x, and B's gradient is the sum of the ranks' parts. Key/value
weights replicated because there are fewer kv heads than tp ranks give B the same
``ShardSpec(replicas=...)``, so ``TPGradSync`` sums those copies as it does the base's.

Initialisation follows PEFT's default: A uniform in +-1/sqrt(in) (Kaiming-uniform with
a = sqrt(5)), B zero, so training starts from the base model exactly. A's full value
depends only on (seed, parameter name), cut with ``tp_shard``: every layout starts alike.

Mixture-of-experts layers (``model/moe.py``): the up / gate / down targets adapt the
stacked expert weights W (E, out, in) -- every expert its own pair, A (E, r, in) and B
(E, out, r), expert e's update scale B[e] A[e] x (``ExpertLoRA``), split over tp as the
table says for its weight (w_fc / w_up / w_gate column-parallel, w_proj / w_down
row-parallel) and, under ``--ep``, held as the experts are: ep rank j holds rows
[j E/n, (j+1) E/n) of both (``expert_shard``), so the expert engine reduces their
gradients over edp and checkpoints place them at their rows. A is cut from the full (E, r,
in) value, so every layout starts alike. Shared experts get the same adapters (dense:
reduced over dp). The router, like every other parameter that is not a targeted weight,
is frozen. Per optimizer step the adapters add 4 r (in + out) E / n bytes to the edp
all-reduce of each adapted expert weight, and nothing to the dispatch.

Names: the adapter of ``blocks.3.attn.q`` is ``blocks.3.attn.q.lora.A`` / ``.lora.B``, of
the experts' ``w_fc`` ``blocks.3.mlp.experts.lora.w_fc.A`` / ``.B``; base weights keep
their names, so checkpoints and Hugging Face export see the base model unchanged plus
the adapters (``model/peft.py`` writes the linear layers' in PEFT's format; PEFT has none
for plait's stacked experts, which export merged only).
"""

from __future__ import annotations

import functools
import math
import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from plait.model.config import ModelConfig
from plait.model.lora_config import EXPERT_TARGETS, LoRAConfig
from plait.parallel.tensor import (
    REPLICATED,
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    mark_tp_partial,
    set_shard,
    shard_spec,
)

_ROW_PARALLEL = ("w_proj", "w_down")  # split over tp by input columns (the rest: by rows)
_ADAPTER = re.compile(r"\.lora\.(?:\w+\.)?(A|B)$")


class LoRA(nn.Module):
    """The low-rank update of one parallel linear layer, split to match it (module doc).
    ``forward(x)`` takes the input the layer multiplies by (its local slice for a
    row-parallel layer) and returns this rank's part of ``scale * B A x``."""

    def __init__(self, layer: nn.Module, *, rank: int, scale: float):
        super().__init__()
        out_local, in_local = layer.weight.shape
        self.scale = scale
        with torch.device(layer.weight.device):
            a = nn.Parameter(torch.empty(rank, in_local, dtype=layer.weight.dtype))
            b = nn.Parameter(torch.empty(out_local, rank, dtype=layer.weight.dtype))
        a.lora_factor = b.lora_factor = True  # ZeRO-3's units lay these out last
        if isinstance(layer, ColumnParallelLinear):
            self.A = mark_tp_partial(set_shard(a, REPLICATED))
            self.B = set_shard(b, shard_spec(layer.weight))
        elif isinstance(layer, RowParallelLinear):
            self.A = set_shard(a, ShardSpec(dim=1))
            self.B = mark_tp_partial(set_shard(b, REPLICATED))
        else:
            raise TypeError(f"LoRA needs a parallel linear layer, got {type(layer).__name__}")

    def autocast_params(self) -> list[nn.Parameter]:
        """Both factors: only ``F.linear`` reads them (``ColumnParallelLinear``'s)."""
        return [self.A, self.B]

    def forward(self, x):  # (..., in or in/t) -> (..., out/t or out)
        # scaled at rank r, not at the output width: one (..., out) temporary fewer
        return F.linear(F.linear(x, self.A) * self.scale, self.B)


class ExpertLoRA(nn.Module):
    """The low-rank updates of one stacked expert weight W (n, out, in) -- an ep rank's n
    experts, its tp slice -- one pair per expert: A (n, r, in), B (n, out, r), split over tp
    as ``LoRA``'s pair beside a column- (``row`` False) or row-parallel layer.
    ``forward(x, e)``: this rank's part of ``scale * B[e] A[e] x`` for expert e's rows."""

    def __init__(self, weight: torch.Tensor, *, rank: int, scale: float, row: bool):
        super().__init__()
        n, out_local, in_local = weight.shape
        self.scale = scale
        with torch.device(weight.device):
            a = nn.Parameter(torch.empty(n, rank, in_local, dtype=weight.dtype))
            b = nn.Parameter(torch.empty(n, out_local, rank, dtype=weight.dtype))
        if row:
            self.A = set_shard(a, ShardSpec(dim=2))
            self.B = mark_tp_partial(set_shard(b, REPLICATED))
        else:
            self.A = mark_tp_partial(set_shard(a, REPLICATED))
            self.B = set_shard(b, ShardSpec(dim=1))
        shard = getattr(weight, "expert_shard", None)
        if shard is not None:  # an ep rank's experts: the adapters are held as they are
            self.A.expert_shard = self.B.expert_shard = shard

    def autocast_params(self) -> list[nn.Parameter]:
        """Both factors: only ``F.linear`` reads them."""
        return [self.A, self.B]

    def forward(self, x, e: int):  # (M_e, in or in/t) -> (M_e, out/t or out)
        return F.linear(F.linear(x, self.A[e]) * self.scale, self.B[e])


def init_adapter(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Full initial value of adapter parameter ``name`` (``....lora.A`` or ``.B``; an
    expert adapter's full (E, r, in) / (E, out, r))."""
    from plait.model.transformer import _param_seed

    if name.endswith(".B"):
        return torch.zeros(shape)
    bound = 1.0 / math.sqrt(shape[-1])  # kaiming_uniform_(a=sqrt(5)) on (r, in)
    g = torch.Generator().manual_seed(_param_seed(seed, name))
    return torch.rand(shape, generator=g) * (2 * bound) - bound


def apply_lora(model: nn.Module, cfg: LoRAConfig, *, arch: str, seed: int) -> list[str]:
    """Freeze every parameter of ``model`` (a whole model, a chunk or a pipeline stage,
    with global names) and attach initialised adapters to the targeted layers of its
    blocks -- and to the stacked experts of its MoE layers (``ExpertLoRA``; the router
    stays frozen). Returns the adapted module names. Call it after loading base weights."""
    wanted = cfg.modules(arch)
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    for name, module in list(model.named_modules()):
        m = re.fullmatch(r"blocks\.\d+\.(.+)", name)
        if not m or m.group(1) not in wanted or getattr(module, "lora", None) is not None:
            continue
        module.lora = LoRA(module, rank=cfg.rank, scale=cfg.scale)
        _init_adapters(module.lora, f"{name}.lora", module.topo, seed)
        adapted.append(name)
    adapted += _apply_expert_lora(model, cfg, arch=arch, seed=seed)
    if not adapted:
        raise ValueError(f"--lora-targets {','.join(cfg.targets)}: no such layer in this model")
    return adapted


@torch.no_grad()
def _init_adapters(module: nn.Module, prefix: str, topo, seed: int) -> None:
    """Give each adapter factor of ``module`` its initial value: this rank's part of the
    full value (``init_adapter``; ``transformer.rank_part``). On a model built on meta
    (ZeRO-3) as an ``init_value()`` the engine calls when it fills the factor's shard, as
    it does the base's (``transformer.defer_init``)."""
    for key, p in module.named_parameters():
        make = functools.partial(_adapter_part, f"{prefix}.{key}", p, topo, seed)
        if p.is_meta:
            p.init_value = make
        else:
            p.copy_(make())


def _adapter_part(name: str, p: torch.Tensor, topo, seed: int) -> torch.Tensor:
    from plait.model.transformer import rank_part, whole_shape

    return rank_part(init_adapter(name, whole_shape(p, topo.tp), seed), p, topo)


def _apply_expert_lora(model: nn.Module, cfg: LoRAConfig, *, arch: str, seed: int) -> list[str]:
    """``ExpertLoRA`` adapters on the targeted stacked weights of every MoE layer's routed
    and shared experts (``blocks.<i>.mlp.experts`` / ``.shared``). Returns their names."""
    from plait.model.moe import Experts

    block = "gpt2" if arch == "gpt2" else "llama"
    weights = [EXPERT_TARGETS[t][block] for t in cfg.targets if block in EXPERT_TARGETS.get(t, {})]
    adapted = []
    for name, module in list(model.named_modules()):
        if not weights or not isinstance(module, Experts) or module.lora is not None:
            continue
        module.lora = nn.ModuleDict({
            w: ExpertLoRA(getattr(module, w), rank=cfg.rank, scale=cfg.scale,
                          row=w in _ROW_PARALLEL)
            for w in weights
        })  # fmt: skip
        _init_adapters(module.lora, f"{name}.lora", module.topo, seed)
        adapted.append(name)
    return adapted


def expert_targets(model_cfg: ModelConfig, cfg: LoRAConfig) -> int:
    """How many of ``cfg``'s targets are weights of ``model_cfg``'s stacked experts (its
    flavour's: gpt2 experts have no gate)."""
    block = "gpt2" if model_cfg.arch == "gpt2" else "llama"
    return sum(1 for t in cfg.targets if block in EXPERT_TARGETS.get(t, {}))


def touches_experts(model_cfg: ModelConfig, cfg: LoRAConfig) -> bool:
    """Whether ``cfg`` adapts the stacked experts of ``model_cfg``'s MoE layers."""
    return model_cfg.moe and expert_targets(model_cfg, cfg) > 0


def is_adapter(name: str) -> bool:
    return _ADAPTER.search(name) is not None


def base_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The frozen base weights of a full state dict (adapters left out)."""
    return {k: v for k, v in state.items() if not is_adapter(k)}


def merged_state(state: dict[str, torch.Tensor], cfg: LoRAConfig) -> dict[str, torch.Tensor]:
    """Full tensors with every adapter folded into its weight: W + (alpha / r) B A, and
    for stacked experts W[e] + (alpha / r) B[e] A[e] for every e."""
    out = base_state(state)
    for key in state:
        m = re.fullmatch(r"(.+)\.lora\.(?:(\w+)\.)?A", key)
        if m is None:
            continue
        layer, expert_weight = m.groups()
        a, b = state[key].detach(), state[key[:-1] + "B"].detach()
        weight = f"{layer}.{expert_weight}" if expert_weight else f"{layer}.weight"
        w = out[weight].detach()
        out[weight] = w + (torch.matmul(b.double(), a.double()) * cfg.scale).to(w.dtype)
    return out


def adapter_params_per_layer(model_cfg: ModelConfig, cfg: LoRAConfig, tp: int = 1,
                             targets: tuple[str, ...] | None = None) -> float:  # fmt: skip
    """Adapter parameters one tp rank holds per dense transformer block (A replicated
    beside a column-parallel layer, B beside a row-parallel one; module doc), of
    ``targets`` (default: all of ``cfg``'s). MoE blocks: ``num_adapter_params``."""
    h, f, kv, r = model_cfg.hidden, model_cfg.ffn_hidden, model_cfg.kv_dim, cfg.rank
    shapes = {  # target -> (in, out, column-parallel?)
        "q": (h, h, True), "k": (h, kv, True), "v": (h, kv, True), "o": (h, h, False),
        "up": (h, f, True), "gate": (h, f, True), "down": (f, h, False),
    }  # fmt: skip
    n = 0.0
    for t in cfg.targets if targets is None else targets:
        i, o, column = shapes[t]
        if t in ("k", "v") and kv < tp * model_cfg.head_dim:  # kv heads replicated over tp
            o_local = model_cfg.head_dim * max(1, model_cfg.n_kv_heads // tp)
            n += r * i + o_local * r
        else:
            n += r * i + o * r / tp if column else r * i / tp + o * r
    return n


class StageAdapters(NamedTuple):
    """Adapter parameters one tp / ep rank holds for some blocks: ``replicated`` (the dense
    blocks', the MoE blocks' attention and shared-expert adapters: trained over dp),
    ``routed`` (its E / ep routed experts': over their edp group), and ``tp_partial``, those
    of either whose gradient ``TPGradSync`` sums over tp (the factor beside the split one)."""

    replicated: float
    routed: float
    tp_partial: float


def stage_adapters(model_cfg: ModelConfig, cfg: LoRAConfig, *, tp: int, ep: int, layers: int,
                   moe_layers: int) -> StageAdapters:  # fmt: skip
    """``StageAdapters`` of ``layers`` blocks, ``moe_layers`` of them MoE. A MoE block's MLP
    targets adapt each expert (``ExpertLoRA``: A (n, r, in), B (n, out, r), split over tp
    as the dense pair), not a dense MLP."""
    h, r = model_cfg.hidden, cfg.rank
    if not touches_experts(model_cfg, cfg):
        n = layers * adapter_params_per_layer(model_cfg, cfg, tp)
        return StageAdapters(n, 0.0, layers * len(cfg.targets) * r * h)
    attention = tuple(t for t in cfg.targets if t not in EXPERT_TARGETS)
    mlp = expert_targets(model_cfg, cfg)
    ffn, S = model_cfg.moe_ffn_hidden, model_cfg.moe_shared_experts
    local = model_cfg.moe_experts / ep

    def expert(width: float) -> float:  # one expert's adapter of each MLP target, a tp rank's
        return mlp * (r * h + width * r / tp)  # the factor on h whole, the other split

    dense = layers - moe_layers
    per_moe = adapter_params_per_layer(model_cfg, cfg, tp, attention) + (
        expert(S * ffn) if S else 0
    )
    replicated = dense * adapter_params_per_layer(model_cfg, cfg, tp) + moe_layers * per_moe
    routed = moe_layers * local * expert(ffn)
    tp_partial = r * h * (dense * len(cfg.targets)
                          + moe_layers * (len(attention) + mlp * (local + (1 if S else 0))))  # fmt: skip
    return StageAdapters(replicated, routed, tp_partial)


def num_adapter_params(model_cfg: ModelConfig, cfg: LoRAConfig, *, active: bool = False) -> int:
    """Adapter parameters of the whole model; a MoE block's MLP targets adapt each of its E
    routed experts (width ``moe_ffn_hidden``) and its shared ones (``active``: only the
    top-k routed experts' adapters, those a token runs through)."""
    n_layers = model_cfg.n_layers
    if not touches_experts(model_cfg, cfg):
        return int(n_layers * adapter_params_per_layer(model_cfg, cfg))
    n_moe = sum(model_cfg.is_moe_layer(i) for i in range(n_layers))
    attention = tuple(t for t in cfg.targets if t not in EXPERT_TARGETS)
    h, f, r = model_cfg.hidden, model_cfg.moe_ffn_hidden, cfg.rank
    mlp = sum(1 for t in cfg.targets if t in EXPERT_TARGETS)  # each (h, F) or (F, h)
    routed = (model_cfg.moe_top_k if active else model_cfg.moe_experts) * mlp * r * (h + f)
    shared = mlp * r * (h + model_cfg.moe_shared_experts * f) if model_cfg.moe_shared_experts else 0
    per_moe = adapter_params_per_layer(model_cfg, cfg, targets=attention) + routed + shared
    dense = (n_layers - n_moe) * adapter_params_per_layer(model_cfg, cfg)
    return int(dense + n_moe * per_moe)


def model_flops_per_token(model_cfg: ModelConfig, cfg: LoRAConfig, seq_len: int | None = None):
    """Training FLOPs per token with frozen base weights: each frozen weight costs 4 per
    token (forward and the input gradient; no weight gradient), each adapter weight 6;
    attention as in ``sizes.model_flops_per_token``. (The first block's frozen layers that
    see no trainable input skip even the input gradient; not counted.)"""
    from plait.model import sizes

    s = model_cfg.seq_len if seq_len is None else seq_len
    attention = 12 * model_cfg.n_layers * s * model_cfg.hidden
    frozen = (sizes.model_flops_per_token(model_cfg, s) - attention) / 6  # matmul weights
    return 4.0 * frozen + 6.0 * num_adapter_params(model_cfg, cfg, active=True) + attention
