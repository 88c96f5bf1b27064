"""The parallel layout of a run: how many ways each axis splits, and how a step is cut up.

Read by the topology, the parallel runtime, the trainer, the simulator and the planner;
it imports nothing from torch so the simulator and planner can use it freely.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plait.model.config import ModelConfig

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
DTYPES = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "selective", "full")
CP_MODES = ("ring", "allgather", "a2a")  # parallel/context.py


def check_tp_split(model: ModelConfig, tp: int) -> None:
    """Raise ValueError (one line naming the flags) if tensor parallelism of ``tp`` cannot
    split ``model``. The vocabulary never blocks it: it is padded to a multiple of tp."""
    if model.n_heads % tp:
        raise ValueError(
            f"--tp {tp} does not divide --heads {model.n_heads}; use a --tp that divides it"
        )
    kv = model.n_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(
            f"--tp {tp} and --kv-heads {kv}: one must divide the other "
            "(key/value heads are split, or replicated when fewer than tp)"
        )
    if model.ffn_hidden % tp:
        raise ValueError(f"--tp {tp} does not divide --ffn-hidden {model.ffn_hidden}")


# Gradient bucket (MiB), PyTorch DDP's default: large enough to amortise a collective's
# latency, small enough that the first bucket starts early in the backward.
DEFAULT_BUCKET_MB = 25.0


@dataclass(frozen=True, kw_only=True)
class Layout:
    """dp x cp x tp x pp processes; a global batch of ``global_batch_size`` sequences split
    into ``num_microbatches`` micro-batches of ``micro_batch_size`` on each data-parallel
    rank, each sequence split over the ``cp`` ranks of a context-parallel ring (every cp rank
    of a dp rank takes the same rows)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: each rank holds 1/cp of every sequence
    cp_mode: str = "ring"  # ring | allgather | a2a (parallel/context.py)
    document_mask: bool = False  # attention stops at end-of-text tokens
    ep: int = 1  # expert parallelism: MoE experts split over ep of the dp ranks (not more ranks)
    vpp: int = 1  # model chunks per pipeline rank (interleaved schedule)
    schedule: str = "1f1b"
    micro_batch_size: int = 1
    global_batch_size: int = 8
    zero: int = 0
    zero_shard_group: int | None = None  # shard within groups of K dp ranks (HSDP)
    offload_optimizer: bool = False
    sequence_parallel: bool = False
    recompute: str = "none"
    # --recompute full on only the first N blocks of each model chunk (a pipeline stage's,
    # or the whole model's); the others keep their activations (Megatron's
    # --recompute-method block --recompute-num-layers N). None: every block
    recompute_layers: int | None = None
    dtype: str = "fp32"
    # bf16 / fp16: keep the residual stream fp32 (Megatron's --fp32-residual-connection);
    # by default it is in the compute dtype (model/transformer.py, Embedding)
    fp32_residual: bool = False
    pp_layout: tuple[int, ...] | None = None  # layers per virtual stage, e.g. (5, 6, 6, 5)
    pp_partition: str = "uniform"  # uniform | balanced (by per-layer cost, embedding and head)
    bucket_mb: float = DEFAULT_BUCKET_MB  # data-parallel gradient buckets (ZeRO 0-2)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "vpp", "global_batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.fp32_residual and self.dtype == "fp32":
            raise ValueError(
                "--fp32-residual keeps a bf16 / fp16 run's residual stream in fp32; use it "
                "with --dtype bf16 or fp16 (under fp32 everything is fp32 already)"
            )
        if self.recompute not in RECOMPUTE:
            raise ValueError(
                f"--recompute {self.recompute!r}: choose one of {', '.join(RECOMPUTE)}"
            )
        if self.recompute_layers is not None:
            if self.recompute != "full":
                raise ValueError(
                    "--recompute-layers N recomputes the first N blocks of each model chunk "
                    "in full; use it with --recompute full"
                )
            if self.recompute_layers < 1:
                raise ValueError(
                    f"--recompute-layers must be at least 1, got {self.recompute_layers} "
                    "(no block recomputed: --recompute none)"
                )
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"--zero must be 0, 1, 2 or 3, got {self.zero}")
        per_step = self.micro_batch_size * self.dp
        if self.global_batch_size % per_step:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} is not divisible by "
                f"--micro-batch-size {self.micro_batch_size} x --dp {self.dp} = {per_step}; "
                f"use a multiple of {per_step}"
            )
        if self.vpp > 1 and self.schedule != "interleaved-1f1b":
            raise ValueError("--vpp > 1 needs --schedule interleaved-1f1b")
        if self.schedule == "interleaved-1f1b" and self.pp > 1:
            if self.num_microbatches % self.pp:
                raise ValueError(
                    f"--schedule interleaved-1f1b needs the micro-batches per step "
                    f"({self.num_microbatches}) to be a multiple of --pp {self.pp}"
                )
        if self.pp_partition not in ("uniform", "balanced"):
            raise ValueError(
                f"--pp-partition {self.pp_partition!r}: choose one of uniform, balanced"
            )
        if not self.bucket_mb > 0:
            raise ValueError(f"--bucket-mb must be positive (e.g. 25), got {self.bucket_mb}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("--sequence-parallel needs --tp > 1")
        if self.zero_shard_group is not None:
            if self.zero == 0:
                raise ValueError("--zero-shard-group needs --zero 1, 2 or 3")
            if self.zero_shard_group < 1 or self.dp % self.zero_shard_group:
                raise ValueError(
                    f"--zero-shard-group {self.zero_shard_group} must divide --dp {self.dp}"
                )
        if self.offload_optimizer and self.zero == 0:
            raise ValueError("--offload-optimizer needs --zero 1, 2 or 3")
        if self.dp % self.ep:
            raise ValueError(
                f"--ep {self.ep} must divide --dp {self.dp} (expert-parallel ranks are carved "
                "out of the data-parallel ones)"
            )
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"--cp-mode {self.cp_mode!r}: choose one of {', '.join(CP_MODES)}")

    def recomputed_blocks(self, layers: int) -> int:
        """How many of a model chunk's ``layers`` blocks re-run their forward in the
        backward: its first ``recompute_layers`` (all of them when that is None) under
        ``--recompute full``, none otherwise (``selective`` re-runs every block's attention
        core, not its forward)."""
        if self.recompute != "full":
            return 0
        return layers if self.recompute_layers is None else min(self.recompute_layers, layers)

    def recomputed_share(self, n_layers: int, stage_layers=None) -> float:
        """The share of a model's ``n_layers`` blocks that recompute as ``--recompute``
        says: all of them, but under ``--recompute-layers`` the chunks' first ones
        (``recomputed_blocks`` over the virtual stages of ``stage_layers`` layers: by
        default ``--pp-layout``, or as even as the layers allow)."""
        if self.recompute_layers is None or n_layers < 1:
            return 1.0
        S = self.num_stages
        parts = stage_layers or self.pp_layout or [n_layers // S + (i < n_layers % S)
                                                   for i in range(S)]  # fmt: skip
        return sum(self.recomputed_blocks(n) for n in parts) / n_layers

    def without_recompute(self) -> Layout:
        """This layout for the blocks ``recomputed_blocks`` leaves out: no recomputation."""
        return dataclasses.replace(self, recompute="none", recompute_layers=None)

    def recomputing_all(self) -> Layout:
        """This layout for the blocks ``recomputed_blocks`` counts: every block in full."""
        return dataclasses.replace(self, recompute_layers=None)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def num_stages(self) -> int:
        """Virtual pipeline stages: pp ranks times model chunks per rank."""
        return self.pp * self.vpp

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d["pp_layout"] is not None:
            d["pp_layout"] = list(d["pp_layout"])
        return d

    def check_model(self, model: ModelConfig) -> None:
        """Raise ValueError (one actionable line) if this layout cannot split ``model``."""
        tp = self.tp
        check_tp_split(model, tp)
        if self.pp_layout is not None:
            if len(self.pp_layout) != self.num_stages:
                raise ValueError(
                    f"--pp-layout has {len(self.pp_layout)} entries; it needs one per stage "
                    f"(--pp x --vpp = {self.num_stages})"
                )
            if sum(self.pp_layout) != model.n_layers or min(self.pp_layout) < 1:
                raise ValueError(
                    f"--pp-layout {','.join(map(str, self.pp_layout))} must be positive and "
                    f"sum to --layers {model.n_layers}"
                )
        elif model.n_layers < self.num_stages:
            raise ValueError(
                f"--pp {self.pp} x --vpp {self.vpp} = {self.num_stages} stages but the model "
                f"has only {model.n_layers} layers; use at most {model.n_layers} stages"
            )
        if self.sequence_parallel and model.seq_len % tp:
            raise ValueError(f"--sequence-parallel needs --seq-len divisible by --tp {tp}")
        if self.cp > 1:
            check_cp_split(model, self)
        if self.ep > 1 and not model.moe:
            raise ValueError(f"--ep {self.ep} needs a mixture of experts (--moe-experts)")
        if self.ep > 1 and model.moe_experts % self.ep:
            raise ValueError(
                f"--ep {self.ep} must divide --moe-experts {model.moe_experts} (each rank "
                "holds the same number of experts)"
            )
        if self.document_mask and model.sliding_window is not None:
            raise ValueError("--document-mask does not combine with a sliding window yet")


