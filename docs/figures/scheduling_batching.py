"""Request-level against iteration-level batching: which request runs in which step.

Drawn from the trace of docs/examples/scheduling_batching.py (the reference Scheduler, driven both ways).
"""

from docs.examples.scheduling_batching import BATCH, OUTPUT_LENS, run
from docs.figures._figure import COLORS, plt, save
from docs.figures._grid import draw_grid, legend_handles

LEGEND = {"prefill (first token)": COLORS["accent"], "decode": COLORS["used"], "waiting": COLORS["free"],
          "finished, slot idle until the batch ends": COLORS["reserved"]}


def cells_of(steps: list[list[str]], static: bool) -> dict:
    ids = [f"r{i}" for i in range(len(OUTPUT_LENS))]
    ran = {rid: [t for t, s in enumerate(steps) if rid in s] for rid in ids}
    cells = {}
    for row, rid in enumerate(ids):
        first, last = ran[rid][0], ran[rid][-1]
        for t in range(first):
            cells[(row, t)] = (COLORS["free"], "")
        for t in ran[rid]:
            cells[(row, t)] = (COLORS["accent"] if t == first else COLORS["used"], "")
        if static:  # the batch's slot stays taken until its longest request finishes
            batch = [ids[i] for i in range(row // BATCH * BATCH, row // BATCH * BATCH + BATCH)]
            batch_end = max(ran[r][-1] for r in batch)
            for t in range(last + 1, batch_end + 1):
                cells[(row, t)] = (COLORS["reserved"], "")
    return cells


static, continuous = run(iteration_level=False), run(iteration_level=True)
fig, axes = plt.subplots(2, 1, figsize=(7, 4.6), sharex=True)
ids = [f"r{i}" for i in range(len(OUTPUT_LENS))]
draw_grid(axes[0], ids, cells_of(static, True), len(static),
          f"Request-level batching: batches of {BATCH}, {len(static)} steps")
draw_grid(axes[1], ids, cells_of(continuous, False), len(static),
          f"Iteration-level batching: at most {BATCH} at a time, {len(continuous)} steps")
axes[1].set_xlabel("engine step")
fig.legend(handles=legend_handles(LEGEND), loc="lower center", ncol=2, frameon=False, fontsize=8,
           bbox_to_anchor=(0.5, -0.06))
fig.tight_layout()
save(fig, "scheduling_batching")
