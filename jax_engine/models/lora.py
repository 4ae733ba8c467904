"""Each row's adapter update inside the jitted step: a shrink to r numbers, then an expand, per row's own slot.

Punica's BGMV kernel gathers each row's A and B on a GPU without copying them. In XLA a gather copies them, row
by row ([T, out, r] for B: more bytes than the weights themselves at a decode batch of 32), so XLA's form here
is a mask: every row is shrunk against every slot's A at once (S x r numbers a row), the numbers of the slots
that are not the row's own are set to zero, and the expand contracts over slots and rank together. Two plain
matmuls a piece, each slot's weights read once a step, and a row without an adapter (an all-zero mask) gets
exactly zero; but every row pays for every slot. Steps of up to KERNEL_ROWS rows on a CPU take a C++ kernel
instead (jax_engine/linear/lora_bgmv.py), which does what BGMV does: each row reads its own slot's A and B in
place, so a batch over four adapters does a quarter of the masked work, and batch 1 reads one adapter, not S.

    xa[t, s, p, :] = x[t] @ A[s, p].T if slot[t] == s else 0     shrink, all pieces p of a fused projection
    y[t, rows_p]  += sum over s of xa[t, s, p, :] @ B[s, :, rows_p]  expand, each piece into its own rows

A is stored [S, pieces, r, in] (a row of A per rank, like the base weights' [out, in]) and B [S, r, out] (a
row of B per rank: the kernel sweeps each row across the output features).

The slot of each token comes from the model runner (-1: no adapter); which adapter sits in which slot is the
LoRAManager's business (jax_engine/lora/manager.py). Loading another adapter rewrites a slot's arrays, never a
shape: no step is compiled again.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jax_engine.linear.lora_bgmv import lora_bgmv, uses_lora_kernel


@dataclass(frozen=True)
class LoRABatch:
    """What a step's projections need to add each row's update: the rows' slots (and as a mask), and where each
    projection's pieces sit in its output (static, from the model's LoRALayout)."""

    token_slots: jax.Array  # [T] each token's slot; -1 for a token without an adapter
    slot_mask: jax.Array  # [T, S] 1 at the token's slot; all 0 for a token without an adapter
    rows: dict[str, tuple[tuple[int, int], ...]]  # projection -> each piece's output rows

    @classmethod
    def of(cls, token_slots: jax.Array, num_slots: int, rows: dict, dtype) -> "LoRABatch":
        return cls(token_slots, jax.nn.one_hot(token_slots, num_slots, dtype=dtype), rows)

    def delta(self, projection: str, x: jax.Array, a: jax.Array, b: jax.Array, layer: jax.Array) -> jax.Array:
        """x [T, in]; a [L, S, pieces, r, in] and b [L, S, r, out], the whole stacks -> the update [T, out].

        Few rows on a CPU (decode batches) take the C++ kernel, which reads each row's own slot in place."""
        x = x.astype(a.dtype)
        if uses_lora_kernel(x.shape[0], a):
            starts = [start for start, _ in self.rows[projection]] + [b.shape[-1]]
            return lora_bgmv(x, a, b, self.token_slots, layer, starts)
        return self._masked(projection, x, a[layer], b[layer])

    # --8<-- [start:delta]
    def _masked(self, name: str, x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        """x [T, in], a [S, pieces, r, in], b [S, r, out] (one layer's) -> [T, out]."""
        S, P, r, width = a.shape
        xa = x @ a.reshape(S * P * r, width).T  # shrink: every slot and piece at once
        # own slot only, selected: another slot's numbers may be inf (a large A),
        # and a mask multiplied in would make 0 x inf = NaN in every row
        own = self.slot_mask[:, :, None, None] != 0
        xa = jnp.where(own, xa.reshape(-1, S, P, r), 0)
        pieces = [xa[:, :, p].reshape(-1, S * r) @ b[:, :, first:end].reshape(S * r, -1)
                  for p, (first, end) in enumerate(self.rows[name])]  # expand
        return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)
    # --8<-- [end:delta]
