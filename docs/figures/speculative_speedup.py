"""Tokens per step against the draft's agreement with the target: the expected (1 - a^(k+1)) / (1 - a) for a few
k, and points measured in the reference engine's steps.

The points come from docs/examples/speculative_speedup.py: a draft that agrees with the target's greedy token
with probability a at each position, through the real ReferenceEngine (counted in steps, so deterministic).
"""

import numpy as np
from matplotlib.lines import Line2D

from docs.figures._blocks import run_example
from docs.figures._figure import COLORS, plt, save

run = run_example("speculative_speedup")
measured, expected = run["measured"], run["expected"]
colors = {1: COLORS["used"], 2: COLORS["shared"], 4: COLORS["reserved"], 8: COLORS["accent"]}
a = np.linspace(0, 0.97, 200)

fig, ax = plt.subplots(figsize=(6.4, 3.6))
ax.plot(a, 1 / (1 - a), color=COLORS["external"], linestyle="--", linewidth=1)
ax.annotate("k → ∞: 1 / (1 - a)", (0.86, 1 / (1 - 0.86)), xytext=(-8, 0), textcoords="offset points",
            ha="right", fontsize=9, color=COLORS["external"])
for k, color in colors.items():
    ax.plot(a, [expected(k, x) for x in a], color=color)
    ax.annotate(f"k = {k}", (a[-1], expected(k, a[-1])), xytext=(4, 0), textcoords="offset points",
                va="center", fontsize=9, color=color)
    points = sorted((rate, value) for (kk, rate), value in measured.items() if kk == k)
    if points:
        ax.plot(*zip(*points), "o", color=color, markeredgecolor="white")
handles = [Line2D([], [], color="#555555", label="expected: (1 - a^(k+1)) / (1 - a)"),
           Line2D([], [], color="#555555", marker="o", linestyle="", markeredgecolor="white",
                  label=f"measured: reference engine, {run['NUM_DECODED']} tokens a point")]
ax.legend(handles=handles, fontsize=9, frameon=False, loc="upper left")
ax.set_xlim(0, 1.07)
ax.set_ylim(0.8, 9)
ax.set_xticks(np.linspace(0, 1, 6))
ax.set_xlabel("a: probability that a draft agrees with the target")
ax.set_ylabel("tokens per target step")
ax.grid(alpha=0.3, linewidth=0.5)
fig.tight_layout()
save(fig, "speculative_speedup")