def check_cp_split(model: ModelConfig, layout: Layout) -> None:
    """Raise ValueError (one line naming the flags) if context parallelism of ``layout.cp``
    cannot split ``model``'s sequences (parallel/context.py holds the reasons)."""
    cp, tp = layout.cp, layout.tp
    if model.seq_len % (2 * cp):
        raise ValueError(
            f"--cp {cp} needs --seq-len ({model.seq_len}) divisible by 2 x --cp = {2 * cp} "
            "(each cp rank holds two equal chunks of every sequence)"
        )
    if layout.sequence_parallel and (model.seq_len // cp) % tp:
        raise ValueError(
            f"--sequence-parallel with --cp {cp} needs --seq-len / --cp "
            f"({model.seq_len // cp}) divisible by --tp {tp}"
        )
    if layout.cp_mode == "a2a":
        heads, kv = model.n_heads // tp, max(1, model.n_kv_heads // tp)
        if heads % cp or kv % cp:
            raise ValueError(
                f"--cp-mode a2a splits each tp rank's {heads} attention heads and {kv} "
                f"key/value heads over --cp {cp}, which must divide both; use --cp-mode ring "
                "or allgather"
            )
    if model.sliding_window is not None:
        raise ValueError("--cp does not support --sliding-window yet; use --cp 1")
    if getattr(model, "moe_experts", 0) and model.moe_capacity_factor is not None:
        raise ValueError(
            "--moe-capacity-factor with --cp: an expert keeps the best-scoring assignments of "
            "the whole sequence, which no cp rank sees (its ring holds the rest); drop "
            "--moe-capacity-factor (dropless) or use --cp 1"
        )
    if model.dropout:
        raise ValueError(
            "--cp computes attention without dropout; use --dropout 0 (the default) with --cp"
        )
