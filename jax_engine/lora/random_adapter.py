"""Random LoRA adapters in PEFT's format, written with NumPy (no torch): for benchmarks, examples and tests."""

import json
import pathlib

import numpy as np

from jax_engine.lora.layout import LoRALayout


def write_random_adapter(directory: str | pathlib.Path, layout: LoRALayout, rank: int, seed: int,
                         b_scale: float = 0.01) -> None:
    """A PEFT adapter of `rank` on every module the layout can adapt: A ~ N(0, 1 / in), B ~ N(0, b_scale²) (B is
    random too, unlike PEFT's zeros, so the adapter changes the output), lora_alpha = 2 x rank."""
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    rng = np.random.default_rng(seed)
    tensors = {}
    for module, (out_features, in_features) in layout.module_shapes().items():
        prefix = f"base_model.model.{module}"
        a = rng.standard_normal((rank, in_features)) / np.sqrt(in_features)
        tensors[f"{prefix}.lora_A.weight"] = a.astype(np.float32)
        tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((out_features, rank)) * b_scale).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    modules = sorted({m.rsplit(".", 1)[-1] for m in layout.module_shapes()})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules}
    (directory / "adapter_config.json").write_text(json.dumps(config))
