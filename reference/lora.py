"""LoRA: a fine-tune kept as low-rank updates beside the base weights (Hu et al., 2021).

An adapter changes a projection W [out, in] into W + s * B @ A, with A [r, in] and
B [out, r] for a small rank r (8 or 16 where `in` is thousands), scaled by s = alpha / r
(or alpha / sqrt(r) with rsLoRA). W is never changed: per token x the update is computed
beside it,

    y = x @ W.T  +  s * (x @ A.T) @ B.T     a "shrink" to r numbers, then an "expand"

So many adapters can share one copy of the base model, and one batch can mix them: each
row takes its own A and B (Punica's and S-LoRA's gathered shrink and expand), and a row
without an adapter takes none.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)  # hashed by identity: one adapter, one object
class LoRAAdapter:
    """One adapter: for each projection it changes (its HF module name, such as
    "model.layers.0.self_attn.q_proj"), A [rank, in] and B [out, rank]."""

    name: str
    rank: int
    scaling: float
    lora_a: dict[str, np.ndarray]
    lora_b: dict[str, np.ndarray]

    def delta(self, module: str, x: np.ndarray) -> np.ndarray | None:
        """The update to `module`'s output for the rows x [T, in]; None if none."""
        if module not in self.lora_a:
            return None
        return (x @ self.lora_a[module].T) @ self.lora_b[module].T * self.scaling


def lora_delta(x: np.ndarray, module: str, row_adapters: list | None):
    """What each row's adapter adds to `module`'s output, [T, out] (0.0 if no row has an
    update): the rows grouped by adapter, each group multiplied by its own A and B."""
    if row_adapters is None:
        return 0.0
    out = 0.0
    for adapter in {a for a in row_adapters if a is not None}:
        rows = np.array([a is adapter for a in row_adapters])
        delta = adapter.delta(module, x[rows])
        if delta is not None:
            if not isinstance(out, np.ndarray):
                out = np.zeros((len(x), delta.shape[1]), x.dtype)
            out[rows] = delta
    return out
