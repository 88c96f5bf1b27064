"""The ``--lora-*`` flags as a value: which linear layers of a block get adapters, their
rank and scale (``model/lora.py`` builds them). Kept apart from the layers so that
``plait train`` checks its flags without loading torch. No communication.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.model.config import ModelConfig

# --lora-targets names -> the module of a block, per flavour. "up"/"down" are the MLP's
# first and second GEMM (GPT-2's fc / proj); only LLaMA's SwiGLU has a "gate".
TARGETS: dict[str, dict[str, str]] = {
    "q": {"gpt2": "attn.q", "llama": "attn.q"},
    "k": {"gpt2": "attn.k", "llama": "attn.k"},
    "v": {"gpt2": "attn.v", "llama": "attn.v"},
    "o": {"gpt2": "attn.o", "llama": "attn.o"},
    "up": {"gpt2": "mlp.fc", "llama": "mlp.up"},
    "down": {"gpt2": "mlp.proj", "llama": "mlp.down"},
    "gate": {"llama": "mlp.gate"},
}
# --lora-targets names -> the stacked expert weight of a MoE layer (model/moe.py's Experts)
EXPERT_TARGETS: dict[str, dict[str, str]] = {
    "up": {"gpt2": "w_fc", "llama": "w_up"},
    "down": {"gpt2": "w_proj", "llama": "w_down"},
    "gate": {"llama": "w_gate"},
}


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """``--lora-rank R --lora-alpha A --lora-targets q,v``: adapters of rank ``rank``
    scaled by ``alpha / rank`` on the listed linear layers of every block."""

    rank: int
    alpha: float | None = None  # None: equal to rank (scale 1, PEFT's default pairing 8/8)
    targets: tuple[str, ...] = ("q", "v")  # PEFT's default for LLaMA, and the LoRA paper's

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(self.targets.split(",")))
        object.__setattr__(self, "targets", tuple(t.strip() for t in self.targets if t.strip()))
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"--lora-rank must be a positive integer (e.g. 8), got {self.rank}")
        if self.alpha is None:
            object.__setattr__(self, "alpha", float(self.rank))
        if not self.alpha > 0:
            raise ValueError(f"--lora-alpha must be positive (e.g. 16), got {self.alpha}")
        if not self.targets:
            raise ValueError(f"--lora-targets is empty; choose from {','.join(TARGETS)}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ValueError(
                f"--lora-targets {unknown[0]!r} is unknown; choose from {','.join(TARGETS)}"
            )
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"--lora-targets {','.join(self.targets)} names a layer twice")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def adapts_attention(self) -> bool:
        """Whether a target is in the attention (q, k, v, o): without one, nothing in the
        first block's attention trains, nor anything below it (the embedding is frozen)."""
        return bool(set(self.targets) & {"q", "k", "v", "o"})

    def check_model(self, cfg: ModelConfig) -> None:
        """ValueError (one line) if a target does not exist in ``cfg``'s flavour."""
        for t in self.targets:
            if cfg.block not in TARGETS[t]:
                have = ",".join(k for k, v in TARGETS.items() if cfg.block in v)
                raise ValueError(
                    f"--lora-targets {t}: the {cfg.arch} block has no such layer (it has {have})"
                )

    def modules(self, arch: str) -> dict[str, str]:
        """Block-relative module path -> target name, e.g. {"attn.q": "q"}. Every arch
        but gpt2 has the llama block's layers."""
        block = "gpt2" if arch == "gpt2" else "llama"
        return {TARGETS[t][block]: t for t in self.targets}

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}
