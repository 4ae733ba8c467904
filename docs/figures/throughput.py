"""Offline throughput against the number of requests, per workload and backend.

Drawn from docs/figures/data/throughput.json: the runs recorded in the tables of docs/benchmarks.md
(sharegpt-like) and docs/performance-notes.md (fixed lengths), with the commands that made them. The
sharegpt-like and fixed-length runs are different workloads: each (workload, backend) pair is its own
series, and no line joins points of different workloads. The x-axis is logarithmic (16 to 1000 requests).
"""

import json

from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, NullLocator

from docs.figures._figure import COLORS, DATA, plt, save
from jax_engine.bench.plot import series

BACKEND_COLORS = {"jax_engine": COLORS["used"], "hf generate (static batches)": COLORS["reserved"],
                  "hf generate_batch (continuous)": COLORS["accent"]}
# Workloads differ by marker and line style, backends by colour.
# The sharegpt-like points are drawn on top: at 16 requests HF's sits on a fixed-length one.
WORKLOAD_STYLES = {"sharegpt-like": dict(marker="o", linestyle="-", markersize=5.5, zorder=3),
                   "fixed": dict(marker="s", linestyle="--", markersize=7, markerfacecolor="white")}
WORKLOAD_NAMES = {"sharegpt-like": "sharegpt-like: 161 in / 338 out (means)",
                  "fixed": "fixed: 128 in / 128 out, before the CPU kernel"}
# Values up and left of sharegpt-like points, down and right of fixed ones: at 16 requests the two
# workloads' points are close, and every line rises or stays flat to the right.
LABEL_OFFSETS = {"sharegpt-like": ((-4, 3), "right", "bottom"), "fixed": ((5, -3), "left", "top")}

reports = json.loads((DATA / "throughput.json").read_text())["reports"]
lines = series(reports)

fig, ax = plt.subplots(figsize=(7, 3.5))
for (backend, workload), points in lines.items():
    xs, ys = zip(*points)
    ax.plot(xs, ys, color=BACKEND_COLORS[backend], linewidth=1.5, **WORKLOAD_STYLES[workload])
    offset, ha, va = LABEL_OFFSETS[workload]
    for x, y in points:
        ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=offset, ha=ha, va=va,
                    fontsize=8, color=BACKEND_COLORS[backend])

ax.set_xscale("log")
requests = sorted({x for points in lines.values() for x, _ in points})
ax.xaxis.set_major_locator(FixedLocator(requests))
ax.xaxis.set_minor_locator(NullLocator())
ax.set_xticklabels([str(x) for x in requests])
ax.set_xlim(requests[0] / 1.4, requests[-1] * 1.6)
ax.set_ylim(0, max(y for points in lines.values() for _, y in points) * 1.15)
ax.set_xlabel("number of requests (log scale)")
ax.set_ylabel("output tokens/s")
ax.set_title("Offline throughput, SmolLM2-135M, 2-core CPU")
ax.grid(axis="y", color=COLORS["free"], linewidth=0.8)
ax.set_axisbelow(True)

handles = [Line2D([], [], color=color, linewidth=1.5, label=backend) for backend, color in BACKEND_COLORS.items()]
handles += [Line2D([], [], color="black", linewidth=1.5, label=WORKLOAD_NAMES[w], **style)
            for w, style in WORKLOAD_STYLES.items()]
ax.legend(handles=handles, loc="upper left", frameon=False, fontsize=8)
save(fig, "throughput")
