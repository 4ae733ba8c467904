"""How tensor parallelism splits SmolLM2's attention heads over tp devices, drawn from the engine's own layout.

`head_layout` (jax_engine/distributed/tensor_parallel.py) gives, for each device, the query heads and the KV
heads it holds (-1: an empty padding head). Each query head is coloured by the KV head it reads.
"""

from matplotlib.patches import Rectangle

from docs.figures._figure import COLORS, plt, save
from jax_engine.distributed.tensor_parallel import EMPTY, head_layout

HEADS, KV_HEADS = 9, 3  # SmolLM2-135M
SIZES = (1, 2, 3, 4, 6)
KV_COLORS = (COLORS["used"], COLORS["reserved"], COLORS["shared"])
CELL, GAP, ROW = 1.0, 0.7, 3.8

fig, ax = plt.subplots(figsize=(7.2, 5.2))
for r, tp in enumerate(SIZES):
    layout = head_layout(HEADS, KV_HEADS, tp)
    y = -r * ROW
    ax.text(-0.4, y + CELL / 2, f"tp = {tp}", ha="right", va="center", fontweight="bold")
    x = 0.0
    for device, (q, kv) in enumerate(zip(layout.q, layout.kv)):
        width = len(q) * CELL
        ax.add_patch(Rectangle((x - 0.12, y - CELL - 0.62), width + 0.24, 2 * CELL + 0.74, fill=False,
                               edgecolor="#555555", linewidth=1))
        ax.text(x + width / 2, y + CELL + 0.35, f"d{device}", ha="center", va="bottom")
        for j, head in enumerate(q):  # local query head j reads local KV head j // (len(q) // len(kv))
            reads = kv[j // (len(q) // len(kv))]
            color = COLORS["free"] if head == EMPTY else KV_COLORS[reads]
            ax.add_patch(Rectangle((x + j * CELL, y), CELL, CELL, facecolor=color, edgecolor="white"))
            ax.text(x + (j + 0.5) * CELL, y + CELL / 2, "-" if head == EMPTY else str(head), ha="center",
                    va="center", color="black" if head == EMPTY else "white")
        kv_width = width / len(kv)
        for k, head in enumerate(kv):
            color = COLORS["free"] if head == EMPTY else KV_COLORS[head]
            ax.add_patch(Rectangle((x + k * kv_width, y - CELL - 0.5), kv_width, CELL, facecolor=color,
                                   edgecolor="white", alpha=0.55))
            ax.text(x + (k + 0.5) * kv_width, y - CELL / 2 - 0.5, "-" if head == EMPTY else f"KV {head}",
                    ha="center", va="center")
        x += width + GAP
ax.text(-3.4, 3.9, "Devices d0, d1, ...: the query heads (top) and KV heads (bottom) each holds;",
        ha="left", va="center")
ax.text(-3.4, 3.0, "a query head has the colour of the KV head it reads; - is an empty head",
        ha="left", va="center")
ax.set_xlim(-3.4, 12 * CELL + 5 * GAP + 0.3)
ax.set_ylim(-(len(SIZES) - 1) * ROW - CELL - 0.8, 4.3)
ax.axis("off")
save(fig, "distributed_heads")
