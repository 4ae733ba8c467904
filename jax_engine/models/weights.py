"""From a checkpoint's HF-named tensors to the model's stacked weights, the same way for every family.

A family names where each of its weights comes from (a `Source`): one HF tensor, several whose rows are
concatenated (q, k and v fused into one projection), or a function of several (a fused QKV tensor whose
heads are interleaved, GPT-2's transposed Conv1D matrices). Layer weights are read for every layer and
stacked along a leading L axis, which the model's scan walks.

Matrices (names starting with "w_", the embedding and the LM head) are stored as `quantization` says
(see linear/quantization.py); a GGUF file's raw blocks are kept where a weight is its tensors' rows alone,
and `block_formats` names each kept weight's format per layer.
"""

import mmap
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import jax
import numpy as np

from jax_engine.linear.quantization import quantize
from jax_engine.linear.gguf_format import BlockRows, as_q8_0


@dataclass(frozen=True)
class Source:
    """Where one weight comes from: HF tensor names (relative to the layer's prefix for layer weights).

    combine: None concatenates the tensors' rows (a single name: the tensor as it is), which works on a GGUF
        file's raw blocks too; else a function of the float32 tensors that returns the weight.
    optional: the checkpoint may lack it (biases some configs enable); the weight is then absent.
    alternatives: `names` are other names of one tensor (layouts of one family differ): the first present.
    """

    names: tuple[str, ...]
    combine: Callable[..., np.ndarray] | None = None
    optional: bool = False
    alternatives: bool = False

    def resolve(self, present: Callable[[str], bool]) -> "Source | None":
        """The source to read, given which names the checkpoint has; None for a missing optional weight."""
        if self.alternatives:
            found = [n for n in self.names if present(n)]
            if not found and not self.optional:
                raise KeyError(f"the checkpoint has none of {list(self.names)}")
            return Source(found[:1], self.combine) if found else None
        return None if self.optional and not present(self.names[0]) else self


def hf(*names: str, optional: bool = False) -> Source:
    """The tensor `names[0]`, or the rows of several concatenated (fused projections)."""
    return Source(names, optional=optional)


def derived(combine: Callable[..., np.ndarray], *names: str, optional: bool = False) -> Source:
    return Source(names, combine, optional)


def first_of(*names: str, optional: bool = False) -> Source:
    """The first of `names` the checkpoint has."""
    return Source(names, optional=optional, alternatives=True)


def tensor_shape(weights: Mapping[str, np.ndarray], name: str) -> tuple[int, ...]:
    """A checkpoint tensor's shape, without reading it where the mapping can tell (SafetensorsWeights, GGUFWeights,
    which read or dequantize a tensor only when asked for it)."""
    return tuple(weights.shape(name)) if hasattr(weights, "shape") else weights[name].shape


@dataclass(frozen=True)
class WeightMap:
    """A family's weights: per-layer sources under `layer_prefix` ("model.layers.{i}."), and the others."""

    layer_prefix: str
    layer: dict[str, Source]
    top: dict[str, Source]


class StoredWeights:
    """Reads a WeightMap out of a checkpoint's tensors, in the engine's dtype and quantization."""

    def __init__(self, weights: Mapping[str, np.ndarray], blocks: Mapping[str, BlockRows],
                 quantization: str | None, dtype) -> None:
        self.weights, self.blocks, self.quantization, self.dtype = weights, blocks, quantization, dtype
        self.block_formats: dict[str, tuple[str, ...]] = {}  # kept GGUF blocks: our name -> each layer's format

    def layers(self, spec: WeightMap, num_layers: int) -> dict[str, jax.Array]:
        """Our name -> [L, ...] stack (and <name>_scale for int8 matrices)."""
        stacked = {}
        prefixes = [spec.layer_prefix.format(i=i) for i in range(num_layers)]
        for name, source in spec.layer.items():
            source = source.resolve(lambda n: prefixes[0] + n in self.weights)
            if source is not None:
                stacked |= self._store(name, source, prefixes)
        return stacked

    def top(self, spec: WeightMap) -> dict[str, jax.Array]:
        """The weights outside the layers, by our name (embed, final_norm, lm_head, ...)."""
        stored = {}
        for name, source in spec.top.items():
            source = source.resolve(lambda n: n in self.weights)
            if source is not None:
                stored |= self._store(name, source, [""], stack=False)
        return stored

    def _store(self, name: str, source: Source, prefixes: list[str], stack: bool = True) -> dict[str, jax.Array]:
        matrix = name.startswith("w_") or name in ("embed", "lm_head")
        kept = self._kept_blocks(source, prefixes) if matrix else None
        if kept is not None:  # a stack of layers in several formats pads the narrower rows (gguf_format.py)
            self.block_formats[name] = tuple(layer.format for layer in kept)
            width = max(layer.rows.shape[1] for layer in kept)
            rows = ({name: np.pad(r, ((0, 0), (0, width - r.shape[1]))) if r.shape[1] < width else r}
                    for r in (layer.rows for layer in kept))
            return stacked_on_device(rows, len(prefixes), stack)
        arrays = read_ahead(lambda prefix: self._read(source, prefix), prefixes)
        if not matrix:
            return stacked_on_device(({name: np.asarray(a, self.dtype)} for a in arrays), len(prefixes), stack)
        # Layer by layer (each row is quantized alone), each written into the stack in the stored format.
        stored = (quantize(array, self.quantization, self.dtype) for array in arrays)
        layers = ({name: weight} | ({} if scale is None else {f"{name}_scale": scale}) for weight, scale in stored)
        return stacked_on_device(layers, len(prefixes), stack)

    def _read(self, source: Source, prefix: str) -> np.ndarray:
        missing = [prefix + n for n in source.names if prefix + n not in self.weights]
        if missing:
            untied = " (config.json sets tie_word_embeddings=false)" if missing == ["lm_head.weight"] else ""
            raise ValueError(f"the checkpoint has no {missing[0]!r}{untied}")
        tensors = [self.weights[prefix + n] for n in source.names]
        if source.combine is not None:
            return source.combine(*tensors)
        return tensors[0] if len(tensors) == 1 else np.concatenate(tensors)

    def _kept_blocks(self, source: Source, prefixes: list[str]) -> list[BlockRows] | None:
        """quantization="gguf": each layer's matrix as the file's raw block rows, where every tensor has them."""
        if self.quantization != "gguf" or source.combine is not None:
            return None
        names = [[p + n for n in source.names] for p in prefixes]
        if not all(n in self.blocks for row in names for n in row):
            return None
        layers = [self._fused([self.blocks[n] for n in row], tensor_shape(self.weights, row[0])[1]) for row in names]
        if any(layer is None for layer in layers) or len({len(layer.rows) for layer in layers}) != 1:
            return None
        return layers

    @staticmethod
    def _fused(parts: list[BlockRows], in_features: int) -> BlockRows | None:
        """A layer's tensors' rows as one matrix in one format: theirs, or where they differ Q8_0 (exactly, from
        Q4_0 and Q5_0: Gemma 3's q, k and v); None where no format holds them all (Q4_1 or a K-quant beside
        another format)."""
        if len({part.format for part in parts}) > 1:
            try:
                parts = [BlockRows("q8_0", as_q8_0(part.rows, part.format, in_features)) for part in parts]
            except ValueError:
                return None
        rows = np.concatenate([part.rows for part in parts]) if len(parts) > 1 else parts[0].rows
        return BlockRows(parts[0].format, rows)


