"""Decode throughput and step time against batch size, next to the memory-bandwidth and compute bounds.

Reads docs/figures/data/batching.json, written by `jax-engine bench batching` (the command is in the file).
"""

import json

import numpy as np

from docs.figures._figure import COLORS, DATA, plt, save

data = json.loads((DATA / "batching.json").read_text())
results = data["results"]
batch = np.array([r["batch_size"] for r in results])
tokens_per_s = np.array([r["tokens_per_s"] for r in results])
step_ms = np.array([r["median_step_s"] for r in results]) * 1e3
compile_s = [r["compile_s"] for r in results]
context = np.mean([r["mean_context"] for r in results])
roof = data["roofline"]

# A step reads every weight once and each sequence's K/V once; it computes 2 x params FLOPs per token.
b = np.geomspace(batch.min(), batch.max(), 200)
bytes_per_step = data["weight_bytes"] + b * context * data["kv_bytes_per_token"]
bandwidth_bound = b * roof["bandwidth_gbps"] * 1e9 / bytes_per_step
compute_bound = np.full_like(b, roof["compute_bound_tokens_per_s"])

fig, (left, right) = plt.subplots(1, 2, figsize=(7.5, 4.2))
left.plot(b, bandwidth_bound, color=COLORS["reserved"], linestyle="--",
          label=f"memory bound ({roof['bandwidth_gbps']:.0f} GB/s)")
left.plot(b, compute_bound, color=COLORS["internal"], linestyle="--",
          label=f"compute bound ({roof['matmul_gflops']:.0f} GFLOP/s)")
left.plot(b, np.minimum(bandwidth_bound, compute_bound), color="#555555", linewidth=3, alpha=0.25,
          label="the lower of the two")
left.plot(batch, tokens_per_s, "o-", color=COLORS["used"], label="measured (the engine)")
# The run's engine padded every step to at least 8 rows: batches 1-4 did batch 8's work (hollow markers).
padded = batch < 8
left.plot(batch[padded], tokens_per_s[padded], "o", color="white", markeredgecolor=COLORS["used"],
          label="padded to 8 rows")
left.set_ylim(0, 1.15 * max(tokens_per_s.max(), compute_bound[0]))
left.set_ylabel("decode throughput (tokens/s)")
left.set_title("Tokens per second", fontsize=10)

right.plot(batch, step_ms, "o-", color=COLORS["used"], label="measured step")
right.plot(batch[padded], step_ms[padded], "o", color="white", markeredgecolor=COLORS["used"])
right.plot(b, data["weight_bytes"] / (roof["bandwidth_gbps"] * 1e9) * 1e3 + 0 * b, color=COLORS["reserved"],
           linestyle="--", label="reading the weights once")
for x, y, seconds in zip(batch, step_ms, compile_s):  # paid once per new batch shape, at start-up
    right.annotate(f"{seconds:.0f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center",
                   fontsize=9, color=COLORS["external"])
right.plot([], [], " ", label="numbers: compile time (s)")
right.set_ylim(0, 1.2 * step_ms.max())
right.set_ylabel("time per decode step (ms)")
right.set_title("Time per step", fontsize=10)
right.legend(fontsize=9, loc="upper left", frameon=False)

for ax in (left, right):
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch, [str(x) for x in batch])
    ax.set_xlabel("batch size (sequences per step)")
    ax.grid(alpha=0.3, linewidth=0.5)
fig.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=9, frameon=False)
fig.tight_layout(rect=(0, 0.14, 1, 1))
save(fig, "memory_bound_batching")
