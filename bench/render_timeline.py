"""Render a wstream timeline (Chrome-trace JSON from ``trainer.trace``) as a PNG, lane by lane.

    python bench/render_timeline.py step.json docs/img/timeline.png [--title TEXT]

Perfetto (https://ui.perfetto.dev) is the interactive viewer; this gives a still picture for docs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

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
    "gather": "#ff9da6",
    "queue": "#bab0ac",
    "optimizer": "#eeca3b",
    "deferred": "#e45756",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("out")
    p.add_argument("--title", default="")
    args = p.parse_args()
    events = json.loads(Path(args.trace).read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    rows = sorted(threads)  # (pid, tid): worker lanes first, then the server's
    spans = [e for e in events if e["ph"] == "X"]
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
    ax.set_title(args.title or Path(args.trace).name, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
