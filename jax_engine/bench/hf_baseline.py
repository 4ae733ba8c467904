"""The peer: the same workload through HF transformers (torch, CPU) with the same weights.

Two ways a transformers user would run it: `generate` on static, left-padded batches (a batch runs until
its longest request is done), and `generate_batch`, transformers' own continuous batching.
"""

import time

import numpy as np

from jax_engine.loader import Checkpoint


def hf_model_from_checkpoint(checkpoint: Checkpoint):
    """An HF LlamaForCausalLM (float32, eval mode) holding exactly the checkpoint's weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = checkpoint.config
    if c.architecture not in ("llama", "mistral"):
        raise ValueError(f"the HF baseline builds Llama models only, not {c.architecture!r}")
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                         num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                         rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_word_embeddings,
                         max_position_embeddings=c.max_position_embeddings)
    model = LlamaForCausalLM(config).eval()
    state = {name: torch.from_numpy(w) for name, w in checkpoint.weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


def hf_sampling(sampling: dict) -> dict:
    """generate's sampling arguments for the benchmarks' fields (sampling_filters.sampling), min_p only when on
    (transformers adds a min_p warper even for min_p 0)."""
    return {"do_sample": True, **sampling, "min_p": sampling["min_p"] or None}


def run_static_batches(model, requests: list[tuple[list[int], int]], batch_size: int, sampling: dict,
                       pad_token_id: int = 0) -> float:
    """Seconds to serve `requests` in fixed batches of `batch_size` with `model.generate` (sampling as
    hf_sampling says)."""
    import torch

    started = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):  # left padding: every prompt ends at the same column
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(o for _, o in batch), min_new_tokens=max(o for _, o in batch),
                           pad_token_id=pad_token_id, **hf_sampling(sampling))
    return time.perf_counter() - started


def run_continuous_batching(model, requests: list[tuple[list[int], int]], sampling: dict) -> tuple[float, int]:
    """(seconds, generated tokens) with transformers' `generate_batch`.

    It takes one max_new_tokens for all requests, so every request generates the longest output length;
    we count the tokens it really generated.
    """
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(o for _, o in requests), eos_token_id=-1, pad_token_id=0,
                              **hf_sampling(sampling))
    started = time.perf_counter()
    results = model.generate_batch([p for p, _ in requests], generation_config=config, progress_bar=False)
    seconds = time.perf_counter() - started
    return seconds, int(np.sum([len(r.generated_tokens) for r in results.values()]))
