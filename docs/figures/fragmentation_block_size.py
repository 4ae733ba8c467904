"""KV-cache waste of paging against block size: the unfilled tail of each request's last block.

`reference.tutorial.kv_memory.paged_usage` over every decoding step of two traces with the paper's mean lengths
(jax_engine/bench/workloads.py): ShareGPT-like (161 prompt / 338 output tokens) and Alpaca-like (19 / 58).
"""

import numpy as np

from docs.figures._figure import COLORS, plt, save
from jax_engine.bench.workloads import request_lengths
from reference.tutorial.kv_memory import paged_usage

block_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
fig, ax = plt.subplots(figsize=(7.0, 3.2))
for mode, colour in (("sharegpt-like", COLORS["used"]), ("alpaca-like", COLORS["accent"])):
    prompts, outputs, _ = request_lengths(400, mode, max_model_len=2048, seed=0)
    trace = list(zip(prompts.tolist(), outputs.tolist()))
    waste = np.array([1 - paged_usage(trace, bs).utilization for bs in block_sizes]) * 100
    ax.plot(block_sizes, waste, "o-", color=colour, label=f"{mode} (mean {np.mean(prompts):.0f} + "
            f"{np.mean(outputs):.0f} tokens)")
    for bs, w in zip(block_sizes, waste):
        if bs in (16, 256):
            ax.annotate(f"{w:.1f}%", (bs, w), textcoords="offset points", xytext=(-6, 6), ha="right", fontsize=9,
                        color=colour)
ax.axvline(16, color="#999999", linewidth=0.8, linestyle=":")
ax.text(16, ax.get_ylim()[1] * 0.97, " vLLM's default", fontsize=9, va="top", color="#555555")
ax.set_xscale("log", base=2)
ax.set_xticks(block_sizes, [str(b) for b in block_sizes])
ax.set_xlabel("block size (tokens)")
ax.set_ylabel("KV cache wasted (%)")
ax.set_title("Paging wastes at most the tail of each last block", fontsize=10)
ax.grid(alpha=0.3, linewidth=0.5)
ax.legend(fontsize=9, frameon=False, loc="upper left")
fig.tight_layout()
save(fig, "fragmentation_block_size")
