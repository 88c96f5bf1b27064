"""``plait calibrate``: measure the machine it runs on and write a hardware file that
``plait simulate`` and ``plait plan`` accept (``--hardware calibrated.yaml``).

    plait calibrate                        # ~1-2 minutes; writes calibrated.yaml
    plait calibrate --quick --out hw.yaml  # a short sweep, under 30 s
    plait calibrate --procs 8 --dtypes fp32,bf16

What is measured and fitted: ``plait/calibrate/``. Errors a user can cause print one
line and return 2.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from plait.calibrate import DTYPES, CalibrateConfig, calibrate
from plait.calibrate.config import GiB
from plait.commands.common import die


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("calibrate", allow_abbrev=False,
                       help="measure this machine; write a hardware file for simulate and plan")  # fmt: skip
    add_arguments(p)
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="calibrated.yaml", help="hardware file to write")
    parser.add_argument("--quick", action="store_true", help="a short sweep (under 30 s)")
    parser.add_argument("--procs", type=int, default=None,
                        help="worker processes measured at once (default: the CPU cores, or "
                        "the GPUs)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="threads per process (default 1)")
    parser.add_argument("--dtypes", default="fp32", help="comma-separated, e.g. fp32,bf16")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when available, else cpu")  # fmt: skip
    parser.add_argument("--name", default=None, help="name of the hardware entry")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    try:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            return die("calibrate", "--device cuda: no CUDA device here; --device cpu "
                                    "measures this machine's CPU")  # fmt: skip
        procs = args.procs
        if procs is None:
            procs = torch.cuda.device_count() if device == "cuda" else max(2, os.cpu_count() or 1)
        cfg = CalibrateConfig(
            quick=args.quick, procs=procs, threads=args.threads, device=device,
            dtypes=tuple(d.strip() for d in args.dtypes.split(",") if d.strip()),
            name=args.name or f"{socket.gethostname()}-{device}",
        )  # fmt: skip
        print(f"plait calibrate: measuring {device} ({'quick' if cfg.quick else 'full'} sweep)",
              flush=True)  # fmt: skip
        hw, data = calibrate(cfg, log=lambda m: print(m, flush=True))
        hw.to_yaml(args.out)
    except OSError as e:
        return die("calibrate", f"--out {args.out}: cannot write it ({e.strerror})")
    except (ValueError, RuntimeError) as e:
        return die("calibrate", str(e).splitlines()[0])
    print(summary(hw, data))
    print(f"wrote {args.out} in {data['seconds']:.1f} s "
          f"(plait simulate --hardware {args.out}; plait plan --hardware {args.out})")  # fmt: skip
    return 0


def summary(hw, data: dict) -> str:
    """What was measured and fitted, as printed by ``plait calibrate``."""
    from plait.sim import collectives

    eff, fit = hw.efficiency, data["fit"]
    lines = [
        "peak        "
        + ", ".join(
            f"{d} {v / 1e9:.1f} GFLOP/s" for d in DTYPES if (v := hw.peak_flops.get(d))
        )  # fmt: skip
        + f" per process; memory {hw.memory_bandwidth / 1e9:.2f} GB/s",
        f"gemm fit    gemm_max {eff.gemm_max:.2f}, gemm_half_k {eff.gemm_half_k:.0f}, "
        f"gemm_half_flops {eff.gemm_half_flops:.3g}: rms error {fit['residual']:.0%} over "
        f"{sum(1 for r in data['matmul'] if r[0] == 'fp32')} shapes; attention {eff.attention:.2f}",
    ]
    if data["collectives"]:
        link = hw.intra_node
        lines.append(f"link        latency {link.latency * 1e6:.1f} us, bandwidth "
                     f"{link.bandwidth / 1e9:.2f} GB/s: rms error {data['link']['residual']:.0%}")  # fmt: skip
        lines.append(f"{'op':<15}{'procs':>6}{'bytes':>10}{'measured':>12}{'fit':>12}")
        fns = {"all_reduce": collectives.all_reduce_time, "all_gather": collectives.all_gather_time,
               "reduce_scatter": collectives.reduce_scatter_time}  # fmt: skip
        for op, n, s, t in data["collectives"]:
            pred = (
                collectives.p2p_time(s, link) if op == "p2p" else fns[op](s, n, link)
            )  # per-op pair
            lines.append(f"{op:<15}{n:>6}{s:>10}{t * 1e6:>10.0f}us{pred * 1e6:>10.0f}us")
    lines.append(f"overhead    {hw.framework_overhead_bytes / GiB:.2f} GiB per process; "
                 f"memory {hw.memory_bytes / GiB:.1f} GiB per process")  # fmt: skip
    return "\n".join(lines)


def _main() -> int:  # python -m plait.commands.calibrate
    p = argparse.ArgumentParser(prog="plait calibrate")
    add_arguments(p)
    return run(p.parse_args())


if __name__ == "__main__":
    sys.exit(_main())
