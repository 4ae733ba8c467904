"""Rebuild a Hugging Face fast tokenizer from the vocabulary stored in GGUF metadata, without torch."""

from gguf import GGUFReader
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special and never split.
_CONTROL = 3


def _strings(reader: GGUFReader, key: str) -> list[str]:
    field = reader.fields.get(key)
    return [] if field is None else list(field.contents())


def _special(reader: GGUFReader, tokens: list[str], key: str) -> str | None:
    field = reader.fields.get(key)
    return None if field is None else tokens[int(field.contents())]


def tokenizer_from_gguf(reader: GGUFReader) -> PreTrainedTokenizerFast:
    """Byte-level BPE tokenizer (GPT-2 style, as SmolLM2 and Qwen use) with the chat template.

    Raises:
        ValueError: if the file's tokenizer is not byte-level BPE (`tokenizer.ggml.model == "gpt2"`).
    """
    kind = reader.fields["tokenizer.ggml.model"].contents()
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model={kind!r} is not supported; only 'gpt2' (byte-level BPE)")
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _strings(reader, "tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    # SmolLM2 ("smollm" pre-tokenizer) splits digits one by one before the GPT-2 byte-level regex.
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if reader.fields["tokenizer.ggml.pre"].contents() == "smollm":
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(pre)
    backend.decoder = decoders.ByteLevel()
    token_types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    specials = [t for t, kind in zip(tokens, token_types) if kind == _CONTROL]
    chat_template = reader.fields.get("tokenizer.chat_template")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=_special(reader, tokens, "tokenizer.ggml.bos_token_id"),
        eos_token=_special(reader, tokens, "tokenizer.ggml.eos_token_id"),
        unk_token=_special(reader, tokens, "tokenizer.ggml.unknown_token_id"),
        pad_token=_special(reader, tokens, "tokenizer.ggml.padding_token_id"),
        additional_special_tokens=specials,
        chat_template=None if chat_template is None else chat_template.contents(),
    )
    return tokenizer
