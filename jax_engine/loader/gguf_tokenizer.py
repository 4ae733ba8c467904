"""Rebuild a Hugging Face fast tokenizer from the vocabulary stored in GGUF metadata, without torch.

A GGUF file carries no tokenizer.json: llama.cpp's converter writes the vocabulary under `tokenizer.ggml.*` and
names the algorithm (`tokenizer.ggml.model`) and, for byte-level BPE, the pre-tokenizer (`tokenizer.ggml.pre`)
instead of spelling them out. Two models are rebuilt with `tokenizers`:

    "llama"  SentencePiece BPE (Llama 2, Mistral, TinyLlama): tokens + scores, "▁" for spaces, <0xNN> byte fallback
    "gpt2"   byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen): tokens + merges, and a split regex named by `pre`

The pieces are transformers' own GGUF conversion (integrations/gguf/gguf_tokenizer_mapping.py), which the tests
compare against token for token; the split regexes are llama.cpp's (src/llama-vocab.cpp, llm_tokenizer_bpe).
Where the two differ we follow llama.cpp, whose files these are: the add-BOS defaults, Llama 3's and Tekken's
whole-word vocabulary lookup (ignore_merges, as their tokenizer.json too), "default"'s regexes, and control tokens
outside the byte alphabet kept special. Anything else raises: a tokenizer rebuilt from a guess tokenizes wrongly
and quietly.
"""

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jax_engine.loader.gguf_file import GGUFFile

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special; USER_DEFINED ones (`<think>`) are added
# tokens that are never split but are not special.
_CONTROL, _USER_DEFINED = 3, 4
_SPACE = "\u2581"  # SentencePiece's "▁": a space inside a token

# --------------------------------------------------------------------------------------------- split regexes
# GPT-2's: what pre_tokenizers.ByteLevel(use_regex=True) applies by itself.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's: contractions in any case, a letter run may take one leading non-letter, digits in threes.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's: Llama 3's with single digits.
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
# Qwen3.5's: Qwen2's with combining marks kept on their letters.
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_LEAD = r"[^\r\n\p{L}\p{N}]?"  # one leading space or punctuation mark may go with a word
# Mistral's Tekken: words split at case changes (CamelCase -> Camel Case), single digits.
_TEKKEN = (rf"{_LEAD}{_UPPER}*{_LOWER}+|{_LEAD}{_UPPER}+{_LOWER}*|\p{{N}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's (Llama 4): Tekken's words with the contraction attached, digits in threes.
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (rf"{_LEAD}{_UPPER}*{_LOWER}+{_CONTRACTION}|{_LEAD}{_UPPER}+{_LOWER}*{_CONTRACTION}"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _Pre:
    """One llama.cpp pre-tokenizer: its regexes, applied in turn (each splits the pieces of the one before,
    keeping what it does not match), and whether a piece found whole in the vocabulary skips the merges."""

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default where the file has no tokenizer.ggml.add_bos_token


_GPT2_PRE = _Pre((_GPT2,))
_DIGITS_PRE = _Pre((r"\p{N}", _GPT2))  # SmolLM's, StarCoder's: every digit on its own
_LLAMA3_PRE = _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)
# NOTE: llama.cpp's "default" is its guess for a file that names no pre-tokenizer (it warns that quality
# degrades): punctuation runs and digit triples split out around GPT-2's regex. transformers uses GPT-2's alone.
_DEFAULT_PRE = _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))

# tokenizer.ggml.pre -> pre-tokenizer, grouped as llama.cpp's llm_tokenizer_bpe groups them.
PRE_TOKENIZERS: dict[str, _Pre] = {
    "default": _DEFAULT_PRE,
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"], _GPT2_PRE),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"], _DIGITS_PRE),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"], _LLAMA3_PRE),
    **dict.fromkeys(["dbrx", "smaug-bpe"], _Pre((_LLAMA3,))),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _Pre((_QWEN2,))),
    "qwen35": _Pre((_QWEN35,)),
    "tekken": _Pre((_TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _Pre((_GPT4O,))),
}
TOKENIZER_MODELS = ("gpt2", "llama")
# transformers rebuilds Phi-3's SentencePiece files its own way (it prepends "▁" with a normalizer): not done here.
# Gemma's files (1, 2 and 3) are read as llama.cpp reads them (no space prefix, merges from the scores), which
# transformers does not (it respells space tokens and orders merges by position): the same ids as llama.cpp's
# tokenizer on the Gemma 3 270M file, and on its vocabulary under Gemma 1's and 2's names (tests/test_gemma3_gguf.py).
_OTHER_SENTENCEPIECE_ARCHITECTURES = ("phi3",)


# --------------------------------------------------------------------------------------------- metadata
def _special(gguf_file: GGUFFile, tokens: list[str], key: str) -> str | None:
    token_id = gguf_file.fields.get(key)
    return None if token_id is None else tokens[int(token_id)]


def _added_tokens(tokens: list[str], token_types: list[int], vocab: dict[str, int]) -> list[AddedToken]:
    """Control tokens as special tokens, user-defined ones as plain added tokens: both matched whole in text.

    NOTE: in a byte-level file the converter writes these in their own spelling, not the byte alphabet; the
    vocabulary holds that spelling at their id (see _byte_level_vocab), so adding them does not grow it.
    """
    kinds = {_CONTROL: True, _USER_DEFINED: False}
    return [AddedToken(token, normalized=False, special=kinds[kind])
            for token, kind in zip(tokens, token_types) if kind in kinds and vocab.get(token) is not None]


