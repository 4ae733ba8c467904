"""Memory saved by sharing KV blocks on the default model, next to the paper's Figure 15 ranges.

Reads docs/figures/data/sharing.json, the output of `jax-engine bench sharing` (the command is in the file).
"""

import json

from docs.figures._figure import COLORS, DATA, plt, save

data = json.loads((DATA / "sharing.json").read_text())
workloads = ["parallel sampling", "beam search"]
fig, axes = plt.subplots(1, 2, figsize=(7.0, 3.0), sharey=True)
for ax, workload in zip(axes, workloads):
    rows = [r for r in data["results"] if r["workload"] == workload]
    widths = [str(r["width"]) for r in rows]
    saved = [100 * r["saved"] for r in rows]
    low, high = (100 * x for x in data["paper"][workload])
    ax.axhspan(low, high, color=COLORS["reserved"], alpha=0.25, linewidth=0,
               label=f"paper, OPT-13B on Alpaca: {low:.1f}-{high:.1f}%")
    bars = ax.bar(widths, saved, 0.55, color=COLORS["shared"], label="ours, SmolLM2-135M, Alpaca-like")
    ax.bar_label(bars, [f"{s:.1f}%" for s in saved], fontsize=7.5, padding=2)
    ax.set_title(workload, fontsize=10)
    ax.set_xlabel("parallel samples" if workload == "parallel sampling" else "beam width")
    ax.legend(fontsize=7, frameon=False, loc="upper left")
axes[0].set_ylabel("KV blocks saved by sharing (%)")
axes[0].set_ylim(0, 75)
fig.tight_layout()
save(fig, "sharing_saved")
