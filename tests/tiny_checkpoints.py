"""Tiny random HF checkpoints of each supported architecture, written to disk for tests.

No weights are downloaded: the model is built from a config with random initialisation (torch) and saved
as config.json + model.safetensors + a small byte-level BPE tokenizer.
"""

import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_tokenizer():
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(sorted(alphabet) + SPECIAL_TOKENS)}
    backend = Tokenizer(models.BPE(vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   chat_template=CHAT_TEMPLATE)


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


def make_tiny_checkpoint(directory: pathlib.Path, architecture: str, seed: int = 0, **overrides):
    """Write a random checkpoint of `architecture` into `directory`; return the torch model too."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(architecture, **overrides), torch_dtype=torch.float32)
    with torch.no_grad():  # random biases and norm weights too, so a missing one shows in the logits
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    _byte_level_tokenizer().save_pretrained(directory)
    return model
