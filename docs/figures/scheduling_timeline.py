"""A real Scheduler trace with preemptions, by recompute and by swap: rows = requests, columns = steps.

Drawn from the trace of docs/examples/scheduling_preemption.py (reference.Scheduler over a BlockManager of
8 blocks of 4 tokens, chunked prefill under a budget of 8 tokens a step).
"""

from docs.examples.scheduling_preemption import IDS, run
from docs.figures._figure import COLORS, plt, save
from docs.figures._grid import draw_grid, legend_handles

STYLE = {"P": (COLORS["accent"], "prefill chunk (tokens)"), "D": (COLORS["used"], "decode"),
         "X": (COLORS["internal"], "preempted"), "S": (COLORS["reserved"], "swapped out"),
         "w": (COLORS["free"], "waiting")}

runs = {mode: run(mode) for mode in ("recompute", "swap")}
num_steps = max(len(steps) for steps in runs.values())
fig, axes = plt.subplots(2, 1, figsize=(7, 4.2), sharex=True)
for ax, (mode, steps) in zip(axes, runs.items()):
    cells = {}
    for t, record in enumerate(steps):
        for row, rid in enumerate(IDS):
            kind = record["cells"].get(rid, "")
            if kind:
                cells[(row, t)] = (STYLE[kind[0]][0], kind[1:] if kind[0] == "P" else "")
    preemptions = sum(len(record["out"].preempted) for record in steps)
    draw_grid(ax, IDS, cells, num_steps, f'preemption_mode="{mode}": {preemptions} preemptions, '
                                         f"{len(steps)} steps")
axes[1].set_xlabel("engine step")
fig.legend(handles=legend_handles({label: color for color, label in STYLE.values()}), loc="lower center",
           ncol=5, frameon=False, fontsize=8, bbox_to_anchor=(0.5, -0.04))
fig.tight_layout()
save(fig, "scheduling_timeline")
