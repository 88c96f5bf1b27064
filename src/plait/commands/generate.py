"""``plait generate --run DIR``: sample text from a trained run (``plait.generate``).

    plait generate --run runs/x --prompt "def " --max-new-tokens 100

Errors a user can cause print one line and return 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plait.commands.common import TRUST_HELP, die


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", allow_abbrev=False, help="sample from a trained run")
    p.add_argument("--run", required=True, help="run folder written by plait train")
    p.add_argument("--prompt", default="")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trust-checkpoint", metavar="PATH", help=TRUST_HELP)
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import math

    if args.max_new_tokens < 1:
        return die("generate", f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):
        return die("generate", f"--temperature must be >= 0 (0: always the likeliest token), "
                               f"got {args.temperature}")  # fmt: skip
    if args.seed < 0:
        return die("generate", f"--seed must be >= 0, got {args.seed}")
    from plait.generate import generate_text

    try:
        text = generate_text(
            Path(args.run), args.prompt, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, seed=args.seed, trust=args.trust_checkpoint,
        )  # fmt: skip
    except (ValueError, OSError) as e:
        return die("generate", str(e).strip().splitlines()[0])
    print(text)
    return 0
