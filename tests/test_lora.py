"""LoRA adapters (issue 46, first part): PEFT's files loaded by jax_engine.loader, and the NumPy oracle's forward
pass with them equal to HF transformers + PEFT; bad adapters refused at load time, naming the field."""

import json
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jax_engine.loader import load_checkpoint
from jax_engine.loader.lora import load_lora_adapter, module_shapes
from reference.kv_cache import KVCache
from reference.llama import LlamaModel
from reference.paged_attention import AttentionMetadata
from tests.tiny_checkpoints import make_tiny_checkpoint

PROMPT = [5, 17, 42, 99, 3, 250, 7, 61, 128]
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(model, directory, seed: int, **lora_config):
    """A random PEFT LoRA adapter for the torch `model` (B random too: PEFT starts it at zero), saved as PEFT
    saves it; returns the PEFT model."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, **{"r": 4, "lora_alpha": 8, "target_modules": ALL_MODULES,
                                                    **lora_config})
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(directory)
    return peft_model.eval()


def write_huge_copy(adapter_dir, directory) -> str:
    """A copy of the adapter with every A value 3e38: finite, so it loads, but any row shrunk by it overflows to
    inf (and its logits to NaN). Returns the copy's directory."""
    import shutil

    shutil.copytree(adapter_dir, directory)
    path = f"{directory}/adapter_model.safetensors"
    save_file({name: np.full_like(t, 3e38) if "lora_A" in name else t for name, t in load_file(path).items()}, path)
    return str(directory)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora-base")
    make_tiny_checkpoint(directory, "llama")
    return directory


def hf_logits(model, tokens: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].numpy()


@pytest.mark.parametrize("lora_config", [{}, {"use_rslora": True, "r": 8, "lora_alpha": 16},
                                         {"target_modules": ["q_proj", "v_proj"], "r": 2}],
                         ids=["all-modules", "rslora", "q-and-v"])
def test_the_oracle_with_an_adapter_equals_peft(base, tmp_path, lora_config):
    from transformers import AutoModelForCausalLM

    peft_model = write_adapter(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter", seed=1,
                               **lora_config)
    checkpoint = load_checkpoint(str(base))
    adapter = load_lora_adapter(str(tmp_path / "adapter"), module_shapes(checkpoint.weights))
    assert adapter.name == "adapter" and adapter.rank == lora_config.get("r", 4)
    model = LlamaModel(checkpoint.config, checkpoint.weights)
    with_adapter = model.last_logits(PROMPT, adapter=adapter)
    np.testing.assert_allclose(with_adapter, hf_logits(peft_model, PROMPT), atol=2e-4, rtol=0)
    with peft_model.disable_adapter():  # the adapter matters, and without it the base model is untouched
        base_logits = hf_logits(peft_model, PROMPT)
    np.testing.assert_allclose(model.last_logits(PROMPT), base_logits, atol=2e-4, rtol=0)
    assert np.abs(with_adapter - base_logits).max() > 1e-2


