"""What LoRA slots take from the KV cache: the tokens of K and V that max_loras slots of each rank would hold
instead, for the default model in float32.

From the engine's own arithmetic: a slot's bytes are LoRALayout.slot_bytes (every adaptable projection's A and
B at the slot's rank), a token's K and V are kv_cache_plan.bytes_per_block for one token; on a GPU, plan_kv_cache takes
the slots out of the KV cache's share exactly so.
"""

import numpy as np

from docs.figures._figure import COLORS, plt, save
from jax_engine.kv_cache_plan import bytes_per_block
from jax_engine.loader import load_checkpoint
from jax_engine.lora.layout import LoRALayout

checkpoint = load_checkpoint()  # the default model, SmolLM2-135M
cfg = checkpoint.config
token_bytes = bytes_per_block(cfg, 1, "float32")
max_loras = np.arange(1, 17)
ranks = {8: COLORS["shared"], 16: COLORS["used"], 32: COLORS["reserved"], 64: COLORS["internal"]}

fig, ax = plt.subplots(figsize=(6.4, 3.6))
for rank, color in ranks.items():
    slot = LoRALayout.of(cfg, checkpoint.weights, max_loras=1, max_rank=rank).slot_bytes("float32")
    tokens = max_loras * slot / token_bytes
    ax.plot(max_loras, tokens, "o-", color=color, markersize=3)
    ax.annotate(f"rank {rank}: {slot / 2**20:.0f} MiB a slot", (max_loras[-1], tokens[-1]), xytext=(6, 0),
                textcoords="offset points", va="center", fontsize=9, color=color)
ax.set_xlabel("max_loras (adapter slots on the device)")
ax.set_ylabel("KV-cache tokens given up")
ax.set_title(f"{cfg.num_layers} layers, {token_bytes / 1024:.0f} KiB of K and V a token", fontsize=10)
ax.set_xticks([1, 4, 8, 12, 16])
ax.grid(alpha=0.3, linewidth=0.5)
fig.tight_layout()
save(fig, "lora_memory")
