"""What a run's checkpoint folder holds, read without torch: the complete checkpoints and
their steps, a checkpoint's ``meta.json``, one checkpoint's files checked against its
signed manifest, and which checkpoint a resume takes.

``checkpoint.py`` (DCP, torch) writes and loads checkpoints and adds the collective form of
the checks; this module is the part a launcher needs before it loads torch, so that
``plait train --resume`` with nothing to resume from, or ``plait checkpoint verify``,
answers in a fraction of a second. No communication.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from plait.errors import CheckpointError
from plait.train import manifest


def checkpoint_dirs(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp")
    ]
    return sorted(found, key=lambda p: p.name)


def latest(root: Path) -> Path | None:
    dirs = checkpoint_dirs(root)
    return dirs[-1] if dirs else None


def step_of(path: Path) -> int | None:
    try:
        return int(path.name.removeprefix("step-"))
    except ValueError:
        return None


def read_meta(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {path} is incomplete or corrupt (meta.json: {e.__class__.__name__}); "
            "delete it to resume from the one before"
        ) from None


def verify_files(path: Path, *, hashes: bool = True, trust=None) -> str | None:
    """None when every file of checkpoint ``path`` matches its manifest, signed by this user
    (or ``path`` is under ``trust``), else one line saying what is wrong (``hashes=False``:
    sizes only, from ``stat``). This process reads every file; ``checkpoint.verify`` splits
    the reading over a run's ranks."""
    try:
        files = manifest.read(Path(path), trust=trust)
    except manifest.ManifestError as e:
        return str(e)
    problems = manifest.check(Path(path), files, hashes=hashes)
    return problems[0].describe() if problems else None


def pick_resume(
    root: Path,
    step: int | None = None,
    *,
    check: Callable[[Path], str | None],
    agree: Callable[[int], int] = lambda step: step,
    flag: str = "--resume",
) -> tuple[Path, str]:
    """The checkpoint to resume from: ``step``'s, or else the newest that ``check`` passes
    (None: it verifies; else one line saying why not); and one line saying which step and
    what was skipped and why. Raises CheckpointError (one line, naming ``flag``) when there
    is none. ``agree`` turns this process's candidate step into the one every rank takes
    (``checkpoint.pick_resume``: an all-reduce of the maximum)."""
    root = Path(root)
    tried, skipped = set(), []
    while True:
        mine = [
            s
            for s in map(step_of, checkpoint_dirs(root))
            if s is not None and s not in tried and (step is None or s == step)
        ]
        candidate = agree(max(mine, default=-1))
        if candidate < 0:
            break
        tried.add(candidate)
        path = root / f"step-{candidate:08d}"
        problem = check(path)
        if problem is None:
            note = f"resuming from step {candidate} ({path})"
            return path, note + "".join(f"; skipped {n}: {p}" for n, p in skipped)
        skipped.append((path.name, problem))
    fresh = "; run without --resume to start fresh" if flag == "--resume" else ""
    if step is not None:
        if skipped:
            raise CheckpointError(
                f"--resume-from {step}: checkpoint {skipped[0][0]} in {root} is damaged: "
                f"{skipped[0][1]}; --resume takes the newest one that verifies"
            )
        have = ", ".join(str(step_of(p)) for p in checkpoint_dirs(root)) or "none"
        raise CheckpointError(
            f"--resume-from {step}: no checkpoint of step {step} in {root} (steps there: {have})"
        )
    if skipped:
        why = "; ".join(f"{n}: {p}" for n, p in skipped)
        raise CheckpointError(f"{flag}: no checkpoint in {root} verifies ({why}){fresh}")
    raise CheckpointError(f"{flag}: no checkpoint in {root}{fresh}")
