"""``plait report RUN``: one self-contained HTML page about a run, and a PNG of its charts.

    plait report runs/x            # runs/x/report.html and runs/x/report.png

The page shows the loss and validation curves, throughput and MFU over the steps, the
learning rate and gradient norm, memory per rank, communication bytes per step on each
axis and rank, the fully resolved config, and -- when the run recorded traces -- the last
recorded pipeline step drawn per rank (``viz/recorded.py``). Everything comes from the
run folder: ``metrics.jsonl``, ``config.yaml``, ``ranks/rank-K.json`` (written by every
rank at the end of training) and ``traces/``. Images are embedded as base64 PNG and the
styling is inline: the file opens anywhere, offline, and can be mailed on its own.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path

import yaml

GiB = 2**30


def read_run(run: Path) -> dict:
    run = Path(run)
    if not (run / "metrics.jsonl").is_file():
        raise ValueError(f"{run}: no metrics.jsonl there; pass a folder made by plait train")
    metrics = [x for x in _records(run / "metrics.jsonl") if isinstance(x, dict)]
    if not metrics:
        raise ValueError(f"{run}/metrics.jsonl is empty: the run has not finished a step")
    ranks = [_records(p, whole=True)[0] for p in sorted((run / "ranks").glob("rank-*.json"))]
    ranks = [r for r in ranks if isinstance(r, dict) and isinstance(r.get("rank"), int)]
    config, config_dict = "", {}
    if (run / "config.yaml").is_file():
        try:
            config = (run / "config.yaml").read_text()
            config_dict = yaml.safe_load(config) if config else {}
        except (UnicodeDecodeError, yaml.YAMLError) as e:
            raise ValueError(f"{run}/config.yaml: not readable YAML "
                             f"({str(e).strip().splitlines()[0]})") from None  # fmt: skip
        if not isinstance(config_dict, dict):
            raise ValueError(f"{run}/config.yaml: not a plait run config (a "
                             f"{type(config_dict).__name__}, not a mapping)")  # fmt: skip
    return {"metrics": metrics, "ranks": sorted(ranks, key=lambda r: r["rank"]), "config": config,
            "config_dict": config_dict}  # fmt: skip


def _records(path: Path, *, whole: bool = False) -> list:
    """The JSON values of a metrics.jsonl (one a line), or ``whole``: the one of a
    ranks/rank-K.json; ValueError naming the file when it is not JSON text."""
    try:
        if whole:
            return [json.loads(path.read_text())]
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not JSON text ({str(e).strip().splitlines()[0]})") from None


def _series(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(m["step"], m[key]) for m in metrics if m.get(key) is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def charts(data: dict):
    """The report's charts: one matplotlib figure of six panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, ranks = data["metrics"], data["ranks"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    ax = axes[0, 0]
    ax.plot(*_series(m, "loss"), label="train loss", color="#2171b5")
    if any("val_loss" in r for r in m):
        ax.plot(*_series(m, "val_loss"), "o-", label="validation loss", color="#cb181d")
    ax.set(title="loss", xlabel="step")
    ax.legend()
    ax = axes[0, 1]
    ax.plot(*_series(m, "tokens_per_s"), color="#238b45")
    ax.set(title="throughput (tokens/s)", xlabel="step")
    ax = axes[0, 2]
    steps, mfu = _series(m, "mfu")
    ax.plot(steps, [100 * v for v in mfu], color="#6a51a3")
    ax.set(title="MFU (%)", xlabel="step")
    ax = axes[1, 0]
    ax.plot(*_series(m, "lr"), color="#525252")
    ax.set(title="learning rate / gradient norm", xlabel="step")
    twin = ax.twinx()
    twin.plot(*_series(m, "grad_norm"), color="#fd8d3c")
    twin.set_ylabel("grad norm", color="#fd8d3c")
    ax = axes[1, 1]
    if ranks:
        names = [str(r["rank"]) for r in ranks]
        peak = [r["peak_mem_bytes"] / 2**20 for r in ranks]
        state = [r["model_state_bytes"]["total"] / 2**20 for r in ranks]
        x = range(len(ranks))
        ax.bar([i - 0.2 for i in x], peak, 0.4, label="peak (process / device)", color="#9ecae1")
        ax.bar([i + 0.2 for i in x], state, 0.4, label="model state", color="#2171b5")
        ax.set_xticks(list(x), names)
        ax.set_yscale("log")  # a small model's state is a sliver of the process
        ax.legend(fontsize=8)
    ax.set(title="memory per rank (MiB, log scale)", xlabel="rank")
    ax = axes[1, 2]
    axes_bytes = _comm_per_axis(ranks)
    bottom = [0.0] * len(ranks)
    for axis, color in zip(sorted(axes_bytes), ("#fc9272", "#9e9ac8", "#a1d99b", "#fdd0a2")):
        vals = [v / 2**20 for v in axes_bytes[axis]]
        ax.bar(range(len(ranks)), vals, bottom=bottom, label=axis, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if ranks:
        ax.set_xticks(range(len(ranks)), [str(r["rank"]) for r in ranks])
    if axes_bytes:
        ax.legend(fontsize=8)
    ax.set(title="communication per step (MiB, by axis)", xlabel="rank")
    fig.tight_layout()
    return fig


def _comm_per_axis(ranks: list[dict]) -> dict[str, list[float]]:
    """axis -> bytes per step on each rank (every operation on that axis)."""
    out: dict[str, list[float]] = {}
    for i, r in enumerate(ranks):
        for key, c in r.get("comm", {}).items():
            axis = key.split(".", 1)[0]
            out.setdefault(axis, [0.0] * len(ranks))[i] += c["bytes"] / max(r["steps"], 1)
    return out


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _timeline_png(run: Path) -> tuple[bytes, str] | None:
    from plait.viz.recorded import recorded_step, trace_files
    from plait.viz.timeline import draw_timelines

    if not trace_files(run):
        return None
    timeline, extras, info = recorded_step(run)
    caption = (f"recorded step {info['step']}: {info['makespan_s'] * 1e3:.4g} ms, measured "
               f"bubble {info['bubble']:.3f}")  # fmt: skip
    path = Path(run) / "report-timeline.png"
    draw_timelines([(timeline, extras, caption)], path, unit="ms")
    data = path.read_bytes()
    path.unlink()
    return data, caption


def _summary(data: dict) -> list[tuple[str, str]]:
    m = data["metrics"]
    last = m[-1]
    val = [r["val_loss"] for r in m if "val_loss" in r]
    tps = sorted(r["tokens_per_s"] for r in m)
    mfu = sorted(r["mfu"] for r in m)
    rows = [
        ("steps", f"{last['step']}"),
        ("final train loss", f"{last['loss']:.4f}"),
        ("final validation loss", f"{val[-1]:.4f} (perplexity {math.exp(val[-1]):.4g})" if val else "-"),
        ("tokens / s (median)", f"{tps[len(tps) // 2]:,.0f}"),
        ("MFU (median)", f"{100 * mfu[len(mfu) // 2]:.2f}%"),
        ("peak memory (max over ranks)", f"{last['peak_mem_bytes'] / GiB:.3f} GiB"),
    ]  # fmt: skip
    cfg = data.get("config_dict") or {}
    lay = cfg.get("layout") or {}
    if lay:
        rows.append(("layout", f"dp {lay['dp']} tp {lay['tp']} pp {lay['pp']} ({lay['schedule']}), "
                     f"zero {lay['zero']}, {lay['dtype']}, recompute {lay['recompute']}"))  # fmt: skip
    if cfg.get("lora"):
        lo = cfg["lora"]
        rows.append(
            ("LoRA", f"rank {lo['rank']}, alpha {lo['alpha']}, on {','.join(lo['targets'])}")
        )
    if cfg.get("qat"):
        rows.append(("quantisation-aware training", cfg["qat"]["dtype"]))
    return rows


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{trs}</table>"


def _rank_rows(ranks: list[dict]) -> tuple[list[list[str]], list[list[str]]]:
    mem, comm = [], []
    for r in ranks:
        st = r["model_state_bytes"]
        mem.append([str(r["rank"]), f"pp {r['pp']} dp {r['dp']} tp {r['tp']}",
                    f"{r['peak_mem_bytes'] / 2**20:.1f}", f"{st['params'] / 2**20:.2f}",
                    f"{st['grads'] / 2**20:.2f}", f"{st['optim'] / 2**20:.2f}"])  # fmt: skip
        for key, c in sorted(r.get("comm", {}).items()):
            per_step = c["bytes"] / max(r["steps"], 1)
            comm.append([str(r["rank"]), key, f"{c['calls']:,}", f"{per_step / 2**20:.3f}"])
    return mem, comm


CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1200px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}td,th{padding:3px 10px;border:1px solid #ddd;
text-align:right}th{background:#f4f4f4}td:first-child{text-align:left}img{max-width:100%}
pre{background:#f7f7f7;padding:10px;overflow:auto;font-size:12px}"""


def write_report(run: Path, out_html: Path | None = None, out_png: Path | None = None):
    """Write ``report.html`` and ``report.png`` (default: in the run folder); returns both."""
    run = Path(run)
    out_html = Path(out_html or run / "report.html")
    if out_html.suffix.lower() not in (".html", ".htm") or out_html.is_dir():
        # not over a run's config.yaml, metrics or a folder: a page has an HTML name
        raise ValueError(f"--out {out_html}: the report is an HTML page; name a file "
                         "ending in .html")  # fmt: skip
    data = read_run(run)
    out_png = Path(out_png or out_html.with_suffix(".png"))
    out_html.parent.mkdir(parents=True, exist_ok=True)
    png = _png(charts(data))
    out_png.write_bytes(png)
    mem, comm = _rank_rows(data["ranks"])
    timeline = _timeline_png(run)
    parts = [
        f"<h1>plait run {html.escape(run.resolve().name)}</h1>",
        _table(["", ""], [list(r) for r in _summary(data)]),
        "<h2>Curves, throughput, memory and communication</h2>",
        f'<img alt="charts" src="data:image/png;base64,{base64.b64encode(png).decode()}">',
    ]
    if timeline is not None:
        img, caption = timeline
        parts += [
            "<h2>Pipeline timeline</h2>",
            f"<p>{html.escape(caption)}; hatched: waiting on a message.</p>",
            f'<img alt="timeline" src="data:image/png;base64,{base64.b64encode(img).decode()}">',
        ]
    if mem:
        parts += ["<h2>Memory per rank (MiB)</h2>",
                  _table(["rank", "place", "peak", "params", "grads", "optimizer"], mem)]  # fmt: skip
    if comm:
        parts += ["<h2>Collectives per rank (per step)</h2>",
                  _table(["rank", "axis.operation", "calls in all", "MiB / step"], comm)]  # fmt: skip
    parts += ["<h2>Config</h2>", f"<pre>{html.escape(data['config'])}</pre>"]
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>plait report {html.escape(run.name)}</title><style>{CSS}</style></head>"
        "<body>" + "\n".join(parts) + "</body></html>\n"
    )
    tmp = out_html.with_suffix(".tmp")
    try:
        tmp.write_text(page)
        tmp.replace(out_html)
    finally:
        tmp.unlink(missing_ok=True)
    return out_html, out_png
