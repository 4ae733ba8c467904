"""The rejection rule is exact: on five tokens, what `rejection_sample` emits first has the target's
distribution p, whatever the draft's q.

Drawn from docs/examples/speculative_exact.py, which runs the oracle's real `rejection_sample` on every
case (a scripted generator) and on 20,000 seeded draws.
"""

import numpy as np

from docs.figures._blocks import run_example
from docs.figures._figure import COLORS, plt, save

run = run_example("speculative_exact")
p, q, exact, sampled = run["p"], run["q"], run["exact"], run["sampled"]
tokens = np.arange(len(p))
width = 0.38

fig, (left, right) = plt.subplots(1, 2, figsize=(7.4, 3.0), sharey=True)
left.bar(tokens - width / 2, p, width, color=COLORS["used"], label="target p")
left.bar(tokens + width / 2, q, width, color=COLORS["reserved"], label="draft q")
left.set_title(f"accepted with probability Σ min(p, q) = {np.minimum(p, q).sum():.2f}", fontsize=10)
left.set_ylabel("probability")

right.bar(tokens - width / 2, exact, width, color=COLORS["accent"], label="exact, every case")
right.bar(tokens + width / 2, sampled, width, color=COLORS["shared"],
          label=f"{int(run['counts'].sum()):,} seeded draws")
right.scatter(tokens, p, marker="_", s=500, linewidths=2, color="black", zorder=3, label="target p")
right.set_title("the first token rejection_sample emits", fontsize=10)

for ax in (left, right):
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_xlabel("token")
    ax.set_ylim(0, 0.5)
    ax.legend(fontsize=9, frameon=False, loc="upper right")
fig.tight_layout()
save(fig, "speculative_exact")
