"""Each row's adapter update inside the jitted step: a shrink to r numbers, then an expand, per row's own slot.

Punica's BGMV kernel gathers each row's A and B on a GPU without copying them. XLA on a CPU would copy a
gathered B per row ([T, out, r]: more bytes than the weights themselves at a decode batch of 32), so the
gather is written as a mask instead: every row is shrunk against every slot's A at once (S x r numbers a row,
a few percent of the projection's work), the numbers of the slots that are not the row's own are zeroed, and
the expand contracts over slots and rank together. Each slot's weights are read once a step, whatever the
batch, and a row without an adapter (an all-zero mask) gets exactly zero.

    xa[t, s, p, :] = x[t] @ A[s, p].T * (slot[t] == s)          shrink, all pieces p of a fused projection
    y[t, rows_p]  += sum over s of xa[t, s, p, :] @ B[rows_p, s].T   expand, each piece into its own rows

Both are plain matmuls against a weight laid out [out, in] like the base weights: A as [S x pieces x r, in],
each piece's B as [its rows, S x r] (B is stored [out, S, r], so a piece's rows are one contiguous slice).

The slot of each token comes from the model runner (-1: no adapter); which adapter sits in which slot is the
LoRAManager's business (jax_engine/lora/manager.py). Loading another adapter rewrites a slot's arrays, never a
shape: no step is compiled again.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class LoRABatch:
    """What a step's projections need to add each row's update: the rows' slots as a mask, and where each
    projection's pieces sit in its output (static, from the model's LoRALayout)."""

    slot_mask: jax.Array  # [T, S] 1 at the token's slot; all 0 for a token without an adapter
    rows: dict[str, tuple[tuple[int, int], ...]]  # projection -> each piece's output rows

    @classmethod
    def of(cls, token_slots: jax.Array, num_slots: int, rows: dict, dtype) -> "LoRABatch":
        return cls(jax.nn.one_hot(token_slots, num_slots, dtype=dtype), rows)

    # --8<-- [start:delta]
    def delta(self, projection: str, x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        """x [T, in], a [S, pieces, r, in], b [out, S, r] (one layer's) -> the update [T, out]."""
        S, P, r, width = a.shape
        xa = x.astype(a.dtype) @ a.reshape(S * P * r, width).T  # shrink: every slot, every piece at once
        xa = xa.reshape(-1, S, P, r) * self.slot_mask[:, :, None, None]  # only the row's own slot is left
        pieces = [xa[:, :, p].reshape(-1, S * r) @ b[start:stop].reshape(stop - start, S * r).T  # expand
                  for p, (start, stop) in enumerate(self.rows[projection])]
        return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)
    # --8<-- [end:delta]
