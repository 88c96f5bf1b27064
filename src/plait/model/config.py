"""Model configuration and the named presets.

One decoder-only transformer, two flavours:

- ``gpt2``: LayerNorm, GELU MLP, learned positions, biases, embeddings tied to the head.
- ``llama``: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases,
  untied head.

Any preset can be built in either flavour (``preset("tiny", arch="llama")``); the preset
fixes the sizes, the flavour fixes the block design.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

ARCHS = ("gpt2", "llama")


def _round_up(x: float, multiple: int) -> int:
    return int(multiple * math.ceil(x / multiple))


def default_ffn_hidden(arch: str, hidden: int) -> int:
    """4h for GELU MLPs; for SwiGLU, 2/3 of 4h rounded up as LLaMA does (7B: 11008)."""
    if arch == "gpt2":
        return 4 * hidden
    return _round_up(8 * hidden / 3, 256 if hidden >= 1024 else 32)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes and flavour of the transformer. ``seq_len`` is the longest context it accepts."""

    arch: str = "gpt2"
    n_layers: int = 4
    hidden: int = 128
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (multi-head attention)
    ffn_hidden: int | None = None  # None: default_ffn_hidden(arch, hidden)
    vocab_size: int = 4096
    seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"--arch {self.arch!r} is unknown; choose one of {', '.join(ARCHS)}")
        for name in ("n_layers", "hidden", "n_heads", "vocab_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.hidden % self.n_heads:
            raise ValueError(
                f"--heads {self.n_heads} does not divide --hidden {self.hidden}; "
                f"pick heads among {_divisors(self.hidden)}"
            )
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"--kv-heads {self.n_kv_heads} must divide --heads {self.n_heads}; "
                f"pick one of {_divisors(self.n_heads)}"
            )
        if self.arch == "gpt2" and self.n_kv_heads != self.n_heads:
            raise ValueError("--kv-heads (grouped-query attention) needs --arch llama")
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", default_ffn_hidden(self.arch, self.hidden))
        if self.ffn_hidden < 1:
            raise ValueError(f"--ffn-hidden must be at least 1, got {self.ffn_hidden}")
        if self.arch == "llama" and self.head_dim % 2:
            raise ValueError(
                f"rotary positions need an even head size; --hidden {self.hidden} / "
                f"--heads {self.n_heads} = {self.head_dim}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def tied_embeddings(self) -> bool:
        return self.arch == "gpt2"

    @property
    def biases(self) -> bool:
        return self.arch == "gpt2"

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _flag(field: str) -> str:
    return {
        "n_layers": "layers",
        "n_heads": "heads",
        "n_kv_heads": "kv-heads",
        "ffn_hidden": "ffn-hidden",
        "vocab_size": "vocab-size",
        "seq_len": "seq-len",
    }.get(field, field.replace("_", "-"))


def _divisors(n: int) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, ds[:12])) + (", ..." if len(ds) > 12 else "")


_GPT3 = dict(arch="gpt2", seq_len=2048, vocab_size=50257)
_LLAMA1 = dict(arch="llama", seq_len=2048, vocab_size=32000)
_LLAMA3 = dict(arch="llama", seq_len=8192, vocab_size=128256, rope_theta=500000.0)

# Sizes as published: GPT-3 (Brown et al. 2020, Table 2.1; 13B uses hidden 5120 as
# released implementations do), LLaMA (Touvron et al. 2023), Llama 2 and Llama 3 (Meta).
PRESETS: dict[str, dict] = {
    "tiny": dict(arch="gpt2", n_layers=4, hidden=128, n_heads=4, seq_len=128, vocab_size=4096),
    "small": dict(arch="gpt2", n_layers=6, hidden=256, n_heads=8, seq_len=256, vocab_size=8192),
    "gpt2-124m": dict(
        arch="gpt2", n_layers=12, hidden=768, n_heads=12, seq_len=1024, vocab_size=50257
    ),
    "gpt3-125m": dict(_GPT3, n_layers=12, hidden=768, n_heads=12),
    "gpt3-350m": dict(_GPT3, n_layers=24, hidden=1024, n_heads=16),
    "gpt3-760m": dict(_GPT3, n_layers=24, hidden=1536, n_heads=16),
    "gpt3-1.3b": dict(_GPT3, n_layers=24, hidden=2048, n_heads=16),
    "gpt3-2.7b": dict(_GPT3, n_layers=32, hidden=2560, n_heads=32),
    "gpt3-6.7b": dict(_GPT3, n_layers=32, hidden=4096, n_heads=32),
    "gpt3-13b": dict(_GPT3, n_layers=40, hidden=5120, n_heads=40),
    "gpt3-175b": dict(_GPT3, n_layers=96, hidden=12288, n_heads=96),
    "llama-7b": dict(_LLAMA1, n_layers=32, hidden=4096, n_heads=32, ffn_hidden=11008),
    "llama-13b": dict(_LLAMA1, n_layers=40, hidden=5120, n_heads=40, ffn_hidden=13824),
    "llama-33b": dict(_LLAMA1, n_layers=60, hidden=6656, n_heads=52, ffn_hidden=17920),
    "llama-65b": dict(_LLAMA1, n_layers=80, hidden=8192, n_heads=64, ffn_hidden=22016),
    "llama2-7b": dict(
        _LLAMA1, n_layers=32, hidden=4096, n_heads=32, ffn_hidden=11008, seq_len=4096
    ),
    "llama2-13b": dict(
        _LLAMA1, n_layers=40, hidden=5120, n_heads=40, ffn_hidden=13824, seq_len=4096
    ),
    "llama2-70b": dict(
        _LLAMA1, n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, ffn_hidden=28672, seq_len=4096
    ),
    "llama3-8b": dict(
        _LLAMA3, n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336
    ),
    "llama3-70b": dict(
        _LLAMA3, n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, ffn_hidden=28672
    ),
    "llama3-405b": dict(
        _LLAMA3, n_layers=126, hidden=16384, n_heads=128, n_kv_heads=8, ffn_hidden=53248
    ),
}


def preset(name: str, *, arch: str | None = None, **overrides) -> ModelConfig:
    """Build the config of a named preset, optionally in the other flavour or resized.

    Switching flavour keeps the sizes but re-derives what the flavour owns: a ``gpt2``
    preset built as ``llama`` gets the SwiGLU FFN width (unless ``ffn_hidden`` is given),
    a ``llama`` preset built as ``gpt2`` gets 4h and full multi-head attention.
    """
    if name not in PRESETS:
        raise ValueError(f"--model {name!r} is not a preset; choose one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    if arch is not None and arch != fields["arch"]:
        fields["arch"] = arch
        fields.pop("ffn_hidden", None)
        if arch == "gpt2":
            fields.pop("n_kv_heads", None)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return ModelConfig(**fields)
