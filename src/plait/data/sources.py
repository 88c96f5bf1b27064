"""What ``--data`` names: one path, or a weighted mixture ``web.parquet:0.7,code/:0.3``
(``mixture.py``), read and checked without torch, so that a launcher refuses a malformed
mixture or a path that does not exist before anything heavy loads.
"""

from __future__ import annotations

import math
from pathlib import Path

from plait.errors import DataError

MIX_BLOCK = 1 << 16  # positions per block of the mixed stream (mixture.py)
EXAMPLE = "web.parquet:0.7,code/:0.3"


def parse_sources(spec: str) -> list[tuple[str, float]] | None:
    """``[(path, weight), ...]`` of a mixture (weights normalised), or None when ``spec`` is
    one path; ValueError (one line naming --data) for a malformed mixture."""
    if Path(spec).expanduser().exists() or ("," not in spec and ":" not in spec):
        return None
    out = []
    for item in spec.split(","):
        path, sep, text = item.strip().rpartition(":")
        if not sep or not path:
            raise ValueError(
                f"--data {spec}: {item.strip() or 'an empty item'} has no weight; write "
                f"PATH:WEIGHT,PATH:WEIGHT, e.g. {EXAMPLE}"
            )
        try:
            weight = float(text)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(
                f"--data {spec}: the weight {text!r} of {path} is not a positive number; "
                f"write PATH:WEIGHT, e.g. {EXAMPLE}"
            )
        if any(p == path for p, _ in out):
            raise ValueError(f"--data {spec}: {path} is listed twice; give it one weight")
        out.append((path, weight))
    total = sum(w for _, w in out)
    out = [(p, w / total) for p, w in out]
    for p, w in out:
        if w * MIX_BLOCK < 1:
            raise ValueError(
                f"--data {spec}: the weight of {p} is {w:.2g} of the total, below 1/{MIX_BLOCK:,}; "
                "drop that source or raise its weight"
            )
    return out


def check_exist(spec: str) -> None:
    """Every path ``spec`` names exists, else DataError (one line naming --data): made up
    front, before the data is prepared (which checks again)."""
    sources = parse_sources(spec)
    for path in [spec] if sources is None else [p for p, _ in sources]:
        existing(path)


def existing(path: str) -> Path:
    """``path`` (one source) resolved, or DataError when there is nothing there."""
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise DataError(f"--data {path}: no such file or folder")
    return p
