"""Flags shared by the subcommands that describe a model and a layout
(``train``, ``info``, ``simulate``, ``plan``), and their conversion to configs.

The CLI only overrides config fields: a flag left unset keeps the config file's value or
the dataclass default. Every flag defaults to None here for that reason.
"""

from __future__ import annotations

import argparse

from plait.dp_algos.config import ALGOS, EF21_STARTS, TOPOLOGIES, DPAlgoConfig
from plait.layout import CP_MODES, DTYPES, RECOMPUTE, SCHEDULES, Layout
from plait.model.config import FLAVOURS, PRESETS, ModelConfig, preset

MODEL_FLAGS = {  # flag dest -> ModelConfig field
    "layers": "n_layers",
    "hidden": "hidden",
    "heads": "n_heads",
    "kv_heads": "n_kv_heads",
    "ffn_hidden": "ffn_hidden",
    "vocab_size": "vocab_size",
    "seq_len": "seq_len",
    "dropout": "dropout",
    **{f: f for f in ("moe_experts", "moe_top_k", "moe_every", "moe_shared_experts",
                      "moe_ffn_hidden", "moe_router", "moe_norm_topk", "moe_capacity_factor",
                      "moe_aux_loss_coef", "moe_z_loss_coef", "moe_bias_rate")},
}  # fmt: skip

LAYOUT_FLAGS = (
    "dp",
    "tp",
    "pp",
    "cp",
    "cp_mode",
    "document_mask",
    "ep",
    "vpp",
    "schedule",
    "micro_batch_size",
    "global_batch_size",
    "zero",
    "zero_shard_group",
    "offload_optimizer",
    "sequence_parallel",
    "recompute",
    "recompute_layers",
    "dtype",
    "fp32_residual",
    "pp_layout",
    "pp_partition",
    "bucket_mb",
)


