"""Model configuration and the named presets.

One decoder-only transformer, two block designs:

- ``gpt2``: LayerNorm, GELU MLP, learned positions, biases, embeddings tied to the head.
- the rotary block (``llama`` and the families built like it): RMSNorm, SwiGLU MLP,
  rotary positions, grouped-query attention, no biases, untied head by default.

``arch`` names the family, as Hugging Face's ``model_type`` does; each is the rotary
block plus what sets it apart:

    llama    the block as is; Llama 3 / 3.1 / 3.2 are llama with rope_theta 5e5, a
             ``RopeScaling`` (rope_type llama3) and, at 1B / 3B, tied embeddings
    qwen2    biases on the q, k and v projections (Qwen2 and Qwen2.5)
    qwen3    RMSNorm of each head's queries and keys before the rotation (Qwen3)
    mistral  ``sliding_window``: each token attends to the last W tokens only

Any of them may be a mixture of experts (``moe_experts`` > 0, ``model/moe.py``): every
``moe_every``-th block's MLP is replaced by ``moe_experts`` expert MLPs of the block's kind
(GELU or SwiGLU) and a router that sends each token to ``moe_top_k`` of them -- Mixtral is
llama (or mistral) with 8 experts, top 2; Qwen3-MoE is qwen3 with 128, top 8.

Fields that vary within a family (``head_dim``, ``tied_embeddings``, ``rope_scaling``,
``sliding_window``) are fields; what a family always has (``qkv_bias``, ``qk_norm``) is a
property of ``arch``. Any preset can be built in any flavour (``preset("tiny",
arch="qwen3")``, ``FLAVOURS``); the preset fixes the sizes, the flavour the block design.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

ARCHS = ("gpt2", "llama", "qwen2", "qwen3", "mistral")


def _round_up(x: float, multiple: int) -> int:
    return int(multiple * math.ceil(x / multiple))


def default_ffn_hidden(arch: str, hidden: int) -> int:
    """4h for GELU MLPs; for SwiGLU, 2/3 of 4h rounded up as LLaMA does (7B: 11008)."""
    if arch == "gpt2":
        return 4 * hidden
    return _round_up(8 * hidden / 3, 256 if hidden >= 1024 else 32)


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (Hugging Face ``rope_type: llama3``): rotary
    frequencies whose wavelength exceeds ``original_seq_len / low_freq_factor`` are divided
    by ``factor``, those under ``original_seq_len / high_freq_factor`` are kept, and the
    band between is interpolated. Llama 3.1: factor 8, 1, 4, 8192; Llama 3.2: factor 32."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_seq_len: int = 8192

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"rope_scaling factor must be at least 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.original_seq_len < 1:
            raise ValueError(
                f"rope_scaling original_seq_len must be at least 1, got {self.original_seq_len}"
            )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes and flavour of the transformer. ``seq_len`` is the longest context it accepts."""

    arch: str = "gpt2"
    n_layers: int = 4
    hidden: int = 128
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (multi-head attention)
    head_dim: int | None = None  # None: hidden / n_heads (Qwen3 sets its own, e.g. 128)
    ffn_hidden: int | None = None  # None: default_ffn_hidden(arch, hidden)
    vocab_size: int = 4096
    seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain rotary frequencies
    sliding_window: int | None = None  # mistral: attend to the last W tokens (None: all)
    tied_embeddings: bool | None = None  # None: the arch's (gpt2 tied, the others not)
    dropout: float = 0.0
    init_std: float = 0.02
    # mixture of experts (model/moe.py); 0 experts: every block is dense
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1  # block i is MoE when (i + 1) % moe_every == 0 (Qwen's sparse step)
    moe_shared_experts: int = 0  # always-on experts of moe_ffn_hidden each (DeepSeek, Qwen)
    moe_ffn_hidden: int | None = None  # None: ffn_hidden
    moe_router: str = "softmax"  # or sigmoid (DeepSeek-V3); scores in fp32
    moe_norm_topk: bool = True  # top-k weights divided by their sum (always with sigmoid)
    moe_capacity_factor: float | None = None  # None: dropless
    moe_aux_loss_coef: float = 0.01  # Switch load-balancing loss
    moe_z_loss_coef: float = 0.0  # router z-loss (ST-MoE)
    moe_bias_rate: float = 0.0  # auxiliary-loss-free balancing (DeepSeek-V3); 0: off

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(
                f"--arch {self.arch!r} is unknown; choose one of {', '.join(FLAVOURS)}"
            )
        for name in ("n_layers", "hidden", "n_heads", "vocab_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.head_dim is None:
            if self.hidden % self.n_heads:
                raise ValueError(
                    f"--heads {self.n_heads} does not divide --hidden {self.hidden}; "
                    f"pick heads among {_divisors(self.hidden)}"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        elif self.head_dim < 1:
            raise ValueError(f"head_dim must be at least 1, got {self.head_dim}")
        elif self.arch == "gpt2" and self.head_dim * self.n_heads != self.hidden:
            raise ValueError(
                f"head_dim {self.head_dim} x --heads {self.n_heads} is not --hidden "
                f"{self.hidden}: the gpt2 block needs heads that split the hidden size"
            )
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"--kv-heads {self.n_kv_heads} must divide --heads {self.n_heads}; "
                f"pick one of {_divisors(self.n_heads)}"
            )
        if self.arch == "gpt2" and self.n_kv_heads != self.n_heads:
            raise ValueError("--kv-heads (grouped-query attention) needs --arch llama or another "
                             "rotary arch")  # fmt: skip
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", default_ffn_hidden(self.arch, self.hidden))
        if self.ffn_hidden < 1:
            raise ValueError(f"--ffn-hidden must be at least 1, got {self.ffn_hidden}")
        if self.rotary and self.head_dim % 2:
            raise ValueError(
                f"rotary positions need an even head size; --hidden {self.hidden} / "
                f"--heads {self.n_heads} = {self.head_dim}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        self._check_family_fields()
        self._check_moe_fields()

    def _check_moe_fields(self) -> None:
        if self.moe_experts < 0:
            raise ValueError(f"--moe-experts must be 0 (dense) or more, got {self.moe_experts}")
        if self.moe_ffn_hidden is None:
            object.__setattr__(self, "moe_ffn_hidden", self.ffn_hidden)
        if not self.moe:
            return
        if not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"--moe-top-k must be between 1 and --moe-experts "
                             f"{self.moe_experts}, got {self.moe_top_k}")  # fmt: skip
        if self.moe_every < 1 or self.moe_every > self.n_layers:
            raise ValueError(f"--moe-every must be between 1 and --layers {self.n_layers}, got "
                             f"{self.moe_every}")  # fmt: skip
        if self.moe_shared_experts < 0:
            raise ValueError(f"--moe-shared-experts must be 0 or more, got "
                             f"{self.moe_shared_experts}")  # fmt: skip
        if self.moe_ffn_hidden < 1:
            raise ValueError(f"--moe-ffn-hidden must be at least 1, got {self.moe_ffn_hidden}")
        if self.moe_router not in ("softmax", "sigmoid"):
            raise ValueError(f"--moe-router {self.moe_router!r}: choose softmax or sigmoid")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise ValueError(f"--moe-capacity-factor must be positive, got "
                             f"{self.moe_capacity_factor} (leave it out for dropless)")  # fmt: skip
        for name in ("moe_aux_loss_coef", "moe_z_loss_coef", "moe_bias_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)} must be 0 or more, got {getattr(self, name)}")

    @property
    def moe(self) -> bool:
        """A mixture of experts: some blocks' MLPs are routed experts."""
        return self.moe_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """Block ``i`` (from 0) holds experts: every ``moe_every``-th, the last of each run
        of ``moe_every`` (Qwen-MoE's ``decoder_sparse_step``)."""
        return self.moe and (i + 1) % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def _check_family_fields(self) -> None:
        if isinstance(self.rope_scaling, dict):  # as to_dict wrote it (config.yaml)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.rope_scaling is not None and not self.rotary:
            raise ValueError("rope_scaling needs rotary positions; --arch gpt2 has learned ones")
        if self.sliding_window is not None:
            if self.arch != "mistral":
                raise ValueError(f"sliding_window is mistral's; --arch {self.arch} attends to "
                                 "the whole context")  # fmt: skip
            if self.sliding_window < 1:
                raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")
        if self.tied_embeddings is None:
            object.__setattr__(self, "tied_embeddings", self.arch == "gpt2")
        elif self.arch == "gpt2" and not self.tied_embeddings:
            raise ValueError("the gpt2 block ties its head to the token embedding; "
                             "tied_embeddings must be true")  # fmt: skip

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): hidden unless head_dim is set."""
        return self.n_heads * self.head_dim

    @property
    def rotary(self) -> bool:
        """The rotary block (RMSNorm, SwiGLU, rotary positions), not gpt2's."""
        return self.arch != "gpt2"

    @property
    def block(self) -> str:
        """The block design, ``gpt2`` or ``llama``: what layer names and kernels follow."""
        return "llama" if self.rotary else "gpt2"

    @property
    def biases(self) -> bool:
        """Biases on every linear layer and LayerNorm (gpt2)."""
        return self.arch == "gpt2"

    @property
    def qkv_bias(self) -> bool:
        """Biases on the q, k and v projections only (qwen2; gpt2 has them as ``biases``)."""
        return self.arch == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """RMSNorm over each head's queries and keys before the rotation (qwen3)."""
        return self.arch == "qwen3"

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes``. A head size that was derived (hidden / heads) is
        derived again when the hidden size or the heads change; one set apart from that
        (Qwen3's) is kept."""
        resized = {"hidden", "n_heads"} & changes.keys() and "head_dim" not in changes
        if resized and self.head_dim * self.n_heads == self.hidden:
            changes["head_dim"] = None
        derived = self.moe_ffn_hidden == self.ffn_hidden and "moe_ffn_hidden" not in changes
        if "ffn_hidden" in changes and derived:
            changes["moe_ffn_hidden"] = None
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
_LLAMA31 = dict(_LLAMA3, rope_scaling=RopeScaling(factor=8.0))
_LLAMA32 = dict(_LLAMA3, rope_scaling=RopeScaling(factor=32.0), tied_embeddings=True)
_QWEN25 = dict(arch="qwen2", seq_len=32768, vocab_size=152064, rope_theta=1e6, norm_eps=1e-6)
_QWEN3 = dict(arch="qwen3", seq_len=32768, vocab_size=151936, rope_theta=1e6, norm_eps=1e-6,
              head_dim=128)  # fmt: skip

# Sizes as published: GPT-3 (Brown et al. 2020, Table 2.1; 13B uses hidden 5120 as
# released implementations do), LLaMA (Touvron et al. 2023), Llama 2 and Llama 3 / 3.1 /
# 3.2 (Meta; 405B exists only as 3.1), Qwen2.5 and Qwen3 (their config.json: the 0.5B and
# 0.6B tie their embeddings, 151936 tokens below 7B), Mistral 7B v0.1 (4096-token window).
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
        _LLAMA31, n_layers=126, hidden=16384, n_heads=128, n_kv_heads=8, ffn_hidden=53248
    ),
    "llama3.1-8b": dict(
        _LLAMA31, n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336
    ),
    "llama3.1-70b": dict(
        _LLAMA31, n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, ffn_hidden=28672
    ),
    "llama3.2-1b": dict(
        _LLAMA32, n_layers=16, hidden=2048, n_heads=32, n_kv_heads=8, ffn_hidden=8192
    ),
    "llama3.2-3b": dict(
        _LLAMA32, n_layers=28, hidden=3072, n_heads=24, n_kv_heads=8, ffn_hidden=8192
    ),
    "qwen2.5-0.5b": dict(
        _QWEN25,
        n_layers=24,
        hidden=896,
        n_heads=14,
        n_kv_heads=2,
        ffn_hidden=4864,
        vocab_size=151936,
        tied_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        _QWEN25, n_layers=28, hidden=3584, n_heads=28, n_kv_heads=4, ffn_hidden=18944
    ),
    "qwen2.5-72b": dict(
        _QWEN25, n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, ffn_hidden=29568
    ),
    "qwen3-0.6b": dict(
        _QWEN3,
        n_layers=28,
        hidden=1024,
        n_heads=16,
        n_kv_heads=8,
        ffn_hidden=3072,
        tied_embeddings=True,
    ),
    "qwen3-8b": dict(_QWEN3, n_layers=36, hidden=4096, n_heads=32, n_kv_heads=8, ffn_hidden=12288),
    "mistral-7b": dict(
        arch="mistral",
        n_layers=32,
        hidden=4096,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        vocab_size=32000,
        seq_len=8192,
        sliding_window=4096,
    ),
}

