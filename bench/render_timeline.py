"""Render a wstream timeline (Chrome-trace JSON from ``trainer.trace``) as a PNG, lane by lane.

    python bench/render_timeline.py step.json docs/img/timeline.png [--title TEXT]
    python bench/render_timeline.py --smoke    # trace one tiny step and render it in a temp dir

Perfetto (https://ui.perfetto.dev) is the interactive viewer; this gives a still picture for docs.
Needs matplotlib, the ``bench`` extra: ``pip install -e '.[bench]'`` in a checkout.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from common import parse_args

COLORS = {
    "step": "#d9d9d9",
    "forward": "#4c78a8",
    "recompute": "#9ecae9",
    "backward": "#f58518",
    "wait": "#e45756",
    "fetch": "#72b7b2",
    "copy": "#54a24b",
    "ring": "#f2f2f2",
    "push": "#b279a2",
    "commit": "#7f3c8d",
    "gather": "#ff9da6",
    "queue": "#bab0ac",
    "optimizer": "#eeca3b",
    "deferred": "#e45756",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?")
    p.add_argument("out", nargs="?")
    p.add_argument("--title", default="")
    args = parse_args(p, smoke={})
    if args.smoke and args.trace is None:
        with tempfile.TemporaryDirectory() as tmp:
            trace, out = Path(tmp) / "step.json", Path(tmp) / "step.png"
            _trace_one_step(trace)
            render(trace, out, args.title)
        return
    if args.trace is None or args.out is None:
        p.error("give the trace to read and the picture to write (or --smoke)")
    render(Path(args.trace), Path(args.out), args.title)


def _trace_one_step(path: Path) -> None:
    """A timeline of one step of a tiny job, for the smoke run."""
    import torch
    from torch import nn

    from common import server
    from wstream.client import Client

    with server() as address, Client(address) as client:
        job = client.create_job("smoke", [nn.Linear(8, 8) for _ in range(3)], token="t")
        with job.trainer() as trainer, trainer.trace(path):
            trainer.step(torch.randn(4, 8), torch.randn(4, 8), nn.functional.mse_loss)


def render(trace: Path, out: Path, title: str) -> None:
    events = json.loads(trace.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    rows = sorted(threads)  # (pid, tid): worker lanes first, then the server's
    spans = [e for e in events if e["ph"] == "X"]
    assert rows and spans, f"{trace} holds no lanes or spans"
    try:
        import matplotlib
    except ImportError:  # the bench extra; a smoke run on a bare install checks the trace only
        print(f"{trace}: {len(spans)} spans on {len(rows)} lanes; matplotlib is not installed, nothing drawn")
        return
    matplotlib.use("Agg")
    _draw(spans, rows, procs, threads, title or trace.name, out)
    print(f"wrote {out}")


def _draw(spans: list[dict[str, Any]], rows: list[tuple[int, int]], procs: dict[int, str],
          threads: dict[tuple[int, int], str], title: str, out: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.5))
    for y, key in enumerate(rows):
        for e in (e for e in spans if (e["pid"], e["tid"]) == key):
            ax.broken_barh(
                [(e["ts"] / 1000, max(e["dur"] / 1000, 0.02))], (y - 0.4, 0.8), color=COLORS.get(e["cat"], "#888888")
            )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{procs[pid].split(' ')[0]}: {threads[(pid, tid)]}" for pid, tid in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.grid(axis="x", alpha=0.3)
    cats = sorted({e["cat"] for e in spans}, key=list(COLORS).index)
    ax.legend(handles=[Patch(color=COLORS[c], label=c) for c in cats], ncol=len(cats), fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.12 if len(rows) > 6 else -0.25), frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
