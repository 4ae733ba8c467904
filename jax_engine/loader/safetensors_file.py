"""Read safetensors checkpoints with NumPy alone: float32, float16 and bfloat16 tensors, one file or shards.

`safetensors.numpy` cannot read bfloat16 (NumPy has no such dtype), and most official releases are bf16.
The format is simple enough to read directly:

    [ 8 bytes: header length n (little-endian u64) | n bytes: JSON header | tensor data ... ]
    header: {"name": {"dtype": "BF16", "shape": [out, in], "data_offsets": [begin, end]}, ...}

A bfloat16 is the top half of a float32, so widening is a 16-bit shift of the raw uint16 values.
Tensors are read lazily from the mapped files: a bf16 model is widened one tensor at a time as the model
is built, never all at once (a 7B bf16 checkpoint would need 28 GB as float32).
"""

import json
import os
from collections.abc import Iterator, Mapping

import numpy as np

_NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
                 "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
INDEX_FILE = "model.safetensors.index.json"


def bfloat16_to_float32(raw: np.ndarray) -> np.ndarray:
    """uint16 bit patterns of bfloat16 values -> the same values as float32 (exact)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


class SafetensorsWeights(Mapping):
    """Name -> float32 array over one or more .safetensors files, each tensor read when it is asked for."""

    def __init__(self, files: list[str]) -> None:
        self._tensors: dict[str, tuple[np.ndarray, str, str]] = {}  # name -> (raw bytes, dtype, file)
        self.dtypes: set[str] = set()
        for path in files:
            for name, (raw, dtype) in _read_tensors(path).items():
                if name in self._tensors:
                    raise ValueError(f"tensor {name!r} is in both {self._tensors[name][2]!r} and {path!r}")
                self._tensors[name] = (raw, dtype, path)
                self.dtypes.add(dtype)

    def __getitem__(self, name: str) -> np.ndarray:
        raw, dtype, _ = self._tensors[name]
        return bfloat16_to_float32(raw) if dtype == "BF16" else raw.astype(np.float32)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from the file's header: nothing read or widened."""
        return self._tensors[name][0].shape

    def __contains__(self, name) -> bool:  # Mapping's own would read and widen the tensor to find it
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def checkpoint_files(directory: str) -> list[str]:
    """The directory's weight files: the shards its index names (each must exist), else every *.safetensors."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index!r} has no weight_map")
        files = [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
        missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index!r} names shards that are missing: {missing}")
        return files
    files = sorted(os.path.join(directory, name) for name in os.listdir(directory) if name.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory!r} has no *.safetensors files")
    return files


def _read_tensors(path: str) -> dict[str, tuple[np.ndarray, str]]:
    """Every tensor of one file as (raw array in the file's dtype, safetensors dtype name), mapped, not read."""
    # A plain ndarray over the mapping: slices of an np.memmap are np.memmap objects, slower to make.
    data = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))
    header_len = int(data[:8].view("<u8")[0])
    header = json.loads(bytes(data[8:8 + header_len]))
    header.pop("__metadata__", None)
    body = 8 + header_len
    tensors = {}
    for name, info in header.items():
        dtype = info["dtype"]
        if dtype not in _NUMPY_DTYPES:
            raise ValueError(f"{path!r}: tensor {name!r} has dtype {dtype}, which this loader cannot read "
                             f"(supported: {sorted(_NUMPY_DTYPES)})")
        begin, end = info["data_offsets"]
        raw = data[body + begin:body + end].view(_NUMPY_DTYPES[dtype])
        tensors[name] = (raw.reshape(info["shape"]), dtype)
    return tensors
