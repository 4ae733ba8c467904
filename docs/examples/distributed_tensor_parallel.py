"""Megatron-style tensor parallelism of one Llama layer over 3 "devices", in NumPy."""

import numpy as np

from reference import AttentionMetadata, paged_attention, write_kv
from reference.llama import silu

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 72, 9, 3, 8, 96  # SmolLM2's heads, shrunk
DEVICES = 3  # one KV head per device, with the 3 query heads that read it
SHAPES = {"q": (HEADS * HEAD_DIM, HIDDEN), "k": (KV_HEADS * HEAD_DIM, HIDDEN),
          "v": (KV_HEADS * HEAD_DIM, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM),
          "gate": (MLP, HIDDEN), "up": (MLP, HIDDEN), "down": (HIDDEN, MLP)}  # out, in
rng = np.random.default_rng(0)
w = {name: rng.normal(0, 0.2, shape) for name, shape in SHAPES.items()}
x = rng.normal(size=(5, HIDDEN))  # [T, hidden]: a 5-token prompt, on every device
# One block table, whatever the device: the sequence's blocks are 3 and 1.
md = AttentionMetadata(slot_mapping=np.array([12, 13, 14, 15, 4]),
                       query_start_loc=np.array([0, 5]), seq_lens=np.array([5]),
                       block_tables=[[3, 1]])


def attention(x, wq, wk, wv, wo):
    """Project, write K/V into this device's paged cache, attend, project out."""
    heads, kv_heads = len(wq) // HEAD_DIM, len(wk) // HEAD_DIM
    cache = np.zeros((2, 4, 4, kv_heads, HEAD_DIM))  # [K/V, blocks, block_size, K, D]
    q = (x @ wq.T).reshape(len(x), heads, HEAD_DIM)
    k = (x @ wk.T).reshape(len(x), kv_heads, HEAD_DIM)
    v = (x @ wv.T).reshape(len(x), kv_heads, HEAD_DIM)
    write_kv(cache[0], cache[1], k, v, md.slot_mapping)
    out = paged_attention(q, cache[0], cache[1], md, HEAD_DIM**-0.5)
    return out.reshape(len(x), -1) @ wo.T, cache


def mlp(x, gate, up, down):
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


full_attention, full_cache = attention(x, w["q"], w["k"], w["v"], w["o"])
full_mlp = mlp(x, w["gate"], w["up"], w["down"])

print("device  q_proj    k/v_proj  o_proj    gate/up   down      KV cache")
partial_attention, partial_mlp = [], []
for d in range(DEVICES):
    per = HEADS // DEVICES * HEAD_DIM  # rows of this device's 3 query heads
    heads = slice(d * per, (d + 1) * per)
    kv = slice(d * KV_HEADS // DEVICES, (d + 1) * KV_HEADS // DEVICES)  # its KV heads
    kv_rows = slice(kv.start * HEAD_DIM, kv.stop * HEAD_DIM)
    ffn = slice(d * MLP // DEVICES, (d + 1) * MLP // DEVICES)
    # Column-parallel q/k/v and gate/up: this device's output features (rows) only.
    # Row-parallel o and down: the matching input columns, giving a partial sum.
    shards = [w["q"][heads], w["k"][kv_rows], w["o"][:, heads], w["gate"][ffn],
              w["down"][:, ffn]]  # the shapes each device holds
    out, cache = attention(x, w["q"][heads], w["k"][kv_rows], w["v"][kv_rows],
                           w["o"][:, heads])
    partial_attention.append(out)
    partial_mlp.append(mlp(x, w["gate"][ffn], w["up"][ffn], w["down"][:, ffn]))
    shapes = "".join(f"{str(s.shape):<10}" for s in shards)
    print(f"{d:<8}{shapes}{cache.shape[1:]}")
    assert np.allclose(cache, full_cache[:, :, :, kv])  # its KV heads of every block

# The layer's two all-reduces: every device ends with the sum of the partials.
for name, partials, full in (("attention", partial_attention, full_attention),
                             ("the MLP", partial_mlp, full_mlp)):
    diff = np.abs(sum(partials) - full).max()
    assert diff < 1e-12
    print(f"all-reduce after {name}: {len(partials)} partials {partials[0].shape} "
          "sum to the unsplit result (< 1e-12)")
