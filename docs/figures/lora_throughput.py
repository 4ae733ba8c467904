"""Decode throughput at a batch of 32 and time per token at batch 1, by distinct adapters in the batch, beside
each step's bound.

Reads docs/figures/data/lora.json, written by `jax-engine bench lora --out docs/figures/data/lora.json`.
"""

import json

import numpy as np

from docs.figures._figure import COLORS, DATA, plt, save

data = json.loads((DATA / "lora.json").read_text())
rows = data["rows"]
labels = ["base model" if r["adapters"] == 0 else f"{r['adapters']} adapter{'s' * (r['adapters'] > 1)}"
          for r in rows]
x = np.arange(len(rows))

fig, (left, right) = plt.subplots(1, 2, figsize=(7.5, 3.4))
for ax, measured, bound, title in (
        (left, [r["tokens_per_s"] for r in rows], [r["bound_tokens_per_s"] for r in rows],
         f"batch {data['batch_size']}: tokens/s"),
        (right, [r["batch_1_ms"] for r in rows], [r["batch_1_bound_ms"] for r in rows], "batch 1: ms per token")):
    ax.bar(x, measured, color=[COLORS["external"]] + [COLORS["used"]] * (len(rows) - 1), width=0.6)
    ax.plot(x, bound, "_", color=COLORS["internal"], markersize=28, markeredgewidth=2, label="bound")
    for i, value in enumerate(measured):
        ax.annotate(f"{value:.0f}", (i, value), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=9)
    ax.set_xticks(x, labels, rotation=20)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, linewidth=0.5, axis="y")
left.legend(fontsize=9, frameon=False, loc="center right")
fig.suptitle(f"rank-{data['rank']} adapters on every projection of the default model", fontsize=10)
fig.tight_layout()
save(fig, "lora_throughput")
