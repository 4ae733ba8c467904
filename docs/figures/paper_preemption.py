"""Swap against recompute by block size (the paper's Figure 19), from `jax-engine bench preemption`.

Reads docs/figures/data/paper_preemption.json (its command and machine are in the file).
"""

import json

import numpy as np

from docs.figures._figure import COLORS, DATA, plt, save

run = json.loads((DATA / "paper_preemption.json").read_text())["runs"][-1]
results = run["results"]
sizes = sorted({r["block_size"] for r in results})
by = {(r["block_size"], r["preemption_mode"]): r for r in results}
style = {"recompute": COLORS["accent"], "swap": COLORS["reserved"]}
fig, (left, right) = plt.subplots(1, 2, figsize=(7.5, 3.4))
for mode, color in style.items():
    left.plot(sizes, [by[(s, mode)]["mean_normalized_latency_s"] for s in sizes], marker="o", color=color,
              label=mode)
left.set_ylabel("normalized latency (s/token)")
left.set_title("(a) end to end", loc="left", fontsize=10)
left.legend(frameon=False, loc="lower right")
# What preempting cost inside the run: seconds spent copying blocks (swap), tokens computed again (recompute).
x = np.arange(len(sizes))
right.bar(x - 0.2, [by[(s, "swap")]["swap_s"] for s in sizes], 0.4, color=style["swap"],
          label="swap: seconds copying blocks")
right.set_ylabel("seconds copying blocks (swap)")
twin = right.twinx()
twin.bar(x + 0.2, [by[(s, "recompute")]["recomputed_tokens"] for s in sizes], 0.4, color=style["recompute"],
         label="recompute: tokens computed again")
twin.set_ylabel("tokens computed again (recompute)")
twin.spines["right"].set_visible(True)
right.set_xticks(x, [str(s) for s in sizes])
right.set_title("(b) the cost of preempting", loc="left", fontsize=10)
for ax in (left, right):
    ax.set_xlabel("block size (tokens)")
left.set_xscale("log", base=2)
left.set_xticks(sizes, [str(s) for s in sizes])
left.set_ylim(bottom=0)
w = run["workload"]
fig.suptitle(f"{w['num_requests']} requests of {w['input_len']} + {w['output_len']} tokens in a cache of "
             f"{w['cache_tokens']} tokens, SmolLM2-135M, {run['machine']['cpu_count']}-core CPU", fontsize=10)
fig.legend(handles=[*right.get_legend_handles_labels()[0], *twin.get_legend_handles_labels()[0]],
           loc="lower center", ncol=2, frameon=False, fontsize=8, bbox_to_anchor=(0.5, -0.05))
fig.tight_layout()
save(fig, "paper_preemption")