# --arch NAME: what a preset built in that flavour takes (its sizes stay). Between the
# gpt2 and the rotary block the FFN width, key/value heads and tying are re-derived too;
# mistral's window is half the context, as Mistral 7B's 4096 of its 8192.
FLAVOURS: dict[str, dict] = {
    "gpt2": dict(arch="gpt2"),
    "llama": dict(arch="llama"),
    "llama3": dict(arch="llama", rope_theta=500000.0),
    "qwen2": dict(arch="qwen2", rope_theta=1e6, norm_eps=1e-6),
    "qwen3": dict(arch="qwen3", rope_theta=1e6, norm_eps=1e-6),
    "mistral": dict(arch="mistral"),
}
_FLAVOUR_OWNED = ("rope_theta", "norm_eps", "rope_scaling", "sliding_window")
_BLOCK_OWNED = ("ffn_hidden", "tied_embeddings")


def preset(name: str, *, arch: str | None = None, **overrides) -> ModelConfig:
    """Build the config of a named preset, optionally in another flavour or resized.

    ``arch`` names a flavour (``FLAVOURS``). One the preset already has changes nothing
    (``preset("llama3-8b", arch="llama")`` is Llama 3 8B). Another keeps the sizes but
    re-derives what the flavour owns: rotary base, norm epsilon, rope scaling, window; and
    across the gpt2 / rotary divide the FFN width (4h or SwiGLU's), tying, and grouped-
    query attention and head size (gpt2 has neither).
    """
    if name not in PRESETS:
        raise ValueError(f"--model {name!r} is not a preset; choose one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    if arch is not None:
        if arch not in FLAVOURS:
            raise ValueError(f"--arch {arch!r} is unknown; choose one of {', '.join(FLAVOURS)}")
        flavour = FLAVOURS[arch]
        defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
        if any(fields.get(k, defaults[k]) != v for k, v in flavour.items()):
            block_changes = (fields["arch"] == "gpt2") != (flavour["arch"] == "gpt2")
            owned = _FLAVOUR_OWNED + (_BLOCK_OWNED if block_changes else ())
            owned += ("n_kv_heads", "head_dim") if flavour["arch"] == "gpt2" else ()
            fields = {k: v for k, v in fields.items() if k not in owned}
            fields.update(flavour)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if arch == "mistral" and "sliding_window" not in fields:
        fields["sliding_window"] = max(1, fields["seq_len"] // 2)
    return ModelConfig(**fields)
