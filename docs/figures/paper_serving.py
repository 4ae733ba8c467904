"""Normalized latency against request rate (the paper's Figure 12), from `jax-engine bench serve` runs.

Reads docs/figures/data/paper_serving.json, one run per request rate, each with its command and machine.
"""

import json

from docs.figures._figure import COLORS, DATA, plt, save

runs = json.loads((DATA / "paper_serving.json").read_text())["runs"]
runs.sort(key=lambda run: run["report"]["request_rate"])
rates = [run["report"]["request_rate"] for run in runs]
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(rates, [run["report"]["mean_normalized_latency_ms"] / 1000 for run in runs], marker="o",
        color=COLORS["used"])
ax.set_xlabel("request rate (requests/s, Poisson arrivals)")
ax.set_ylabel("normalized latency (s/token)")
ax.set_ylim(bottom=0)
ax.set_xlim(0, max(rates) * 1.2)
first = runs[0]
ax.set_title(f"{first['num_prompts']} {first['length_mode']} requests per rate, SmolLM2-135M, "
             f"{first['machine']['cpu_count']}-core CPU", loc="left", fontsize=10)
for i, run in enumerate(runs):  # what the server delivered at each rate; labels alternate below and above,
    report = run["report"]     # since neighbouring rates can have the same latency
    ax.annotate(f"{report['request_throughput']:.2f} req/s served", (report["request_rate"],
                report["mean_normalized_latency_ms"] / 1000), textcoords="offset points",
                xytext=(5, -14 if i % 2 == 0 else 8), fontsize=9, color=COLORS["external"])
fig.tight_layout()
save(fig, "paper_serving")
