"""``plait export --run DIR``: the newest checkpoint as a Hugging Face model folder
(``plait.export``: merged LoRA, PEFT adapter, quantised).

    plait export --run runs/x                      # RUN/hf
    plait export --run runs/x --adapter            # base + OUT/adapter in PEFT's format
    plait export --run runs/x --quantize int4

Errors a user can cause print one line and return 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plait.commands.common import TRUST_HELP, UserError, die


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("export", allow_abbrev=False,
                       help="write a run's newest checkpoint as a Hugging Face model folder")  # fmt: skip
    p.add_argument("--run", required=True, help="run folder written by plait train")
    p.add_argument("--out", help="folder to write (default RUN/hf)")
    p.add_argument("--merge-lora", action="store_true",
                   help="a LoRA run: fold the adapters into the weights")  # fmt: skip
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: the base model, and the adapter in PEFT's format in "
                   "OUT/adapter")  # fmt: skip
    p.add_argument("--quantize", choices=("int8", "int4"),
                   help="weight-only quantisation of the block linears (torchao); reports "
                   "the validation perplexity change")  # fmt: skip
    p.add_argument("--quant-group-size", type=int, metavar="G",
                   help="int4: input features per scale (default: the run's, else 32)")  # fmt: skip
    p.add_argument("--trust-checkpoint", metavar="PATH", help=TRUST_HELP)
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from plait.export import ExportOptions, export
    from plait.train import checkpoint

    try:
        opts = ExportOptions(merge_lora=bool(args.merge_lora), adapter=bool(args.adapter),
                             quantize=args.quantize, group_size=args.quant_group_size,
                             trust=args.trust_checkpoint)  # fmt: skip
        out, notes = export(Path(args.run), Path(args.out) if args.out else None, opts)
    except (UserError, ValueError, OSError, checkpoint.CheckpointError) as e:
        return die("export", str(e).strip().splitlines()[0])
    print(f"wrote {out} ({notes[0]}): " + ", ".join(notes[1:]))
    return 0
