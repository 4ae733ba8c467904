"""LoRA adapters in PEFT's format: a directory with adapter_config.json and adapter_model.safetensors.

PEFT names each tensor after the module it adapts, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ([r, in]) and `...q_proj.lora_B.weight`
([out, r]); the config gives the rank r, lora_alpha, use_rslora and target_modules. Every check a bad adapter can
fail happens here, at load time, with the field and the limit named: nothing half-loaded reaches an engine.
"""

import json
import math
import os
import re
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from jax_engine.loader.safetensors_file import SafetensorsWeights
from reference.lora import LoRAAdapter

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
TENSOR_NAME = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight")


def _config(path: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path!r}: no {CONFIG_FILE} (a PEFT adapter directory has one)")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type is {config['peft_type']!r}, not 'LORA'")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), int | float) or config[key] <= 0:
            raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} needs a positive {key!r}, got {config.get(key)!r}")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {path!r}: fan_in_fan_out adapters (GPT-2's Conv1D) are not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias={config['bias']!r} trains biases too; only 'none' is supported")
    if config.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {path!r}: modules_to_save {config['modules_to_save']} replaces whole modules; "
                         "not supported")
    return config


def module_shapes(weights: Mapping[str, np.ndarray]) -> dict[str, tuple[int, int]]:
    """(out, in) of every matrix of a checkpoint's HF-named weights, by module name: what an adapter may adapt."""
    return {name.removesuffix(".weight"): w.shape for name, w in weights.items()
            if name.endswith(".weight") and np.ndim(w) == 2}


def load_lora_adapter(path: str, base_shapes: Mapping[str, tuple[int, int]], name: str | None = None,
                      max_lora_rank: int | None = None, dtype: str = "float32") -> LoRAAdapter:
    """The adapter in the PEFT directory `path`, checked against `base_shapes`: (out, in) of each module an adapter
    may change in the base model, by full HF module name (module_shapes, or the engine's LoRALayout.module_shapes).

    Raises ValueError naming the field: a missing file, rank above max_lora_rank, a module the base model does not
    have, shapes that do not match the base weights (an adapter trained for another model), or a value that is
    not finite in `dtype`, the engine's slots' (a fine-tune that diverged: in a batch, such a value would turn
    other requests' rows into NaN; jax_engine/models/lora.py).
    """
    config = _config(path)
    rank = int(config["r"])
    if max_lora_rank is not None and rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {path!r}: rank r={rank} is above max_lora_rank={max_lora_rank}")
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise ValueError(f"LoRA adapter {path!r}: no {WEIGHTS_FILE} (adapters are read from safetensors only)")
    tensors = SafetensorsWeights([weights_path])
    names_a, names_b = {}, {}  # module -> tensor name
    for tensor_name in tensors:
        match = TENSOR_NAME.fullmatch(tensor_name.removeprefix(PREFIX))
        if match is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {tensor_name!r} is not a lora_A or lora_B weight")
        (names_a if match["which"] == "A" else names_b)[match["module"]] = tensor_name
    if not names_a or names_a.keys() != names_b.keys():
        raise ValueError(f"LoRA adapter {path!r}: lora_A and lora_B must come in pairs, one pair a module; got A for "
                         f"{sorted(names_a)[:4]}, B for {sorted(names_b)[:4]}")
    # Every shape is checked from the header before any tensor is read: a file of other shapes costs no memory.
    for module in names_a:
        _check_shapes(path, module, tensors.shape(names_a[module]), tensors.shape(names_b[module]), rank, base_shapes)
    lora_a = {module: tensors[name] for module, name in names_a.items()}
    lora_b = {module: tensors[name] for module, name in names_b.items()}
    alpha = float(config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    largest = float(ml_dtypes.finfo(dtype).max)
    for module in names_a:
        _check_finite(path, names_a[module], lora_a[module], 1.0, largest, dtype)
        _check_finite(path, names_b[module], lora_b[module], scaling, largest, dtype)  # slots hold B x scaling
    return LoRAAdapter(name or os.path.basename(os.path.normpath(path)), rank, scaling, lora_a, lora_b)


def _check_shapes(path: str, module: str, a: tuple[int, ...], b: tuple[int, ...], rank: int,
                  base_shapes: Mapping[str, tuple[int, int]]) -> None:
    if module not in base_shapes:
        kinds = sorted({m.rsplit(".", 1)[-1] for m in base_shapes})
        raise ValueError(f"LoRA adapter {path!r}: target module {module!r} is not in the base model, or not one an "
                         f"adapter may change there (those are {kinds})")
    out_features, in_features = base_shapes[module]
    if a != (rank, in_features) or b != (out_features, rank):
        raise ValueError(f"LoRA adapter {path!r}: {module} has lora_A {a} and lora_B {b}, but the base "
                         f"model's {module} is [{out_features}, {in_features}] at rank r={rank}: an adapter for "
                         "another model?")


def _check_finite(path: str, name: str, tensor: np.ndarray, scale: float, largest: float, dtype: str) -> None:
    """ValueError unless every value of `tensor` times `scale` is at most `largest` in magnitude (NaN is not)."""
    peak = float(np.abs(tensor).max(initial=0.0)) * scale  # NaN if the tensor holds one
    if not peak <= largest:
        scaled = f" after lora_alpha scaling x{scale:g}" if scale != 1 else ""
        raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} holds values that are not finite in {dtype} "
                         f"(largest magnitude {peak:g}{scaled}, the most {dtype} holds is {largest:g}): a "
                         "fine-tune that diverged?")
