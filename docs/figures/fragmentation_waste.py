"""The paper's Figure 2 from reference.tutorial.kv_memory: where the KV cache goes under load, contiguous versus paged.

Drawn from docs/examples/kv_memory.py (its trace, its arena, its four accountings).
"""

import numpy as np

from docs.figures._blocks import run_example
from docs.figures._figure import COLORS, plt, save

example = run_example("kv_memory")
systems = example["systems"]
parts = [("used", "used (token states)", "used"), ("reserved", "reserved", "reserved"),
         ("internal_fragmentation", "internal fragmentation", "internal"),
         ("external_fragmentation", "external fragmentation", "external")]

fig, ax = plt.subplots(figsize=(7.2, 3.4))
labels = [name.replace(", ", ",\n") for name in systems]
x = np.arange(len(systems))
bottom = np.zeros(len(systems))
for field, label, colour in parts:
    share = np.array([getattr(u, field) / u.total for u in systems.values()]) * 100
    ax.bar(x, share, 0.6, bottom=bottom, color=COLORS[colour], label=label)
    for xi, b, s in zip(x, bottom, share):
        if s >= 4:
            ax.text(xi, b + s / 2, f"{s:.1f}%", ha="center", va="center", fontsize=9, color="white")
    bottom += share
ax.set_xticks(x, labels, fontsize=9)
ax.set_ylabel("share of the KV cache (%)")
ax.set_ylim(0, 100)
ax.set_title(f"KV cache under load: {len(example['trace'])} ShareGPT-like requests, {example['arena']:,} slots",
             fontsize=10)
ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9, frameon=False)
fig.tight_layout()
save(fig, "fragmentation_waste")
