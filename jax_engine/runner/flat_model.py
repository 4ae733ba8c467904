"""The model as the device programs take it: its arrays in a tuple, and the tree that rebuilds the module.

A Flax NNX module flattens in Python, node by node, on every call of a program that takes it: on a 2-core Zen 4,
Gemma 3 270M's step took 0.41-0.45 ms to launch with the module and 0.32-0.43 with its arrays (in turns), and in
the engine the step's and the logits' launches went from 0.51 and 0.26 ms to 0.34 and 0.13 (medians of 512
batch-1 steps), of a ~19 ms token. A registered dataclass of a tuple flattens in JAX's C++; the program
rebuilds the module while it traces, at no cost when it runs.
"""

import functools
from dataclasses import dataclass
from typing import Any

import jax


@functools.partial(jax.tree_util.register_dataclass, data_fields=("arrays",), meta_fields=("treedef",))
@dataclass(frozen=True)
class FlatModel:
    arrays: tuple
    treedef: Any  # jax's PyTreeDef of the module

    @classmethod
    def of(cls, model) -> "FlatModel":
        arrays, treedef = jax.tree.flatten(model)
        return cls(tuple(arrays), treedef)

    def module(self):
        return jax.tree.unflatten(self.treedef, self.arrays)


class FlattenedModel:
    """FlatModel.of(model), flattened again only when `version` changes: writing an adapter's slot replaces
    arrays of the module (LoRAManager.writes counts those writes)."""

    def __init__(self, model) -> None:
        self.model = model
        self._version: int | None = None
        self._flat: FlatModel | None = None

    def at(self, version: int) -> FlatModel:
        if version != self._version:
            self._flat, self._version = FlatModel.of(self.model), version
        return self._flat
