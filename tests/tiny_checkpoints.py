"""Tiny random HF checkpoints of each supported architecture, written to disk for tests.

No weights are downloaded: the model is built from a config with random initialisation (torch) and saved
as config.json + model.safetensors + a small byte-level BPE tokenizer.
"""

import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
# Qwen3's switch: enable_thinking=false (chat_template_kwargs) writes an empty thinking part into the prompt.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def byte_level_tokenizer(adds_bos: bool = False):
    """A byte-level BPE tokenizer of 258 tokens: bytes, then <|im_start|> = 256 (BOS), <|im_end|> = 257 (EOS).

    adds_bos: Llama's way instead: a 259th token <s> = 258 is the BOS, which encode() puts in front and the
    chat template writes too; a rendered chat must then be encoded without special tokens to hold just one
    (the model needs vocab_size=259).
    """
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(sorted(alphabet) + SPECIAL_TOKENS + ["<s>"] * adds_bos)}
    backend = Tokenizer(models.BPE(vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    bos, template = "<|im_start|>", CHAT_TEMPLATE
    if adds_bos:
        bos, template = "<s>", "{{ bos_token }}" + CHAT_TEMPLATE
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 258)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token="<|im_end|>",
                                   additional_special_tokens=SPECIAL_TOKENS, chat_template=template)


# Each family's config in its own field names: 2 layers, width 64 (BLOOM 48 with 6 heads, so its ALiBi slopes
# take the path for head counts that are not powers of two), a 258-token vocabulary.
_LLAMA_ARGS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=256,
                   rms_norm_eps=1e-6)
_GPT2_ARGS = dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)
FAMILY_ARGS = {
    "llama": ("LlamaConfig", {**_LLAMA_ARGS, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {**_LLAMA_ARGS, "sliding_window": None}),
    "qwen2": ("Qwen2Config", _LLAMA_ARGS),
    "qwen3": ("Qwen3Config", _LLAMA_ARGS),
    "opt": ("OPTConfig", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                              max_position_embeddings=256, word_embed_proj_dim=64)),
    "gpt2": ("GPT2Config", _GPT2_ARGS),
    "gpt_bigcode": ("GPTBigCodeConfig", _GPT2_ARGS),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.5)),
    "gptj": ("GPTJConfig", {**_GPT2_ARGS, "rotary_dim": 8}),
    "falcon": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    new_decoder_architecture=True, num_kv_heads=2, max_position_embeddings=256)),
    "bloom": ("BloomConfig", dict(hidden_size=48, n_layer=2, n_head=6)),
    "phi3": ("Phi3Config", {**_LLAMA_ARGS, "pad_token_id": 0}),
    "gemma": ("GemmaConfig", _LLAMA_ARGS),
    # Three layers, windowed, global, windowed (transformers' default layer_types), with a window of 6, a query
    # scale that is not head_dim's, and soft caps that bite: weights drawn 15x wider than the default (0.3) give
    # scaled scores and logits of a few units, which caps of 2 and 1.5 squash (Gemma 2's own, 50 and 30, would
    # leave the tiny model's outputs as they are, and a missing cap unseen).
    "gemma2": ("Gemma2Config", {**_LLAMA_ARGS, "num_hidden_layers": 3, "sliding_window": 6,
                                "query_pre_attn_scalar": 24, "initializer_range": 0.3,
                                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 1.5}),
    # Three layers, windowed, global, windowed, with a window of 6 (PROMPT is 21 tokens), a query scale that is
    # not head_dim's, and Gemma 3's RoPE bases (10,000 local, 1,000,000 global).
    "gemma3_text": ("Gemma3TextConfig", {**_LLAMA_ARGS, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                         "num_hidden_layers": 3, "sliding_window": 6,
                                         "query_pre_attn_scalar": 24, "layer_types": [
                                             "sliding_attention", "full_attention", "sliding_attention"]}),
    "mpt": ("MptConfig", dict(d_model=64, n_layers=2, n_heads=4, expansion_ratio=2, max_seq_len=256)),
}


def hf_config(architecture: str, **overrides):
    """A small transformers config of `architecture` (an HF model_type) with a 258-token vocabulary."""
    import transformers

    class_name, args = FAMILY_ARGS[architecture]
    return getattr(transformers, class_name)(**{"vocab_size": 258, "bos_token_id": 256, "eos_token_id": 257,
                                                **args, **overrides})


def make_tiny_checkpoint(directory: pathlib.Path, architecture: str, seed: int = 0, *, save_dtype: str = "float32",
                         max_shard_size: str | None = None, adds_bos: bool = False, **overrides):
    """Write a random checkpoint of `architecture` into `directory`; return the torch model too (float32).

    save_dtype: "float32", "bfloat16" or "float16", as the safetensors files store the weights; the model
        returned holds the stored values, widened to float32.
    max_shard_size: e.g. "100KB" writes shards and a model.safetensors.index.json, as large releases have.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(architecture, **overrides), dtype=torch.float32)
    with torch.no_grad():  # random biases and norm weights too, so a missing one shows in the logits
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                param.add_(0.1 * torch.randn_like(param))
        # The values the files will hold, so the float32 model returned is the one they describe. (Casting the
        # model itself would round its buffers too, e.g. RoPE frequencies, which no checkpoint stores.)
        dtype = getattr(torch, save_dtype)
        for param in model.parameters():
            param.copy_(param.to(dtype).float())
    model.eval()
    state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in model.state_dict().items()}
    model.save_pretrained(directory, state_dict=state, max_shard_size=max_shard_size or "5GB")
    byte_level_tokenizer(adds_bos).save_pretrained(directory)
    return model


def hf_vector(model, token_ids: list[int], pooling: str, normalize: bool = True):
    """HF's embedding of a prompt: its final hidden states (after the final norm) at the last token or averaged."""
    import numpy as np
    import torch

    with torch.no_grad():
        rows = model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1][0].double().numpy()
    vector = rows[-1] if pooling == "LAST" else rows.mean(axis=0)
    return vector / np.linalg.norm(vector) if normalize else vector


def snapshot_in_hub_cache(cache: pathlib.Path, repo_id: str, directory: pathlib.Path, refs: tuple[str, ...] = ("main",),
                          commit: str = "0123456789abcdef0123456789abcdef01234567") -> pathlib.Path:
    """`directory`'s files laid out as huggingface_hub caches a download of `repo_id` at `commit` (which each of
    `refs` names, as a branch or tag does): what `huggingface-cli download` leaves. Returns the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in pathlib.Path(directory).iterdir():
        (snapshot / file.name).symlink_to(file.resolve())
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