# --------------------------------------------------------------------------------------------- sentencepiece
def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges that replay SentencePiece's: the pair whose merged token scores highest merges first.

    The order, ties included, is transformers' `generate_merges` (what its GGUF and slow-to-fast conversions
    use): each token's splits into two tokens of the vocabulary by their ids, then all by score, longer left
    part first.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for token, score in dict(zip(tokens, scores)).items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        merges += [(left, right, score) for left, right in sorted(splits, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece(gguf_file: GGUFFile, tokens: list[str]) -> tuple[Tokenizer, dict[str, int]]:
    architecture = gguf_file.fields.get("general.architecture")
    if architecture in _OTHER_SENTENCEPIECE_ARCHITECTURES:
        raise ValueError(f"tokenizer.ggml.model='llama' with general.architecture={architecture!r} is not supported:"
                         f" {_OTHER_SENTENCEPIECE_ARCHITECTURES} tokenize SentencePiece their own way")
    merges = gguf_file.fields.get("tokenizer.ggml.merges")
    merges = ([tuple(m.split(" ", 1)) for m in merges] if merges is not None
              else _merges_from_scores(tokens, gguf_file.fields.get("tokenizer.ggml.scores", [0.0] * len(tokens))))
    vocab = {token: i for i, token in enumerate(tokens)}
    # Unknown characters fall back to their UTF-8 bytes (<0xE6> <0x97> <0xA5>), as llama.cpp and sentencepiece.
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True,
                                   unk_token=_special(gguf_file, tokens, "tokenizer.ggml.unknown_token_id")))
    # NOTE: "first": "▁" goes before the text, not after each special token in it. transformers does the same;
    # llama.cpp also prefixes the text that follows a special token.
    prefix = bool(gguf_file.fields.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(_SPACE, prepend_scheme="first" if prefix else "never",
                                                     split=False)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] * prefix)
    return backend, vocab


# --------------------------------------------------------------------------------------------- byte-level BPE
def _byte_level_vocab(tokens: list[str], token_types: list[int]) -> dict[str, int]:
    """Token -> id, and, for tokens outside the byte alphabet, their byte-level spelling too.

    Normal tokens are written in GPT-2's byte alphabet ("Ġthe"); a control or user-defined token is written as
    itself ("<｜end▁of▁sentence｜>"). As transformers, look the odd ones up under their byte spelling as well,
    so a converter's mislabelled normal token still encodes.
    """
    spelling = _byte_alphabet()  # [256]: byte -> character
    alphabet = set(spelling)
    vocab = {}
    for i, (token, kind) in enumerate(zip(tokens, token_types)):
        if not set(token) <= alphabet:
            vocab.setdefault("".join(spelling[b] for b in token.encode("utf-8")), i)
        if set(token) <= alphabet or kind in (_CONTROL, _USER_DEFINED):
            vocab[token] = i
    return vocab


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others shift to U+0100 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def _byte_level(gguf_file: GGUFFile, tokens: list[str], token_types: list[int]
                ) -> tuple[Tokenizer, dict[str, int], _Pre]:
    name = gguf_file.fields.get("tokenizer.ggml.pre", "default")  # llama.cpp reads a missing one as "default"
    if name not in PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre={name!r} is not supported for tokenizer.ggml.model='gpt2'; "
                         f"supported: {sorted(PRE_TOKENIZERS)}")
    pre = PRE_TOKENIZERS[name]
    merges = [tuple(m.split(" ", 1)) for m in gguf_file.fields.get("tokenizer.ggml.merges", [])]
    vocab = _byte_level_vocab(tokens, token_types)
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                                   ignore_merges=pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in pre.splits]
    backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                         use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, vocab, pre


# --------------------------------------------------------------------------------------------- entry point
def tokenizer_from_gguf(gguf_file: GGUFFile, default_chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer a GGUF file describes, with its special tokens, BOS/EOS rules and chat template.

    Args:
        gguf_file: the opened GGUF file.
        default_chat_template: the chat template of a file that has none (its family's, gguf_families.py).

    Returns:
        A fast tokenizer whose `encode` adds BOS / EOS as llama.cpp would (`tokenizer.ggml.add_bos_token`,
        `add_eos_token`, else llama.cpp's default for the tokenizer).

    Raises:
        ValueError: a `tokenizer.ggml.model` other than "llama" or "gpt2", a byte-level file whose
            `tokenizer.ggml.pre` is not in PRE_TOKENIZERS, or a SentencePiece file of an architecture that
            tokenizes it differently (Gemma, Phi-3); the message names the field, its value and what is supported.
    """
    kind = gguf_file.fields.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise ValueError(f"tokenizer.ggml.model={kind!r} is not supported; supported: {list(TOKENIZER_MODELS)}")
    tokens = gguf_file.fields.get("tokenizer.ggml.tokens")
    token_types = gguf_file.fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "llama":
        backend, vocab = _sentencepiece(gguf_file, tokens)
        add_bos = True  # llama.cpp's SentencePiece defaults: BOS yes, EOS no
    else:
        backend, vocab, pre = _byte_level(gguf_file, tokens, token_types)
        add_bos = pre.add_bos
    added = _added_tokens(tokens, token_types, vocab)
    backend.add_tokens([token for token in added if not token.special])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=_special(gguf_file, tokens, "tokenizer.ggml.bos_token_id"),
        eos_token=_special(gguf_file, tokens, "tokenizer.ggml.eos_token_id"),
        unk_token=_special(gguf_file, tokens, "tokenizer.ggml.unknown_token_id"),
        pad_token=_special(gguf_file, tokens, "tokenizer.ggml.padding_token_id"),
        additional_special_tokens=[token for token in added if token.special],
        add_bos_token=bool(gguf_file.fields.get("tokenizer.ggml.add_bos_token", add_bos)),
        add_eos_token=bool(gguf_file.fields.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=gguf_file.fields.get("tokenizer.chat_template") or default_chat_template,
    )