def test_one_batch_mixes_adapters_row_by_row(base, tmp_path):
    """Two sequences in one forward pass, one with an adapter and one without (then the other way round): each
    row's logits equal its sequence run alone."""
    from transformers import AutoModelForCausalLM

    write_adapter(AutoModelForCausalLM.from_pretrained(base), tmp_path / "a", seed=2)
    checkpoint = load_checkpoint(str(base))
    model = LlamaModel(checkpoint.config, checkpoint.weights)
    adapter = load_lora_adapter(str(tmp_path / "a"), module_shapes(checkpoint.weights))
    first, second = PROMPT, PROMPT[::-1][:6]
    for adapters in ((adapter, None), (None, adapter)):
        cfg = checkpoint.config
        cache = KVCache(cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
        positions = np.concatenate([np.arange(len(first)), np.arange(len(second))])
        slots = np.concatenate([np.arange(len(first)), 16 + np.arange(len(second))])  # block 0, then block 1
        metadata = AttentionMetadata(slots, np.array([0, len(first), len(first) + len(second)]),
                                     np.array([len(first), len(second)]), [[0], [1]])
        rows = [adapters[0]] * len(first) + [adapters[1]] * len(second)
        logits = model.forward(np.array(first + second), positions, cache, metadata,
                               np.array([len(first) - 1, len(first) + len(second) - 1]), rows)
        np.testing.assert_allclose(logits[0], model.last_logits(first, adapter=adapters[0]), atol=1e-5)
        np.testing.assert_allclose(logits[1], model.last_logits(second, adapter=adapters[1]), atol=1e-5)


def test_bad_adapters_are_refused_at_load_naming_the_field(base, tmp_path):
    from transformers import AutoModelForCausalLM

    write_adapter(AutoModelForCausalLM.from_pretrained(base), tmp_path / "good", seed=3, r=8)
    weights = module_shapes(load_checkpoint(str(base)).weights)
    with pytest.raises(ValueError, match=r"rank r=8 is above max_lora_rank=4"):
        load_lora_adapter(str(tmp_path / "good"), weights, max_lora_rank=4)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_lora_adapter(str(tmp_path / "missing"), weights)
    other = tmp_path / "other-base"  # an adapter trained on a wider model of the same family
    write_adapter(make_tiny_checkpoint(other, "llama", hidden_size=96), tmp_path / "other", seed=4)
    with pytest.raises(ValueError, match=r"lora_A \(4, \d+\) and lora_B \(\d+, 4\), but the base.*another model"):
        load_lora_adapter(str(tmp_path / "other"), weights)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "adapter_config.json").write_text((tmp_path / "good" / "adapter_config.json").read_text())
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        load_lora_adapter(str(renamed), weights)
    tensors = load_file(tmp_path / "good" / "adapter_model.safetensors")  # a module the base model lacks
    save_file({name.replace("layers.0.self_attn.q_proj", "layers.0.self_attn.qkv_proj"): tensor
               for name, tensor in tensors.items()}, renamed / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"target module 'model.layers.0.self_attn.qkv_proj' is not in the base"):
        load_lora_adapter(str(renamed), weights)
    config = json.loads((tmp_path / "good" / "adapter_config.json").read_text())
    (renamed / "adapter_config.json").write_text(json.dumps({**config, "r": 0}))
    with pytest.raises(ValueError, match="positive 'r'"):
        load_lora_adapter(str(renamed), weights)
    (renamed / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    with pytest.raises(ValueError, match="modules_to_save"):
        load_lora_adapter(str(renamed), weights)


def test_adapters_with_values_not_finite_in_the_slots_dtype_are_refused(base, tmp_path):
    """A diverged fine-tune's NaN, or a value past the slots' dtype once scaled, is refused at load, naming the
    tensor (in a batch it would reach the other requests' rows); the same file fits float32's range."""
    from transformers import AutoModelForCausalLM

    write_adapter(AutoModelForCausalLM.from_pretrained(base), tmp_path / "a", seed=7)  # r=4, lora_alpha=8
    weights = module_shapes(load_checkpoint(str(base)).weights)
    path = tmp_path / "a" / "adapter_model.safetensors"
    tensors = load_file(path)
    a_name = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    b_name = a_name.replace("lora_A", "lora_B")
    for name, value, dtype, message in [
            (a_name, np.nan, "float32", "largest magnitude nan"),
            (b_name, np.inf, "float32", "largest magnitude inf"),
            (b_name, 2e38, "float32", r"largest magnitude 4e\+38 after lora_alpha scaling x2"),
            (b_name, 4e4, "float16", "largest magnitude 80000 after lora_alpha scaling x2, the most float16 holds is "
                                     "65504")]:
        save_file({**tensors, name: np.full_like(tensors[name], value)}, path)
        with pytest.raises(ValueError, match=f"tensor '{re.escape(name)}' holds values that are not finite in "
                                             f"{dtype} \\({message}"):
            load_lora_adapter(str(tmp_path / "a"), weights, dtype=dtype)
    load_lora_adapter(str(tmp_path / "a"), weights)  # 4e4 x 2 is finite in float32


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_adapters_load_as_float32(base, tmp_path, dtype):
    """PEFT saves adapters in the model's dtype: a bf16 or fp16 file loads, widened to float32, value for value."""
    import torch
    from safetensors.torch import load_file as load_torch, save_file as save_torch
    from transformers import AutoModelForCausalLM

    write_adapter(AutoModelForCausalLM.from_pretrained(base), tmp_path / "a", seed=6)
    path = tmp_path / "a" / "adapter_model.safetensors"
    narrow = {name: t.to(getattr(torch, dtype)) for name, t in load_torch(path).items()}
    save_torch(narrow, path)
    adapter = load_lora_adapter(str(tmp_path / "a"), module_shapes(load_checkpoint(str(base)).weights))
    module = "model.layers.1.mlp.down_proj"
    expected = narrow[f"base_model.model.{module}.lora_B.weight"].float().numpy()
    assert adapter.lora_b[module].dtype == np.float32 and np.array_equal(adapter.lora_b[module], expected)
