"""What ``--dp-algo`` and ``--compress`` ask for: a frozen config the trainer, the
simulator and the planner read, and the check that it makes sense with a layout.

Imports nothing from torch: the simulator and the planner use it freely.

Vocabulary used across ``dp_algos``: a *replica* is one copy of the model, i.e. the tp x
pp ranks of one dp index -- or, with ZeRO and ``--zero-shard-group K``, of K consecutive
dp indices, which shard that copy among themselves. R = dp / K replicas (K = 1 without
ZeRO). The algorithms run *across* replicas; everything inside a replica is the ordinary
engine (``parallel/engine.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ALGOS = ("allreduce", "local-sgd", "diloco", "gossip")
TOPOLOGIES = ("ring", "torus", "exponential", "one-peer-exponential", "complete")
CODECS = ("qsgd", "topk", "powersgd", "bf16", "int8")
# what a local SGD / DiLoCo sync can send its parameter change as (summable codecs: the sync
# stays an all-reduce)
SYNC_CODECS = ("bf16", "int8")
EF21_STARTS = ("gradient", "zero")  # top-k's estimates after --compress-warmup
MAX_QSGD_LEVELS = 127  # levels travel as one signed byte per element
MAX_INT8_REPLICAS = 127  # int8: each of R replicas gets 127 // R levels, so their sum fits


def parse_compress(spec: str) -> tuple[str, float | int | None]:
    """``"qsgd:8"`` -> ("qsgd", 8); ``"topk:0.01"`` -> ("topk", 0.01); ``"powersgd:4"`` ->
    ("powersgd", 4); ``"bf16"`` -> ("bf16", None); ``"int8"`` -> ("int8", None).
    ValueError (one line) otherwise."""
    what = "--compress: use qsgd:LEVELS, topk:RATIO, powersgd:RANK, bf16 or int8"
    name, _, arg = str(spec).partition(":")
    if name not in CODECS:
        raise ValueError(f"--compress {spec!r} is unknown; {what[12:]}")
    if name in SYNC_CODECS:
        if arg:
            raise ValueError(f"--compress {spec!r}: {name} takes no argument")
        return name, None
    try:
        value = float(arg) if name == "topk" else int(arg)
    except ValueError:
        raise ValueError(f"--compress {spec!r}: {name} needs a number after the colon; {what[12:]}")
    if name == "qsgd" and not 1 <= value <= MAX_QSGD_LEVELS:
        raise ValueError(
            f"--compress {spec!r}: QSGD levels must be 1..{MAX_QSGD_LEVELS} (one byte each)"
        )
    if name == "topk" and not 0 < value <= 1:
        raise ValueError(f"--compress {spec!r}: the top-k ratio must be in (0, 1], e.g. 0.01")
    if name == "powersgd" and value < 1:
        raise ValueError(f"--compress {spec!r}: the PowerSGD rank must be at least 1, e.g. 4")
    return name, value


def _steps_flag(flag: str, value: int, *, applies: bool, where: str) -> None:
    """A count of steps that only some algorithms read: set only where it applies, and
    not negative."""
    if value and not applies:
        raise ValueError(f"{flag} applies to {where}")
    if value < 0:
        raise ValueError(f"{flag} must be >= 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class DPAlgoConfig:
    """The data-parallel algorithm across replicas (module docstring)."""

    algo: str = "allreduce"
    sync_every: int | None = None  # H: local-sgd / diloco average every H steps
    local_warmup: int = 0  # local-sgd: plain data-parallel steps first (post-local SGD)
    # local-sgd: average the optimizer's elementwise state with the parameters at each sync
    sync_optimizer_state: bool = False
    outer_lr: float = 0.7  # diloco: Nesterov outer optimizer (Douillard et al. 2023)
    outer_momentum: float = 0.9
    topology: str = "ring"  # gossip's graph
    global_avg_every: int = 0  # gossip: exact average every H steps (Gossip-PGA); 0: never
    # allreduce: the per-step gradient's codec, qsgd:LEVELS | topk:RATIO | powersgd:RANK |
    # bf16 | int8; local-sgd / diloco: the sync's, bf16 | int8 (the parameter change since
    # the last sync, sent in that form)
    compress: str | None = None
    # plain all-reduce steps before compressing (PyTorch's start_powerSGD_iter; DGC's warm-up)
    compress_warmup: int = 0
    # topk: EF21's estimates after the warm-up -- the last plain step's gradients or zero
    ef21_start: str = "gradient"

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise ValueError(f"--dp-algo {self.algo!r}: choose one of {', '.join(ALGOS)}")
        local = self.algo in ("local-sgd", "diloco")
        if local and self.sync_every is None:
            raise ValueError(f"--dp-algo {self.algo} needs --sync-every H (e.g. 10)")
        if self.sync_every is not None:
            if not local:
                raise ValueError("--sync-every applies to --dp-algo local-sgd and diloco")
            if self.sync_every < 1:
                raise ValueError(f"--sync-every must be at least 1, got {self.sync_every}")
        _steps_flag("--local-warmup", self.local_warmup, applies=self.algo == "local-sgd",
                    where="--dp-algo local-sgd (post-local SGD)")  # fmt: skip
        if self.sync_optimizer_state and self.algo != "local-sgd":
            raise ValueError(
                "--sync-optimizer-state applies to --dp-algo local-sgd (DiLoCo keeps each "
                "replica's inner optimizer state, as the paper does)"
            )
        if self.algo == "diloco":
            if self.outer_lr <= 0:
                raise ValueError(f"--outer-lr must be positive, got {self.outer_lr}")
            if not 0 <= self.outer_momentum < 1:
                raise ValueError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"--topology {self.topology!r}: choose one of {', '.join(TOPOLOGIES)}")
        _steps_flag("--global-avg-every", self.global_avg_every, applies=self.algo == "gossip",
                    where="--dp-algo gossip")  # fmt: skip
        if self.compress_warmup < 0:
            raise ValueError(f"--compress-warmup must be >= 0, got {self.compress_warmup}")
        if self.compress_warmup and self.compress is None:
            raise ValueError("--compress-warmup applies to --compress (plain steps before it)")
        if self.ef21_start not in EF21_STARTS:
            raise ValueError(
                f"--ef21-start {self.ef21_start!r}: choose one of {', '.join(EF21_STARTS)}"
            )
        if self.ef21_start != "gradient" and not (
            self.compress and self.compress.startswith("topk:") and self.compress_warmup
        ):
            raise ValueError(
                "--ef21-start zero applies to --compress topk:RATIO with --compress-warmup W "
                "(without a warm-up the estimates start from zero already)"
            )
        if self.compress is not None:
            name, _ = parse_compress(self.compress)
            if self.algo == "gossip":
                raise ValueError(
                    "--compress with --dp-algo gossip: gossip sends whole parameters to its "
                    "neighbours, which plait does not compress (drop one of the two)"
                )
            if self.algo != "allreduce":
                if name not in SYNC_CODECS:
                    raise ValueError(
                        f"--compress {self.compress} with --dp-algo {self.algo}: a sync sends "
                        "its parameter change summed over replicas; use bf16 or int8"
                    )
                if self.compress_warmup:
                    instead = "--local-warmup W" if self.algo == "local-sgd" else "no warm-up"
                    raise ValueError(
                        f"--compress-warmup applies to per-step gradient codecs; --dp-algo "
                        f"{self.algo} takes {instead}"
                    )
                if self.sync_optimizer_state:
                    raise ValueError(
                        "--sync-optimizer-state with --compress: the optimizer's state would "
                        "travel uncompressed; drop one of the two"
                    )

    @property
    def sync_codec(self) -> str | None:
        """bf16 / int8: how a local SGD / DiLoCo sync sends the parameter change (None:
        fp32, or not a syncing algorithm)."""
        return self.compress if self.algo in ("local-sgd", "diloco") else None

    @property
    def grad_codec(self) -> str | None:
        """The per-step gradient codec of the compressed all-reduce (None otherwise)."""
        return self.compress if self.algo == "allreduce" else None

    @property
    def plain(self) -> bool:
        """The plain all-reduce, uncompressed (the default)."""
        return self.algo == "allreduce" and self.compress is None

    @property
    def replicas_differ(self) -> bool:
        """Local SGD, DiLoCo and gossip let replicas drift apart between synchronisations;
        plain and compressed all-reduce keep them identical."""
        return self.algo != "allreduce"

    @property
    def codec(self) -> tuple[str, float | int | None] | None:
        return parse_compress(self.compress) if self.compress else None

    def label(self) -> str:
        """Short human name: ``diloco H=100``, ``gossip exponential``, ``powersgd:4``."""
        if self.grad_codec:
            return self.compress
        if self.algo in ("local-sgd", "diloco"):
            codec = f" {self.compress}" if self.compress else ""
            return f"{self.algo} H={self.sync_every}{codec}"
        if self.algo == "gossip":
            pga = f" +avg/{self.global_avg_every}" if self.global_avg_every else ""
            return f"gossip {self.topology}{pga}"
        return "allreduce"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check_layout(self, layout) -> None:
        """Raise ValueError (one line saying what would work) for a pair that means
        nothing or that plait does not run."""
        if self.algo == "allreduce" and self.compress is None:
            return
        what = f"--compress {self.compress}" if self.grad_codec else f"--dp-algo {self.algo}"
        if layout.dp < 2:
            raise ValueError(f"{what} works across data-parallel replicas; use --dp 2 or more")
        if self.grad_codec is not None:
            if layout.zero >= 2 and not _hybrid(layout):
                raise ValueError(
                    f"{what} with --zero {layout.zero} compresses the all-reduce across groups "
                    f"of sharded replicas: add --zero-shard-group K with K < --dp {layout.dp}"
                )
            if layout.zero >= 2 and self.codec[0] == "powersgd":
                raise ValueError(
                    f"{what} compresses whole weight matrices, but --zero {layout.zero} "
                    "reduces flat gradient shards; use qsgd, topk or bf16 with ZeRO 2/3, or "
                    "--zero 0/1 for PowerSGD"
                )
        elif layout.zero and not _hybrid(layout):
            raise ValueError(
                f"{what} with --zero {layout.zero} runs across groups of sharded replicas: "
                f"add --zero-shard-group K with K < --dp {layout.dp} (ZeRO shards inside each "
                f"group of K, the algorithm runs across the {layout.dp}/K groups)"
            )
        if self.replicas_differ and layout.dtype == "fp16":
            raise ValueError(
                f"{what} with --dtype fp16: each replica would need its own loss scale; use "
                "--dtype bf16 or fp32"
            )
        replicas, _ = replicas_of(layout)
        summed = replicas if self.sync_codec else compress_group(layout)[0]
        if self.compress == "int8" and summed > MAX_INT8_REPLICAS:
            raise ValueError(
                f"--compress int8 sums {summed} ranks' levels in one signed byte, which holds "
                f"at most {MAX_INT8_REPLICAS}; use --compress bf16"
            )
        if self.algo == "gossip" and self.topology == "torus" and replicas < 4:
            raise ValueError(f"--topology torus needs at least 4 replicas, got {replicas}")


def _hybrid(layout) -> bool:
    return layout.zero_shard_group is not None and layout.zero_shard_group < layout.dp


def replicas_of(layout) -> tuple[int, int]:
    """(R replicas, K dp ranks per replica) of a layout whose replicas may differ (module
    docstring): K = ``--zero-shard-group`` under ZeRO, else 1."""
    k = (layout.zero_shard_group or layout.dp) if layout.zero else 1
    return layout.dp // k, k


def compress_group(layout) -> tuple[int, int]:
    """(ranks a compressed reduction spans, K): every rank of the dp x cp axis the
    gradients are reduced over under ZeRO 0/1 (``Topology.grad_view``: the cp ranks of a
    dp rank hold the same weights and their own tokens' gradients), the dp x cp / K shard
    groups under ZeRO 2/3."""
    ranks = layout.dp * layout.cp
    if layout.zero >= 2:
        k = layout.zero_shard_group or ranks
        return ranks // k, k
    return ranks, 1
