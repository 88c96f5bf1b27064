"""The ``plait report`` page in a real browser: headless Chromium renders it and the
screenshot is checked for content (not a blank page, images decoded).

    python benchmarks/report_screenshot.py [--run RUN] [--browser chromium]

Without ``--run`` it first trains a small LoRA run on instruction data with two pipeline
ranks, traces and TensorBoard (``plait train``, 2 workers: run it under the CPU lock), so
the page has every section. Prints what it measured: the page's size, whether it
references anything outside itself, the screenshot's size and the share of its pixels
that are not background, per horizontal band (a band of only background where an image
should be means the browser did not decode it).

Why a script and not a CI test: CI installs Python packages only (``.ci/run``); a
browser would add an apt install of ~100 MB to every CI run. The CI test
(``tests/test_finetune.py::test_report_is_one_self_contained_page``) checks what makes
the page render anywhere (images inline, no script, no external link) and that the PNG
is not blank; this script is the browser check, and its output is in RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def small_run(root: Path) -> Path:
    """A 10-step LoRA run on generated instruction data: pp 2, traces, TensorBoard."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_finetune import write_instructions

    data = write_instructions(root / "train.jsonl")
    run = root / "run"
    cmd = [
        sys.executable, "-m", "plait.cli", "train", "--model", "tiny", "--layers", "2",
        "--hidden", "64", "--heads", "4", "--seq-len", "64", "--global-batch-size", "8",
        "--pp", "2", "--steps", "10", "--eval-every", "5", "--eval-batches", "1",
        "--data", str(data), "--tokenizer", "bytes", "--cache-dir", str(root / "cache"),
        "--val-fraction", "0.05", "--lora-rank", "8", "--lora-targets", "q,v,o,up,down",
        "--lr", "1e-2", "--trace", "--tensorboard", "--threads", "1", "--no-progress",
        "--out", str(run),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return run


def screenshot(browser: str, page: Path, png: Path, width: int, height: int) -> float:
    cmd = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        f"--window-size={width},{height}", f"--screenshot={png}", page.resolve().as_uri(),
    ]  # fmt: skip
    import time

    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return time.perf_counter() - t0


def ink(png: Path, bands: int) -> list[float]:
    """Share of non-background pixels in each of ``bands`` horizontal bands."""
    import matplotlib.image

    img = matplotlib.image.imread(png)[..., :3]
    dark = img.min(axis=-1) < 0.9
    rows = dark.shape[0] // bands
    return [float(dark[i * rows : (i + 1) * rows].mean()) for i in range(bands)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", help="an existing run folder (default: train a small one)")
    p.add_argument("--browser", default=shutil.which("chromium") or "chromium")
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=2400)
    args = p.parse_args()
    if not shutil.which(args.browser):
        print(f"no browser {args.browser!r}: apt-get install -y chromium", file=sys.stderr)
        return 2
    from plait.viz.report import write_report

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.run) if args.run else small_run(Path(tmp))
        page, png = write_report(run, Path(tmp) / "report.html")
        text = page.read_text()
        links = re.findall(r"(?:src|href)\s*=\s*[\"']([^\"']+)", text)
        external = [x for x in links if not x.startswith("data:")]
        shot = Path(tmp) / "screenshot.png"
        seconds = screenshot(args.browser, page, shot, args.width, args.height)
        bands = ink(shot, 8)
        out = {
            "page_bytes": len(text.encode()),
            "inline_images": len(links) - len(external),
            "external_references": external,
            "browser": subprocess.run(
                [args.browser, "--version"], capture_output=True, text=True
            ).stdout.strip(),  # fmt: skip
            "render_s": round(seconds, 2),
            "screenshot_px": [args.width, args.height],
            "ink_per_band": [round(b, 3) for b in bands],
            "ink_total": round(sum(bands) / len(bands), 3),
        }
        ok = not external and out["ink_total"] > 0.05 and sum(b > 0.02 for b in bands) >= 5
        out["verdict"] = "rendered, not blank" if ok else "FAILED"
        print(json.dumps(out, indent=1))
        saved = Path("report-screenshot.png")
        shutil.copy(shot, saved)
        print(f"screenshot kept as {saved}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
