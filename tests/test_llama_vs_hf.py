"""The reference Llama forward pass against HF transformers (torch, CPU, float32) logits.

Each test prints the max difference it saw (run pytest with -s to read them).
"""

import numpy as np
import pytest
import torch

from jax_engine.bench.hf_baseline import hf_model_from_checkpoint
from jax_engine.loader import load_checkpoint
from reference import LlamaModel
from tests.reference_helpers import paged_logits
from tests.tiny_checkpoints import make_tiny_checkpoint

PROMPT = [256, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 10, 84, 104, 101, 32, 99, 97, 116]


def hf_logits(model, token_ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().numpy()


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_random_checkpoints_match_hf(tmp_path, architecture):
    hf_model = make_tiny_checkpoint(tmp_path, architecture)
    checkpoint = load_checkpoint(str(tmp_path))
    model = LlamaModel(checkpoint.config, checkpoint.weights)
    expected = hf_logits(hf_model, PROMPT)
    # One prefill, then chunks of 5, then token by token: all read the same paged cache.
    for chunks in ([len(PROMPT)], [5, 5, 5, 5, 1], [1] * len(PROMPT)):
        diff = np.abs(paged_logits(model, PROMPT, chunks) - expected).max()
        print(f"{architecture} chunks={chunks[:3]}...: max |logit diff| = {diff:.2e}")
        # float32 sums in a different order: we see ~3e-7 on logits of magnitude ~1; 1e-5 leaves headroom.
        assert diff < 1e-5


@pytest.mark.parametrize("group", [1, 4])  # MHA and MQA as well as the GQA above
def test_tiny_mha_and_mqa_match_hf(tmp_path, group):
    hf_model = make_tiny_checkpoint(tmp_path, "llama", num_key_value_heads=4 // group)
    checkpoint = load_checkpoint(str(tmp_path))
    diff = np.abs(paged_logits(LlamaModel(checkpoint.config, checkpoint.weights), PROMPT, [7, 7, 7])
                  - hf_logits(hf_model, PROMPT)).max()
    print(f"queries per kv head {group}: max |logit diff| = {diff:.2e}")
    assert diff < 1e-5  # float32 sums in a different order, as above


def test_default_model_matches_hf(default_checkpoint):
    tokenizer = default_checkpoint.tokenizer
    prompt = tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    expected = hf_logits(hf_model_from_checkpoint(default_checkpoint), prompt)
    model = LlamaModel(default_checkpoint.config, default_checkpoint.weights)
    ours = paged_logits(model, prompt, [len(prompt) - 3, 1, 1, 1], block_size=16)
    diff = np.abs(ours - expected).max()
    print(f"SmolLM2-135M: max |logit diff| = {diff:.2e} over {len(prompt)} positions (logits span "
          f"{expected.min():.1f}..{expected.max():.1f})")
    assert diff < 1e-3  # 30 float32 layers, logits of magnitude ~20: we see ~1e-4
    assert (ours.argmax(-1) == expected.argmax(-1)).all()
    assert tokenizer.decode(int(ours[-1].argmax())).strip() == "Berlin"
