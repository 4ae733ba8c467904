"""Every model family against HF transformers (torch, CPU, float32), on tiny random checkpoints that
transformers itself writes (no download): logits position by position through the paged cache, and greedy
text through `LLM(model=dir)` with preemption and prefix caching on.

Each test prints the max logit difference it saw (pytest -s).
"""

import numpy as np
import pytest
import torch
from jax_engine import LLM, SamplingParams
from jax_engine.loader import load_checkpoint
from jax_engine.models.causal_lm import CausalLM
from jax_engine.models.registry import ARCHITECTURES
from tests.engine_helpers import engine_logits
from tests.test_llama_vs_hf import PROMPT, hf_logits
from tests.tiny_checkpoints import make_tiny_checkpoint

# (HF model_type, config overrides): every family, and the variants whose layers differ.
VARIANTS = {
    "llama": ("llama", {}),
    "mistral-window": ("mistral", {"sliding_window": 6}),  # PROMPT is 21 tokens: most keys fall out
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "opt": ("opt", {}),
    "opt-350m": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),  # post-norm, projections
    "gpt2": ("gpt2", {}),
    "starcoder": ("gpt_bigcode", {}),  # multi-query
    "gpt_bigcode-mha": ("gpt_bigcode", {"multi_query": False}),
    "pythia": ("gpt_neox", {}),  # parallel residual; half of each head rotates (rotary_pct 0.5)
    "gpt_neox-sequential": ("gpt_neox", {"use_parallel_residual": False}),
    "gptj": ("gptj", {}),
    "falcon-40b": ("falcon", {}),  # new decoder layout: GQA, two norms
    "falcon-7b": ("falcon", {"new_decoder_architecture": False, "multi_query": True, "parallel_attn": True}),
    "falcon-rw": ("falcon", {"new_decoder_architecture": False, "multi_query": False, "parallel_attn": False,
                             "num_kv_heads": 4, "alibi": True, "bias": True}),
    "bloom": ("bloom", {}),
    "mpt": ("mpt", {}),
    "phi3": ("phi3", {"sliding_window": 8, "partial_rotary_factor": 0.5}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {}),  # windowed and global layers; scores and logits soft-capped
    "gemma3": ("gemma3_text", {}),  # windowed and global layers, each with its own RoPE base; q/k norms
}
# Where ALiBi, a window or a soft cap change attention, every backend is checked; elsewhere the default (cpu) one.
ATTENTION_VARIANTS = ("mistral-window", "falcon-rw", "bloom", "mpt", "phi3", "gemma2", "gemma3")
CHUNKS = ([len(PROMPT)], [5, 1, 7, 1, 1, 6])  # one prefill; chunks and single decode-like tokens


def test_an_unknown_activation_is_an_error_naming_it(tmp_path):
    make_tiny_checkpoint(tmp_path, "gpt2", activation_function="relu6")
    checkpoint = load_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="hidden_act='relu6' is not supported"):
        CausalLM.from_hf_weights(checkpoint.config, checkpoint.weights)


def test_every_family_has_a_variant():
    assert {model_type for model_type, _ in VARIANTS.values()} == set(ARCHITECTURES)


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_hf(tmp_path, variant):
    """Saved in bfloat16 and sharded (the HF model holds the same bf16 values, widened): the loader's
    widening is exact, so float32's tolerance holds."""
    model_type, overrides = VARIANTS[variant]
    hf_model = make_tiny_checkpoint(tmp_path, model_type, save_dtype="bfloat16", max_shard_size="60KB", **overrides)
    assert (tmp_path / "model.safetensors.index.json").exists()
    checkpoint = load_checkpoint(str(tmp_path))
    expected = hf_logits(hf_model, PROMPT)
    for backend in ("cpu", "xla") if variant in ATTENTION_VARIANTS else ("cpu",):
        for chunks in CHUNKS:
            diff = np.abs(engine_logits(checkpoint, PROMPT, chunks, backend=backend) - expected).max()
            print(f"{variant} {backend} chunks={chunks}: max |logit diff| = {diff:.2e}")
            assert diff < 1e-5  # float32 sums in another order: ~1e-7..1e-6 seen; 1e-5 leaves headroom


def hf_greedy(model, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """HF's greedy tokens for prompts of one length, each token from a full forward pass over all so far.

    Not model.generate: with a sliding window, generate's cache gives other tokens than the forward pass it
    caches (transformers 5.23, Mistral with a prompt longer than the window), so it is not the reference.
    """
    tokens = torch.tensor(prompts)
    with torch.no_grad():
        for _ in range(num_tokens):
            tokens = torch.cat([tokens, model(tokens).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[:, len(prompts[0]):].tolist()


# One variant per family (its most common layout).
GREEDY_VARIANTS = ["llama", "mistral-window", "qwen2", "qwen3", "opt", "gpt2", "starcoder", "pythia", "gptj",
                   "falcon-7b", "bloom", "mpt", "phi3", "gemma", "gemma2", "gemma3"]


def test_greedy_variants_cover_every_family():
    assert {VARIANTS[v][0] for v in GREEDY_VARIANTS} == set(ARCHITECTURES)


@pytest.mark.parametrize("variant", GREEDY_VARIANTS)
def test_greedy_text_matches_hf_through_the_engine(tmp_path, variant):
    """Four prompts sharing a 12-token prefix, 32 greedy tokens each, in a KV cache too small for all of them
    at once: prefix-cache hits and preemption (recompute) on the way, HF's tokens at the end."""
    model_type, overrides = VARIANTS[variant]
    hf_model = make_tiny_checkpoint(tmp_path, model_type, **overrides)
    tail = PROMPT[12:]
    prompts = [PROMPT[:12] + tail[i:] + tail[:i] for i in range(4)]
    llm = LLM(str(tmp_path), block_size=4, num_gpu_blocks_override=24, max_model_len=64, max_num_seqs=4,
              enforce_eager=True, enable_prefix_caching=True)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.scheduler.kv.prefix_cache_hits > 0
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_model, prompts, 32)


def test_the_docs_table_of_families_is_current():
    from docs.model_table import PAGE, page_with_table

    text = PAGE.read_text()
    assert text == page_with_table(text), "docs/models.md's table is stale: run `python -m docs.model_table`"


def test_pallas_refuses_a_model_whose_layers_have_different_windows(tmp_path):
    """The Pallas kernels take one static sliding window; Gemma 3's layers have two (auto serves it on xla)."""
    make_tiny_checkpoint(tmp_path, "gemma3_text")
    with pytest.raises(ValueError, match="attention_backend 'pallas' takes one sliding window for every layer"):
        LLM(str(tmp_path), attention_backend="pallas", enforce_eager=True)