DP_ALGO_FLAGS = (  # flag dest == DPAlgoConfig field
    "dp_algo",
    "sync_every",
    "local_warmup",
    "sync_optimizer_state",
    "outer_lr",
    "outer_momentum",
    "topology",
    "global_avg_every",
    "compress",
    "compress_warmup",
    "ef21_start",
)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def model_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help=f"preset: {', '.join(PRESETS)} (default tiny)")
    g.add_argument("--arch", choices=FLAVOURS, default=None,
                   help="flavour of the preset: block design and its family's defaults")  # fmt: skip
    g.add_argument("--layers", type=int, default=None)
    g.add_argument("--hidden", type=int, default=None)
    g.add_argument("--heads", type=int, default=None)
    g.add_argument("--kv-heads", type=int, default=None)
    g.add_argument("--ffn-hidden", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--seq-len", type=int, default=None)
    g.add_argument("--dropout", type=float, default=None)
    g = p.add_argument_group("mixture of experts (model/moe.py)")
    g.add_argument("--moe-experts", type=int, metavar="E", default=None,
                   help="routed experts per MoE block (default 0: dense)")  # fmt: skip
    g.add_argument("--moe-top-k", type=int, metavar="K", default=None,
                   help="experts each token goes to (default 2)")  # fmt: skip
    g.add_argument("--moe-every", type=int, metavar="M", default=None,
                   help="every M-th block is MoE, the others dense (default 1)")  # fmt: skip
    g.add_argument("--moe-shared-experts", type=int, metavar="S", default=None,
                   help="always-on experts beside the routed ones (default 0)")  # fmt: skip
    g.add_argument("--moe-ffn-hidden", type=int, default=None,
                   help="FFN width of one expert (default --ffn-hidden)")  # fmt: skip
    g.add_argument("--moe-router", choices=("softmax", "sigmoid"), default=None,
                   help="router scores (fp32); sigmoid normalises the top-k weights")  # fmt: skip
    g.add_argument("--moe-norm-topk", action=argparse.BooleanOptionalAction, default=None,
                   help="divide the top-k weights by their sum (default on)")  # fmt: skip
    g.add_argument("--moe-capacity-factor", type=float, metavar="C", default=None,
                   help="drop the lowest-scoring assignments beyond C x fair share "
                   "(default: dropless)")  # fmt: skip
    g.add_argument("--moe-aux-loss-coef", type=float, default=None,
                   help="Switch load-balancing loss (default 0.01)")  # fmt: skip
    g.add_argument("--moe-z-loss-coef", type=float, default=None,
                   help="router z-loss (default 0)")  # fmt: skip
    g.add_argument("--moe-bias-rate", type=float, metavar="R", default=None,
                   help="auxiliary-loss-free balancing: expert bias step (default 0: off)")  # fmt: skip
    return p


def layout_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    g = p.add_argument_group("layout")
    g.add_argument("--dp", type=int, default=None, help="data-parallel replicas")
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks")
    g.add_argument("--pp", type=int, default=None, help="pipeline stages")
    g.add_argument("--cp", type=int, default=None,
                   help="context-parallel ranks: each holds 1/cp of every sequence")  # fmt: skip
    g.add_argument("--cp-mode", choices=CP_MODES, default=None,
                   help="how --cp exchanges keys and values: ring (default), allgather, a2a "
                   "(Ulysses); docs/context-parallel.md")  # fmt: skip
    g.add_argument("--document-mask", action="store_true", default=None,
                   help="attention stops at end-of-text tokens (packed documents)")  # fmt: skip
    g.add_argument("--ep", type=int, default=None,
                   help="expert-parallel ranks (of the --dp ranks): MoE experts split over them")  # fmt: skip
    g.add_argument("--vpp", type=int, default=None, help="model chunks per pipeline rank")
    g.add_argument("--schedule", choices=SCHEDULES, default=None)
    g.add_argument("--pp-layout", type=_int_list, default=None, help="layers per stage: 5,6,6,5")
    g.add_argument("--pp-partition", choices=("uniform", "balanced"), default=None,
                   help="layers to stages: even counts, or balanced by cost")  # fmt: skip
    g.add_argument("--micro-batch-size", type=int, default=None, help="sequences")
    g.add_argument("--global-batch-size", type=int, default=None, help="sequences")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None)
    g.add_argument("--zero-shard-group", type=int, default=None)
    g.add_argument("--offload-optimizer", action="store_true", default=None)
    g.add_argument("--sequence-parallel", action="store_true", default=None)
    g.add_argument("--recompute", choices=RECOMPUTE, default=None)
    g.add_argument("--recompute-layers", type=int, metavar="N", default=None,
                   help="with --recompute full: only the first N blocks of each model chunk "
                   "(pipeline stage) recompute; the rest keep their activations")  # fmt: skip
    g.add_argument("--dtype", choices=DTYPES, default=None)
    g.add_argument("--fp32-residual", action="store_true", default=None,
                   help="bf16 / fp16: keep the residual stream in fp32 (Megatron's "
                   "--fp32-residual-connection); by default it is in the compute dtype")  # fmt: skip
    g.add_argument("--bucket-mb", type=float, default=None,
                   help="gradient bucket size in MiB for ZeRO 0-2 (default 25, as DDP)")  # fmt: skip
    return p


