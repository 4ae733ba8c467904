"""The Pallas kernels, in the Pallas interpreter on CPU, against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxprs_in_params

from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from reference import AttentionMetadata, paged_attention

BLOCK_SIZE, KV_HEADS, GROUP, HEAD_DIM = 8, 2, 3, 16  # 6 query heads share 2 KV heads
seq_lens = [5, 19, 33]  # context of each sequence, this step's tokens included
rng = np.random.default_rng(0)
shape = (1, 16, BLOCK_SIZE, KV_HEADS, HEAD_DIM)  # [layers, blocks, block_size, K, D]
k_cache, v_cache = rng.normal(size=shape), rng.normal(size=shape)
# Each sequence's blocks lie anywhere in the cache: 1, 3 and 5 blocks drawn at random.
ids = rng.permutation(16)
tables = np.zeros((3, 5), np.int32)  # [B, max blocks], padded
for i, (first, n) in enumerate([(0, 1), (1, 3), (4, 5)]):
    tables[i, :n] = ids[first:first + n]
print("block tables:", [t[: -(-n // BLOCK_SIZE)].tolist()
                       for t, n in zip(tables, seq_lens)])


def reference(q, q_lens):
    """The oracle: reference.paged_attention over the same cache and tables."""
    starts = np.cumsum([0] + q_lens)
    md = AttentionMetadata(np.zeros(len(q), int), starts, np.array(seq_lens),
                           tables.tolist())
    return paged_attention(q, k_cache[0], v_cache[0], md, HEAD_DIM**-0.5)


def grid_of(fn, *args) -> tuple:
    """The grid of the pallas_call inside a jitted function, read from its jaxpr."""
    def find(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                return eqn.params["grid_mapping"].grid
            for sub in jaxprs_in_params(eqn.params):
                if (grid := find(sub)) is not None:
                    return grid
    return find(jax.make_jaxpr(fn)(*args).jaxpr)


cache = (jnp.asarray(k_cache, jnp.float32), jnp.asarray(v_cache, jnp.float32))
lens = jnp.array(seq_lens, jnp.int32)

# Decode: one query token per sequence, at its last position.
q = rng.normal(size=(3, KV_HEADS * GROUP, HEAD_DIM)).astype(np.float32)  # [B, N, D]
want = reference(q, [1, 1, 1])
print("decode kernel, grid (sequence, KV head, partition):")
for partitions in (1, 2):
    def decode(q):
        return paged_decode_attention(q, *cache, jnp.asarray(tables), lens, 0,
                                      num_partitions=partitions, interpret=True)
    diff = np.abs(np.asarray(decode(jnp.asarray(q))) - want).max()
    assert diff < 1e-5
    print(f"  num_partitions={partitions}: {grid_of(decode, q)}, max |diff| < 1e-5")

# Ragged: a decode, a whole 19-token prompt, the last 4-token chunk of a 33-token one.
q_lens = [1, 19, 4]
q = rng.normal(size=(sum(q_lens), KV_HEADS * GROUP, HEAD_DIM))  # [T, N, D]
q = q.astype(np.float32)
starts = jnp.array(np.cumsum([0] + q_lens), jnp.int32)


def ragged(q):
    return ragged_paged_attention(q, *cache, jnp.asarray(tables), lens, starts, 0,
                                  max_q_len=max(q_lens), interpret=True)


diff = np.abs(np.asarray(ragged(jnp.asarray(q))) - reference(q, q_lens)).max()
assert diff < 1e-5
print(f"ragged kernel, grid (sequence, KV head, query block): {grid_of(ragged, q)}, "
      f"max |diff| < 1e-5")
