"""``plait checkpoint verify DIR``: every checkpoint of a run (or one checkpoint folder)
against its manifest (``train/manifest.py``); one line per checkpoint.

    plait checkpoint verify runs/x                 # every step-N under runs/x/checkpoints
    plait checkpoint verify runs/x/checkpoints/step-200

Exit code 1 when a checkpoint is damaged; 2, with one line, when there is none there.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from plait.commands.common import TRUST_HELP, die


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("checkpoint", allow_abbrev=False, help="check a run's checkpoints")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    verify = actions.add_parser("verify", allow_abbrev=False,
                                help="check every file of each checkpoint against its manifest")  # fmt: skip
    verify.add_argument(
        "dir", metavar="DIR", help="a run folder, its checkpoints/ or a step-N folder"
    )
    verify.add_argument("--trust-checkpoint", metavar="PATH", help=TRUST_HELP)
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``verify``, the one action."""
    from plait.errors import printable
    from plait.train import checkpoint_files, manifest

    target = Path(args.dir)
    if (target / manifest.NAME).exists() or target.name.startswith("step-"):
        folders = [target]
    else:
        root = target / "checkpoints" if (target / "checkpoints").is_dir() else target
        folders = checkpoint_files.checkpoint_dirs(root)
    if not folders:
        return die("checkpoint verify", f"{target}: no checkpoint there; give a run folder, "
                   "its checkpoints/ folder or one step-N folder")  # fmt: skip
    damaged = 0
    for folder in folders:
        t0 = time.perf_counter()
        problem = checkpoint_files.verify_files(folder, trust=args.trust_checkpoint)
        if problem is None:
            files = manifest.read(folder, trust=args.trust_checkpoint)
            size = sum(e["size"] for e in files.values())
            print(f"{folder}: ok ({len(files)} files, {size / 2**20:.1f} MiB, "
                  f"{manifest.HASH} checked in {time.perf_counter() - t0:.2f} s)")  # fmt: skip
        else:
            damaged += 1
            what = "refused" if manifest.UNSIGNED in problem else "damaged"
            print(f"{folder}: {what}: {printable(problem)}")
    return 1 if damaged else 0