def dp_algo_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    g = p.add_argument_group("data-parallel algorithm (across replicas; docs/comm-efficient.md)")
    g.add_argument("--dp-algo", choices=ALGOS, default=None,
                   help="gradient all-reduce (default), local SGD, DiLoCo or gossip")  # fmt: skip
    g.add_argument("--sync-every", type=int, default=None, metavar="H",
                   help="local-sgd / diloco: average every H steps")  # fmt: skip
    g.add_argument("--local-warmup", type=int, default=None, metavar="K",
                   help="local-sgd: K plain data-parallel steps first (post-local SGD)")  # fmt: skip
    g.add_argument("--sync-optimizer-state", action="store_true", default=None,
                   help="local-sgd: average the optimizer's momentum (AdamW: both moments) "
                   "with the parameters at each sync (1 or 2 more parameter-sized all-reduces)")  # fmt: skip
    g.add_argument("--outer-lr", type=float, default=None, help="diloco (default 0.7)")
    g.add_argument("--outer-momentum", type=float, default=None, help="diloco (default 0.9)")
    g.add_argument("--topology", choices=TOPOLOGIES, default=None, help="gossip's graph")
    g.add_argument("--global-avg-every", type=int, default=None, metavar="H",
                   help="gossip: exact average every H steps (Gossip-PGA)")  # fmt: skip
    g.add_argument("--compress", default=None, metavar="SPEC",
                   help="per-step gradients: qsgd:LEVELS | topk:RATIO | powersgd:RANK | "
                   "bf16 | int8; local-sgd / diloco syncs: bf16 | int8")  # fmt: skip
    g.add_argument("--compress-warmup", type=int, default=None, metavar="W",
                   help="--compress: W plain all-reduce steps first (default 0)")  # fmt: skip
    g.add_argument("--ef21-start", choices=EF21_STARTS, default=None,
                   help="--compress topk with --compress-warmup: EF21's estimates start from "
                   "the last plain step's gradients (default) or from zero")  # fmt: skip
    return p


def model_layout_parser(
    sub,
    name: str,
    *,
    lora: bool = True,
    config_help: str = "YAML or TOML file of flag values",
    **kw,
) -> argparse.ArgumentParser:
    """The subparser of a verb that describes a model and a layout (``train``, ``info``,
    ``simulate``, ``plan``): the model, layout, LoRA (``lora``) and data-parallel flags,
    and ``--config``, a file of their values under the flags. ``kw``: ``help`` and the
    rest of ``add_parser``'s arguments."""
    parents = [model_parent(), layout_parent(), *([lora_parent()] if lora else []),
               dp_algo_parent()]  # fmt: skip
    p = sub.add_parser(name, parents=parents, allow_abbrev=False, **kw)
    p.add_argument("--config", help=config_help)
    return p


def dp_algo_config(values: dict) -> DPAlgoConfig:
    fields = {k: values[k] for k in DP_ALGO_FLAGS if values.get(k) is not None}
    if "dp_algo" in fields:
        fields["algo"] = fields.pop("dp_algo")
    return DPAlgoConfig(**fields)


def model_config(values: dict) -> ModelConfig:
    """ModelConfig from a flat mapping of flag values (config file merged with flags)."""
    overrides = {MODEL_FLAGS[k]: v for k, v in values.items() if k in MODEL_FLAGS and v is not None}
    return preset(values.get("model") or "tiny", arch=values.get("arch"), **overrides)


def layout_config(values: dict) -> Layout:
    fields = {k: values[k] for k in LAYOUT_FLAGS if values.get(k) is not None}
    if "pp_layout" in fields:
        fields["pp_layout"] = tuple(fields["pp_layout"])
    return Layout(**fields)


def lora_parent() -> argparse.ArgumentParser:
    """LoRA fine-tuning flags (``train``, ``info``, ``simulate``): base frozen, adapters
    trained -- what changes the model state a rank holds."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    g = p.add_argument_group("LoRA fine-tuning")
    g.add_argument("--lora-rank", type=int, metavar="R", default=None,
                   help="train LoRA adapters of rank R; the base weights stay frozen")  # fmt: skip
    g.add_argument("--lora-alpha", type=float, metavar="A", default=None,
                   help="adapter scale A / R (default A = R)")  # fmt: skip
    g.add_argument("--lora-targets", metavar="LIST", default=None,
                   help="layers with adapters, from q,k,v,o,up,down,gate (default q,v)")  # fmt: skip
    return p


def lora_config(values: dict):
    """LoRAConfig from the flags, or None without --lora-rank (ValueError on bad ones)."""
    from plait.model.lora_config import LoRAConfig

    if values.get("lora_rank") is None:
        if values.get("lora_alpha") is not None or values.get("lora_targets"):
            raise ValueError("--lora-alpha and --lora-targets need --lora-rank")
        return None
    lora = {"rank": values["lora_rank"], "alpha": values.get("lora_alpha")}
    if values.get("lora_targets"):
        lora["targets"] = values["lora_targets"]
    return LoRAConfig(**lora)
