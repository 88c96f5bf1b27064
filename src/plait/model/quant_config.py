"""The quantisation flags (``--qat``, ``plait export --quantize``, ``--quant-group-size``)
as a value: the integer scheme and its group size (``model/quant.py`` applies them). Kept
apart from the layers so that ``plait train`` checks its flags without loading torch. No
communication.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.model.config import ModelConfig

SCHEMES = {"int8": (-128, 127), "int4": (-8, 7)}


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """``--qat int8|int4`` or ``plait export --quantize int8|int4`` with
    ``--quant-group-size`` (int4 only: input features per scale)."""

    dtype: str
    group_size: int = 32

    def __post_init__(self) -> None:
        if self.dtype not in SCHEMES:
            raise ValueError(f"quantisation {self.dtype!r}: choose int8 or int4")
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"--quant-group-size must be an integer >= 2, got {self.group_size}")

    @property
    def qmin(self) -> int:
        return SCHEMES[self.dtype][0]

    @property
    def qmax(self) -> int:
        return SCHEMES[self.dtype][1]

    def check_model(self, cfg: ModelConfig, *, tp: int = 1) -> None:
        """ValueError (one line) unless every int4 group lies inside one tp rank's shard."""
        if self.dtype != "int4":
            return
        g = self.group_size
        for what, n in (("--hidden", cfg.hidden), ("--hidden / --tp", cfg.hidden // tp),
                        ("--ffn-hidden / --tp", cfg.ffn_hidden // tp)):  # fmt: skip
            if n % g:
                fits = [d for d in range(2, n + 1) if n % d == 0 and d <= 256][-3:]
                raise ValueError(
                    f"--quant-group-size {g} does not divide the {n} input features of "
                    f"{what}; use one of {', '.join(map(str, fits)) or 'a smaller --tp'}"
                )
