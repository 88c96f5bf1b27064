"""The run's configuration: model, layout, data and training settings, each a frozen
dataclass owned by the component that reads it, gathered into one ``RunConfig`` that is
written to ``config.yaml`` in full (every default resolved) and read back by the workers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from plait.data import DataConfig
from plait.dp_algos.config import DPAlgoConfig
from plait.layout import Layout
from plait.model.config import ModelConfig
from plait.model.lora_config import LoRAConfig
from plait.model.quant_config import QuantConfig
from plait.resilience.config import ResilienceConfig


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 200
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global gradient norm; 0 disables clipping
    seed: int = 0
    eval_every: int = 100  # 0: only at the end
    eval_batches: int = 4
    save_every: int = 0  # 0: only the final checkpoint
    keep_checkpoints: int = 2
    log_every: int = 10
    peak_tflops: float | None = None  # per device, for MFU; None: look up or measure
    collective_timeout: float = 300.0  # seconds
    trace: bool = False
    progress: bool = True
    threads: int | None = None  # torch threads per worker; None: cores / local workers
    resume: bool = False  # continue from the newest checkpoint in --out that verifies
    resume_from: int | None = None  # continue from this step's checkpoint (implies resume)
    trust_checkpoint: str | None = None  # checkpoints under it load unsigned (docs/security.md)
    init_hf: str | None = None  # start from a Hugging Face model folder's weights
    compile: bool = False  # torch.compile each transformer block
    tensorboard: bool = False  # TensorBoard event files beside metrics.jsonl
    optimizer: str = "adamw"  # adamw | sgd (SGD with momentum: a linear update)
    momentum: float = 0.9  # sgd only
    profile: str | None = None  # "A:B": torch.profiler over steps A..B (train/profiling.py)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        for name in ("weight_decay", "grad_clip"):  # grad_clip 0: no clipping
            value = getattr(self, name)
            if not value >= 0 or not math.isfinite(value):
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.eval_batches < 1:
            raise ValueError(f"--eval-batches must be at least 1, got {self.eval_batches}")
        if self.peak_tflops is not None and not (
            self.peak_tflops > 0 and math.isfinite(self.peak_tflops)
        ):
            raise ValueError(f"--peak-tflops must be a positive number, got {self.peak_tflops}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.collective_timeout <= 0:
            raise ValueError("--collective-timeout must be positive (seconds)")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"--optimizer {self.optimizer!r}: choose adamw or sgd")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.profile is not None:
            self.profile_steps  # noqa: B018 - validates
        if self.resume_from is not None and self.resume_from < 1:
            raise ValueError(
                f"--resume-from must be a checkpoint's step (>= 1), got {self.resume_from}"
            )

    @property
    def profile_steps(self) -> tuple[int, int]:
        """``--profile A:B`` as (A, B): the first and last step profiled, 1-based as the
        metrics log numbers them."""
        try:
            a, b = (int(x) for x in str(self.profile).split(":"))
        except ValueError:
            a = b = 0
        if not 1 <= a <= b:
            raise ValueError(f"--profile {self.profile}: give the first and last step to "
                             "profile, A:B with 1 <= A <= B (e.g. 3:4)")  # fmt: skip
        return a, b


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig
    layout: Layout
    data: DataConfig
    train: TrainConfig
    out: str
    lora: LoRAConfig | None = None  # fine-tune low-rank adapters, base frozen
    qat: QuantConfig | None = None  # quantisation-aware training of the block linears
    resilience: ResilienceConfig = dataclasses.field(default_factory=ResilienceConfig)
    dp_algo: DPAlgoConfig = dataclasses.field(default_factory=DPAlgoConfig)

    def __post_init__(self) -> None:
        if self.lora is not None:
            self.lora.check_model(self.model)
            if self.qat is not None:
                raise ValueError(
                    "--qat with --lora-rank: QAT trains the weights that will be quantised "
                    "and LoRA freezes them; use one of the two"
                )
        if self.qat is not None:
            self.qat.check_model(self.model, tp=self.layout.tp)
        if self.lora is not None and not self.dp_algo.plain:
            raise ValueError(
                "--dp-algo / --compress with --lora-rank: the adapters' gradients are already "
                "small and plait runs LoRA with the plain all-reduce; drop one of the two"
            )
        if self.resilience.enabled and (self.lora is not None or self.qat is not None):
            raise ValueError(
                "--fault-tolerance with --lora-rank or --qat is not covered yet (recovery "
                "moves every parameter with its AdamW state; LoRA's frozen base has none); "
                "drop one of the two"
            )
        if self.resilience.enabled and (not self.dp_algo.plain or self.train.optimizer != "adamw"):
            raise ValueError(
                "--fault-tolerance runs the plain all-reduce with AdamW (recovery copies every "
                "replica's parameters and AdamW state); drop --dp-algo / --compress / "
                "--optimizer sgd, or --fault-tolerance"
            )
        if self.resilience.enabled and self.model.moe:
            raise ValueError(
                "--fault-tolerance with --moe-experts is not covered yet (recovery moves "
                "parameters and AdamW state between replicas, not the expert bias or the ep "
                "groups); drop one of the two"
            )
        ep = self.layout.ep
        if ep > 1 and not self.dp_algo.plain:
            raise ValueError(
                f"--dp-algo / --compress with --ep {ep}: expert gradients are reduced over "
                "their own group with the plain all-reduce; drop one of the two"
            )
        if self.layout.cp > 1 and self.resilience.enabled:
            raise ValueError(
                "--fault-tolerance with --cp is not covered yet (templates hold no cp "
                "ring); drop one of the two"
            )
        if self.layout.cp > 1 and self.dp_algo.algo != "allreduce":
            raise ValueError(
                f"--dp-algo {self.dp_algo.algo} with --cp: the cp ranks of a replica must "
                "hold the same weights, so only the plain all-reduce runs with --cp"
            )

    def to_dict(self) -> dict:
        return {
            "model": self.model.to_dict(),
            "layout": self.layout.to_dict(),
            "data": dataclasses.asdict(self.data),
            "train": dataclasses.asdict(self.train),
            "resilience": self.resilience.to_dict(),
            "dp_algo": self.dp_algo.to_dict(),
            "out": self.out,
            "lora": self.lora.to_dict() if self.lora else None,
            "qat": dataclasses.asdict(self.qat) if self.qat else None,
        }

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        layout = dict(d["layout"])
        if layout.get("pp_layout") is not None:
            layout["pp_layout"] = tuple(layout["pp_layout"])
        return cls(
            model=ModelConfig(**d["model"]),
            layout=Layout(**layout),
            data=DataConfig(**d["data"]),
            train=TrainConfig(**d["train"]),
            resilience=ResilienceConfig.from_dict(d.get("resilience")),
            out=d["out"],
            lora=LoRAConfig(**d["lora"]) if d.get("lora") else None,
            qat=QuantConfig(**d["qat"]) if d.get("qat") else None,
            dp_algo=DPAlgoConfig(**(d.get("dp_algo") or {})),
        )

    def save(self, path: Path) -> None:
        from plait.train.run_folder import write_fresh

        # every node writes its own temporary file; a link at ``path`` is replaced, not followed
        write_fresh(Path(path), yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        """The run config ``plait train`` wrote at ``path``; ValueError (one line naming the
        file) when it is not readable YAML of that shape."""
        try:
            d = yaml.safe_load(Path(path).read_text())
            if not isinstance(d, dict):
                raise ValueError(f"a {type(d).__name__}, not a mapping")
            return cls.from_dict(d)
        except KeyError as e:
            raise ValueError(f"{path}: not a plait run config (no {e.args[0]!r})") from None
        except (yaml.YAMLError, UnicodeDecodeError, TypeError, ValueError, AttributeError) as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{path}: not a plait run config ({why})") from None


TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}
DP_ALGO_FIELDS = {f.name for f in dataclasses.fields(DPAlgoConfig)}
