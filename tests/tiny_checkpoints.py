"""Tiny random HF checkpoints of each supported architecture, written to disk for tests.

No weights are downloaded: the model is built from a config with random initialisation (torch) and saved
as config.json + model.safetensors + a small byte-level BPE tokenizer.
"""

import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
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


def hf_config(architecture: str, **overrides):
    """A small transformers config of `architecture` with a 258-token vocabulary."""
    import transformers

    classes = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    args = dict(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=architecture == "llama",
                bos_token_id=256, eos_token_id=257)
    if architecture == "mistral":
        args["sliding_window"] = None
    args.update(overrides)
    return classes[architecture](**args)


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
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.eval()
    model.to(getattr(torch, save_dtype))
    model.save_pretrained(directory, max_shard_size=max_shard_size or "5GB")
    byte_level_tokenizer(adds_bos).save_pretrained(directory)
    return model.to(torch.float32)
