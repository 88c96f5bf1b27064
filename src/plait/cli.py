"""``plait`` command line: a thin shell over the library.

    plait train [flags]         train (starts dp x tp x pp workers)
    plait prepare --data PATH   tokenise the data into the token cache (train does it too)
    plait generate --run DIR    sample text from a trained run
    plait export --run DIR      the newest checkpoint as a Hugging Face model folder
    plait checkpoint verify DIR check a run's checkpoints against their manifests
    plait report RUN            one self-contained HTML page (and a PNG) about a run
    plait info [flags]          parameters, FLOPs per token and memory of a model and layout
    plait simulate [flags]      predict step time, MFU and memory of a layout on a cluster
    plait plan [flags]          rank every layout of a model on a cluster; write the best
    plait calibrate             measure this machine into a hardware file for simulate / plan
    plait rehearse [flags]      one rank's real step at full size on fake tensors, vs simulate
    plait viz schedule ...      draw a pipeline schedule

Errors a user can cause end with one line on stderr and exit code 2; a run stopped by
Ctrl-C exits 130, by SIGTERM 143.
"""

from __future__ import annotations

import argparse
import sys

from plait.commands.common import UserError, die


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (exit 2), naming the flag
    and what would work, with a pointer to ``--help`` -- not the whole usage block first
    (56 lines for ``plait train``). Its subparsers are of this class too (argparse makes
    them with the parent's class)."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def make_parser() -> tuple[argparse.ArgumentParser, dict]:
    """The ``plait`` parser and, per verb, ``(its module, its subparser)``. Each module in
    ``plait/commands/`` adds its subparser (``add_parser``) and runs it (``run``)."""
    from plait.commands import (
        calibrate,
        checkpoint,
        export,
        generate,
        info,
        plan,
        prepare,
        rehearse,
        report,
        simulate,
        train,
        viz,
    )

    parser = OneLineParser(prog="plait", allow_abbrev=False, description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    verbs = {}
    for name, module in [("train", train), ("prepare", prepare), ("generate", generate),
                         ("export", export), ("checkpoint", checkpoint), ("report", report),
                         ("info", info),
                         ("simulate", simulate), ("viz", viz), ("plan", plan),
                         ("calibrate", calibrate), ("rehearse", rehearse)]:  # fmt: skip
        verbs[name] = (module, module.add_parser(sub))
    return parser, verbs


def main(argv=None) -> int:
    parser, verbs = make_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module, verb_parser = verbs[args.command]
    try:
        return module.run(args, verb_parser)
    except UserError as e:  # a --config file the verb did not report itself
        return die(args.command, str(e))


if __name__ == "__main__":
    sys.exit(main())
