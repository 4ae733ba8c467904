"""The cpu backend's paged-attention kernel: time of a decode step by block size, blocks in order or scattered.

Reads docs/figures/data/kernels_block_size.json, written by `jax-engine bench kernels ... --json-out` (one
run per block size and pass; the command of each run is in the file). The machine's speed drifts, so each
point is the fastest of the runs recorded for its block size.
"""

import json

from docs.figures._figure import COLORS, DATA, plt, save

runs = json.loads((DATA / "kernels_block_size.json").read_text())["runs"]
sizes = sorted({run["settings"]["block_size"] for run in runs})
passes = len(runs) // len(sizes)
s = runs[0]["settings"]
fig, ax = plt.subplots(figsize=(7, 3.5))
for name, color in (("in order", COLORS["used"]), ("scattered", COLORS["internal"])):
    ms = [min(r["ms"] for run in runs if run["settings"]["block_size"] == size
              for r in run["results"] if r["blocks"] == name) for size in sizes]
    ax.plot(sizes, ms, marker="o", color=color, label=f"blocks {name}")
ax.set_xscale("log", base=2)
ax.set_xticks(sizes, [str(size) for size in sizes])
ax.set_ylim(bottom=0)
ax.set_xlabel("block size (tokens)")
ax.set_ylabel("time per decode step (ms)")
ax.set_title(f"CPU kernel, {s['batch']} sequences x {s['context']} tokens x {s['layers']} layers: "
             f"fastest of {passes} runs", loc="left", fontsize=10)
ax.legend(frameon=False, loc="lower right")
fig.tight_layout()
save(fig, "kernels_block_size")