def read_ahead(read: Callable[[str], np.ndarray], prefixes: list[str]) -> Iterator[np.ndarray]:
    """read(prefix) for each prefix in order, the next one read on a thread while the caller uses this one:
    a layer's dequantization (NumPy, which lets go of the GIL) overlaps the previous layer's cast and copy into
    the stack, on the core the server process is done with by then (0.5 s -> 0.38 s for the default model in
    bf16 or int8)."""
    with ThreadPoolExecutor(1) as reader:
        pending = reader.submit(read, prefixes[0])
        for following in prefixes[1:]:
            current, pending = pending.result(), reader.submit(read, following)
            yield current
        yield pending.result()


def stacked_on_device(layers: Iterator[dict[str, np.ndarray]], count: int, stack: bool = True) -> dict[str, jax.Array]:
    """`count` layers' arrays (by name) as one [count, ...] device array per name, or the one layer's arrays as
    they are (`stack` False).

    Each layer's array is copied into its slot as it is read, so one layer is alive at a time, and the stack is
    page-aligned, which the CPU backend takes without copying it (jax.device_put aliases aligned host memory;
    a tensor-parallel mesh then splits it). np.stack of every layer and jnp.asarray's copy were 0.4 s of the
    default model's bf16 start-up."""
    stacks = {}
    for i, arrays in enumerate(layers):
        for name, array in arrays.items():
            if name not in stacks:
                stacks[name] = mapped_empty((count,) + array.shape, array.dtype)
            stacks[name][i] = array
    return {name: jax.device_put(array if stack else array[0]) for name, array in stacks.items()}


def mapped_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed array in anonymous memory pages of its own, written on first touch: page-aligned (the CPU
    backend aliases 64-byte aligned memory, and NumPy's own arrays start at 16 bytes), and faulted in 4 KiB
    pages. NumPy asks for transparent huge pages for its large arrays, and on this machine kind their faults
    stall on compaction, up to 0.8 s per 400 MB: the default model's float32 weights took 0.75-1.33 s to stack
    into NumPy's memory, 0.6 s into these pages."""
    count = int(np.prod(shape))
    memory = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1))
    return np.frombuffer(memory, dtype, count).reshape(shape)


def ungroup_qkv(w: np.ndarray, num_kv_heads: int, head_dim: int) -> np.ndarray:
    """A fused QKV matrix (or bias) whose rows come per KV group -> all q rows, then all k, then all v.

        per group g: [ q heads of g (G x D rows) | k head g (D) | v head g (D) ]    (G = queries per KV head)

    GPT-NeoX, BLOOM and GPT-BigCode without MQA store one group per head (G = 1); Falcon's new decoder layout
    one per KV head. Query head j of group g becomes head g * G + j, which is the KV head it uses (GQA).
    """
    rest = w.shape[1:]
    groups = w.reshape(num_kv_heads, -1, head_dim, *rest)  # [K, G + 2, D, ...]
    q, k, v = groups[:, :-2], groups[:, -2], groups[:, -1]
    return np.concatenate([part.reshape(-1, *rest) for part in (q, k, v)])
