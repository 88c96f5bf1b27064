"""``plait report RUN``: one self-contained HTML page (and a PNG) about a run
(``viz/report.py``).

    plait report runs/x                    # runs/x/report.html and its PNG

Errors a user can cause print one line and return 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plait.commands.common import die


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("report", allow_abbrev=False,
                       help="one self-contained HTML page (and a PNG) about a run")  # fmt: skip
    p.add_argument("run", metavar="RUN", help="run folder written by plait train")
    p.add_argument("--out", help="HTML file to write (default RUN/report.html)")
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from plait.viz.report import write_report

    try:
        page, png = write_report(Path(args.run), args.out)
    except (ValueError, OSError) as e:
        return die("report", str(e).strip().splitlines()[0])
    print(f"wrote {page} and {png}")
    return 0
