"""Beam search as a tree: beams fork, are pruned, and share the blocks of their common past.

Drawn from a run of docs/examples/sharing_beam_search.py: its beams, its history, its final block tables.
"""

from matplotlib.patches import Rectangle

from docs.figures._blocks import EDGE, TEXT_ON_DARK, canvas, legend, run_example
from docs.figures._figure import COLORS, save

example = run_example("sharing_beam_search")
history, tokenizer, bm, prompt = example["history"], example["tokenizer"], example["bm"], example["prompt"]
width, steps = example["width"], example["steps"]
X_STEP, ROW, CELL = 3.6, 1.6, 1.0

# Node (step, beam name) -> row; row = the survivor's rank in its step (best at the top).
row = {(0, "beam0"): (width - 1) / 2}
for step, plan in enumerate(history, 1):
    for rank, (child, _, _) in enumerate(plan):
        row[(step, child)] = rank
y_of = lambda node: (width - 1 - row[node]) * ROW  # noqa: E731

fig, ax = canvas(7.2, 3.4, (-1.8, steps * X_STEP + 8.4), (-1.9, width * ROW))
ax.text(0, y_of((0, "beam0")), tokenizer.decode(prompt), ha="center", va="center", fontsize=9,
        bbox=dict(boxstyle="round,pad=0.3", facecolor=COLORS["shared"], edgecolor=EDGE), color=TEXT_ON_DARK)
parents_with_children = {(step - 1, parent) for step, plan in enumerate(history, 1) for _, parent, _ in plan}
for step, plan in enumerate(history, 1):
    for child, parent, token in plan:
        start, end = ((step - 1) * X_STEP, y_of((step - 1, parent))), (step * X_STEP, y_of((step, child)))
        ax.plot([start[0] + 0.7, end[0] - 0.9], [start[1], end[1]], color="#777777", linewidth=0.9, zorder=1)
        last = step == len(history)
        alive = last or (step, child) in parents_with_children
        ax.text(end[0], end[1], tokenizer.decode([token]).strip(), ha="center", va="center", fontsize=9,
                color=TEXT_ON_DARK if alive else "black",
                bbox=dict(boxstyle="round,pad=0.3", facecolor=COLORS["used"] if alive else COLORS["free"],
                          edgecolor=EDGE, linestyle="-" if alive else "--"))
        if not alive:
            ax.text(end[0], end[1] - 0.75, "pruned", ha="center", va="center", fontsize=7, color="#777777")
for step in range(1, steps + 1):
    ax.text(step * X_STEP, -1.6, f"step {step}", ha="center", fontsize=8, color="#555555")

# The final beams' block tables: blocks shared by several beams in green.
for child, _, _ in history[-1]:
    y = y_of((steps, child)) - 0.35
    ax.text(steps * X_STEP + 2.0, y + 0.35, child, va="center", fontsize=8)
    for j, block_id in enumerate(bm.block_table(child)):
        shared = bm.device.blocks[block_id].ref_cnt > 1
        x = steps * X_STEP + 3.7 + j * CELL
        ax.add_patch(Rectangle((x, y), CELL, 0.7, facecolor=COLORS["shared" if shared else "used"], edgecolor=EDGE,
                               linewidth=0.8))
        ax.text(x + CELL / 2, y + 0.35, str(block_id), ha="center", va="center", fontsize=8, color=TEXT_ON_DARK)
ax.text(steps * X_STEP + 3.7 + 2 * CELL, (width - 1) * ROW + 0.7, "block tables", ha="center", fontsize=9, weight="bold")
legend(ax, [(COLORS["shared"], "shared blocks (ref_cnt > 1)"), (COLORS["used"], "a beam's own blocks"),
            (COLORS["free"], "pruned beam (blocks freed)")], fontsize=8)
save(fig, "sharing_beams")
