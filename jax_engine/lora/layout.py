"""Where an adapter's A and B go in the engine's fused projections, and the device stacks that hold them.

The engine fuses projections that read the same input (w_qkv holds q, k and v; w_gate_up holds gate and up),
while PEFT adapts each HF module on its own. Each fused projection therefore gets one stack of A matrices with
a piece per module, and one B stack whose columns line up with the projection's output features:

    lora_a_qkv [L, S, 3, r, H]          the q, k and v pieces' A              (S slots, r = max_lora_rank)
    lora_b_qkv [L, S, r, (N + 2K) D]    B of q in q's columns, k's in k's, v's in v's, scaled by the adapter's s

A shrink x @ A reads the input once for all pieces; each piece's expand writes its own output features, so the
update is added to the fused output exactly where HF's module would have added it. An adapter that leaves a module alone
(q and v only, say) holds zeros in that module's piece. Ranks below r are zero-padded: the padding adds nothing.

Only projections whose weight is its HF tensors' rows as they are (`hf(...)` sources) can be adapted: Llama,
Mistral, Qwen, Gemma, Phi-3, GPT-J, OPT, MPT, and the MLPs of BLOOM, Falcon and GPT-NeoX. A fused QKV whose
heads the loader reorders (BLOOM, Falcon, GPT-NeoX, GPT-2) is left out: an adapter naming it is refused.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from jax_engine.model_config import ModelConfig
from jax_engine.models.registry import architecture
from jax_engine.models.weights import tensor_shape
from reference.lora import LoRAAdapter

WEIGHT = ".weight"


@dataclass(frozen=True)
class LoRATarget:
    """One of the engine's projections that adapters may change."""

    projection: str  # our name without "w_": "qkv", "o", "gate_up", "down", "up"
    modules: tuple[str, ...]  # the HF modules fused in it, relative to the layer ("self_attn.q_proj", ...)
    rows: tuple[tuple[int, int], ...]  # each module's output rows in the projection, [start, stop)
    in_features: int

    @property
    def out_features(self) -> int:
        return self.rows[-1][1]


@dataclass(frozen=True)
class LoRALayout:
    """Every adaptable projection of a model, and the slot stacks sized for `max_loras` adapters of rank
    up to `max_rank`."""

    layer_prefix: str  # "model.layers.{i}."
    num_layers: int
    targets: tuple[LoRATarget, ...]
    max_loras: int
    max_rank: int

    @classmethod
    def of(cls, cfg: ModelConfig, weights: Mapping[str, np.ndarray], max_loras: int, max_rank: int) -> "LoRALayout":
        """The layout of the model whose HF-named `weights` (layer 0's are read for their shapes) are these."""
        spec = architecture(cfg.architecture).weights(cfg)
        first = spec.layer_prefix.format(i=0)
        targets = []
        for name, source in spec.layer.items():
            plain = source.combine is None and not source.alternatives
            if not (name.startswith("w_") and plain and first + source.names[0] in weights):
                continue
            shapes = [tensor_shape(weights, first + n) for n in source.names]
            stops = np.cumsum([out for out, _ in shapes])
            targets.append(LoRATarget(name.removeprefix("w_"), tuple(n.removesuffix(WEIGHT) for n in source.names),
                                      tuple(zip([0, *stops[:-1].tolist()], stops.tolist())), shapes[0][1]))
        return cls(spec.layer_prefix, cfg.num_layers, tuple(targets), max_loras, max_rank)

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of every module an adapter may name, by its full HF name: what adapters are checked against."""
        shapes = {}
        for i in range(self.num_layers):
            for t in self.targets:
                for module, (start, stop) in zip(t.modules, t.rows):
                    shapes[self.layer_prefix.format(i=i) + module] = (stop - start, t.in_features)
        return shapes

    def stack_shapes(self) -> dict[str, tuple[int, ...]]:
        """The device stacks by name: lora_a_<projection> [L, S, pieces, r, in], lora_b_<projection> [L, S, r, out]."""
        L, S, r = self.num_layers, self.max_loras, self.max_rank
        shapes = {}
        for t in self.targets:
            shapes[f"lora_a_{t.projection}"] = (L, S, len(t.modules), r, t.in_features)
            shapes[f"lora_b_{t.projection}"] = (L, S, r, t.out_features)
        return shapes

    def slot_arrays(self, adapter: LoRAAdapter | None, dtype) -> dict[str, np.ndarray]:
        """One slot's share of every stack ([L, pieces, r, in] and [L, r, out]) holding `adapter`, its scaling
        folded into B (as vLLM does); zeros for None (an empty slot)."""
        arrays = {name: np.zeros(shape[:1] + shape[2:], dtype) for name, shape in self.stack_shapes().items()}
        if adapter is None:
            return arrays
        for i in range(self.num_layers):
            for t in self.targets:
                for piece, (module, (start, stop)) in enumerate(zip(t.modules, t.rows)):
                    full = self.layer_prefix.format(i=i) + module
                    if full in adapter.lora_a:
                        arrays[f"lora_a_{t.projection}"][i, piece, : adapter.rank] = adapter.lora_a[full]
                        arrays[f"lora_b_{t.projection}"][i, : adapter.rank, start:stop] = (
                            adapter.lora_b[full].T * adapter.scaling)
        return arrays

    def slot_bytes(self, dtype) -> int:
        """Device memory of one slot: what each of max_loras adapters takes from the KV cache's budget."""
        return sum(int(np.prod(shape)) // self.max_loras for shape in self.stack_shapes().values()) * \
            np.dtype(dtype).itemsize
