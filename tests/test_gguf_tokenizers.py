"""GGUF files beyond the default model's: their tokenizers, and llama.cpp's rope scaling keys (a Llama file's
rope_freqs tensor against its HF checkpoint is in test_gguf_families.py).

Nothing is downloaded: each file is a tiny llama model written here with gguf-py's GGUFWriter. Its tokenizer is
trained here too, on a few paragraphs of mixed text, with the pre-tokenizer the file will name (so the vocabulary
looks like a real one of that kind); then our rebuild (jax_engine/loader/gguf_tokenizer.py) and transformers' own
GGUF conversion must agree token for token.
"""

import json
from functools import cache

import numpy as np
import pytest
from gguf import GGUFWriter
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from jax_engine.loader import load_checkpoint
from jax_engine.loader.gguf_file import GGUFFile
from jax_engine.loader.gguf_tokenizer import PRE_TOKENIZERS, tokenizer_from_gguf
from jax_engine.models.rope import rope_frequencies
from jax_engine.models.rope_scaling import RopeScaling

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Don't panic! I'M HERE, you're there, we'll see, they'd go.",
    "In 2024, 12345 people paid $3.14159 each; 1,000,000 is a million. Call 555-0100 or 0800 123 456.",
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]  # CamelCaseWords and snake_case",
    "Les élèves façonnent déjà leur avenir à Zürich; naïve café crème, señor niño.",
    "日本語のテキストです。中文文本也很重要。한국어 문장입니다.",
    "Tabs\tand  double  spaces,   triple   spaces\n\n\nnewlines\r\nWindows lines. HTTPServer XMLHttpRequest iPhone.",
] * 3
TEXTS = [
    "Hello world, how are you today?",
    "12345 and 3.14159, 1,000,000 or 2024-01-31",
    "don't DON'T I'M we'LL they'd You're",
    "two  spaces,   three,\ttab\t\ttabs\n\nnewlines\r\nCRLF  \n trailing   ",
    "Les élèves façonnent déjà leur avenir à Zürich.",
    "日本語のテキスト、中文文本也很重要。한국어 문장",
    "emoji 😀👍🏽 and symbols ½ ² ③ → ∑",
    "CamelCaseWords HTTPServer iPhone snake_case_words",
    "  leading spaces",
    "",
]
CHAT = "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n"
BYTE_LEVEL_SPECIALS = ["<|im_start|>", "<|im_end|>"]


# --------------------------------------------------------------------------------------------- writing GGUFs
def _tiny_llama_tensors(vocab_size: int) -> dict[str, np.ndarray]:
    """A valid 1-layer llama model (hidden 32, 4 heads, 2 KV heads), [out, in] as HF stores them."""
    rng = np.random.default_rng(0)
    shapes = {"attn_norm": (32,), "ffn_norm": (32,), "attn_q": (32, 32), "attn_k": (16, 32), "attn_v": (16, 32),
              "attn_output": (32, 32), "ffn_gate": (64, 32), "ffn_up": (64, 32), "ffn_down": (32, 64)}
    tensors = {f"blk.0.{name}.weight": rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}
    return tensors | {"token_embd.weight": rng.standard_normal((vocab_size, 32), dtype=np.float32),
                      "output_norm.weight": np.ones(32, np.float32)}


_TINY_LLAMA = {"block_count": 1, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
               "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-6,
               "rope.freq_base": 10000.0}


def write_gguf(path, fields: dict, tensors: dict[str, np.ndarray] | None = None, hparams: dict | None = None,
               architecture: str = "llama") -> str:
    """A GGUF file of `architecture` with these hyper-parameters (under `{architecture}.`), metadata and tensors."""
    writer = GGUFWriter(str(path), architecture)
    tokens = fields["tokenizer.ggml.tokens"]
    hparams = {**_TINY_LLAMA, "vocab_size": len(tokens), **(hparams or {})}
    for key, value in [*((f"{architecture}.{k}", v) for k, v in hparams.items()), *fields.items()]:
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)  # ints as int32, floats as float32, strings
    for name, array in (_tiny_llama_tensors(len(tokens)) if tensors is None else tensors).items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def transformers_tokenizer(path: str):
    from transformers import AutoTokenizer

    directory, _, filename = path.rpartition("/")
    return AutoTokenizer.from_pretrained(directory, gguf_file=filename)


# --------------------------------------------------------------------------------------------- vocabularies
@cache
def byte_level_vocab(splits: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a 700-token byte-level BPE trained with these split regexes, as llama.cpp writes them."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*(pre_tokenizers.Split(Regex(split), "isolated") for split in splits),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=700, special_tokens=BYTE_LEVEL_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    model = json.loads(backend.to_str())["model"]
    return sorted(model["vocab"], key=model["vocab"].get), [" ".join(merge) for merge in model["merges"]]


def byte_level_fields(pre: str | None, add_bos: bool | None = None) -> dict:
    tokens, merges = byte_level_vocab(PRE_TOKENIZERS[pre or "default"].splits)
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
              "tokenizer.ggml.token_type": [3 if t in BYTE_LEVEL_SPECIALS else 1 for t in tokens],
              "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.pre": pre,
              "tokenizer.ggml.add_bos_token": add_bos}
    return {key: value for key, value in fields.items() if value is not None}


@cache
def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) laid out as Llama 2's: <unk> <s> </s>, the 256 <0xNN> byte tokens, then
    the pieces best first (score = -rank), single characters last. A 60-character alphabet leaves the rest
    (emoji, most CJK) to byte fallback."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace("\u2581", prepend_scheme="always", split=True)
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, limit_alphabet=60, show_progress=False))
    model = json.loads(backend.to_str())["model"]
    merged = ["".join(merge) for merge in model["merges"]]
    pieces = list(dict.fromkeys(merged + sorted(t for t in model["vocab"] if len(t) == 1)))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * 259 + [-float(rank) for rank in range(len(pieces))]
    return tokens, scores, [2, 3, 3] + [6] * 256 + [1] * len(pieces)  # UNKNOWN, CONTROL, BYTE, NORMAL


def sentencepiece_fields(**extra) -> dict:
    tokens, scores, types = sentencepiece_vocab()
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0, **extra}


def ours(path: str):
    return tokenizer_from_gguf(GGUFFile(path))


# --------------------------------------------------------------------------------------------- byte-level BPE
# Real files state add_bos_token: Llama 3's and Tekken's converters write True.
BYTE_LEVEL_PRES = {"gpt-2": False, "smollm": False, "llama-bpe": True, "qwen2": False, "qwen35": False,
                   "tekken": True, "gpt-4o": False, "dbrx": False}


@pytest.mark.parametrize("pre", BYTE_LEVEL_PRES)
def test_byte_level_tokenizers_equal_transformers_conversion(tmp_path, pre):
    path = write_gguf(tmp_path / f"{pre}.gguf", byte_level_fields(pre, BYTE_LEVEL_PRES[pre]))
    mine, theirs = ours(path), transformers_tokenizer(path)
    for text in [*TEXTS, CHAT]:
        assert mine.encode(text) == theirs.encode(text), (pre, text, mine.tokenize(text), theirs.tokenize(text))
        ids = mine.encode(text, add_special_tokens=False)
        assert mine.decode(ids) == text
    assert mine.encode("")[:1] == ([0] if BYTE_LEVEL_PRES[pre] else [])
    chat = mine.encode(CHAT, add_special_tokens=False)
    assert chat.count(0) == 2 and chat.count(1) == 1, "special tokens are matched whole"
    assert mine.decode(chat, skip_special_tokens=True) == "user\nHi there!\nassistant\n"


# How each pre-tokenizer cuts text before the merges (spaces are "Ġ" after the byte-level step).
PIECES = {
    "gpt-2": ("x 12345 don't I'M", ["x", "Ġ12345", "Ġdon", "'t", "ĠI", "'", "M"]),
    "smollm": ("x 12345", ["x", "Ġ", "1", "2", "3", "4", "5"]),
    "llama-bpe": ("x 12345 don't I'M", ["x", "Ġ", "123", "45", "Ġdon", "'t", "ĠI", "'M"]),
    "qwen2": ("x 12345 I'M", ["x", "Ġ", "1", "2", "3", "4", "5", "ĠI", "'M"]),
    "tekken": ("CamelCase 12", ["Camel", "Case", "Ġ", "1", "2"]),
    "gpt-4o": ("CamelCase 12345 I'M", ["Camel", "Case", "Ġ", "123", "45", "ĠI'M"]),
    # llama.cpp's "default": punctuation runs, then GPT-2's regex, then digit runs cut in threes
    "default": ("Hi, x+=y 12345", ["Hi", ",", "Ġx", "+=", "y", "Ġ", "123", "45"]),
}


@pytest.mark.parametrize("pre", PIECES)
def test_pre_tokenizers_split_digits_and_contractions_as_llama_cpp(tmp_path, pre):
    text, expected = PIECES[pre]
    tokenizer = ours(write_gguf(tmp_path / "t.gguf", byte_level_fields(pre)))
    assert [piece for piece, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)] == expected


def test_byte_level_defaults_follow_llama_cpp(tmp_path):
    """No add_bos_token: Llama 3's and Tekken's pre-tokenizers add BOS, GPT-2's does not; no pre: "default"."""
    assert ours(write_gguf(tmp_path / "a.gguf", byte_level_fields("llama-bpe"))).encode("hi")[0] == 0
    assert ours(write_gguf(tmp_path / "b.gguf", byte_level_fields("gpt-2"))).encode("hi")[0] != 0
    tokenizer = ours(write_gguf(tmp_path / "c.gguf", byte_level_fields(None)))
    assert [p for p, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("a+=1")] == ["a", "+=", "1"]


# --------------------------------------------------------------------------------------------- sentencepiece
def test_sentencepiece_tokenizer_equals_transformers_conversion(tmp_path):
    path = write_gguf(tmp_path / "spm.gguf", sentencepiece_fields())
    mine, theirs = ours(path), transformers_tokenizer(path)
    for text in [*TEXTS, "<s>Hi</s> there", "Hello <s> world"]:
        assert mine.encode(text) == theirs.encode(text), (text, mine.tokenize(text), theirs.tokenize(text))
    for text in TEXTS:  # SentencePiece's decode drops the one space it put in front
        assert mine.decode(mine.encode(text), skip_special_tokens=True) == text.removeprefix(" ")
    ids = mine.encode("emoji 😀")
    assert ids[0] == 1, "llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise"
    assert mine.convert_ids_to_tokens(ids)[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]  # byte fallback
    assert mine.convert_ids_to_tokens(mine.encode("hi", add_special_tokens=False))[0].startswith("\u2581")


def test_sentencepiece_metadata_flags(tmp_path):
    fields = sentencepiece_fields(**{"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True,
                                     "tokenizer.ggml.add_space_prefix": False})
    tokenizer = ours(write_gguf(tmp_path / "spm.gguf", fields))
    ids = tokenizer.encode("hi there")
    assert ids[0] != 1 and ids[-1] == 2
    assert not tokenizer.convert_ids_to_tokens(ids)[0].startswith("\u2581")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi there"


# --------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("fields, architecture, message", [
    ({"tokenizer.ggml.model": "bert"}, "llama", r"tokenizer.ggml.model='bert' is not supported; supported: \['gpt2'"),
    ({"tokenizer.ggml.pre": "falcon"}, "llama", r"tokenizer.ggml.pre='falcon' is not supported .*'llama-bpe'"),
    ({"tokenizer.ggml.pre": "deepseek-llm"}, "llama", r"tokenizer.ggml.pre='deepseek-llm'.*'qwen2'"),
    ({"tokenizer.ggml.model": "llama"}, "phi3", r"general.architecture='phi3' is not supported"),
])
def test_unsupported_tokenizers_are_clear_errors(tmp_path, fields, architecture, message):
    path = write_gguf(tmp_path / "bad.gguf", byte_level_fields("gpt-2") | fields, tensors={},
                      architecture=architecture)
    with pytest.raises(ValueError, match=message):
        ours(path)


def test_loading_a_file_with_an_unsupported_tokenizer_raises(tmp_path):
    path = write_gguf(tmp_path / "bad.gguf", byte_level_fields("gpt-2") | {"tokenizer.ggml.pre": "falcon"})
    with pytest.raises(ValueError, match="tokenizer.ggml.pre='falcon'"):
        load_checkpoint(path)


# --------------------------------------------------------------------------------------------- rope
def test_rope_frequencies_divide_by_the_factors():
    base, _ = rope_frequencies(16, 10000.0, None)
    factors = (1.0, 2.0, 4.0, 8.0, 1.0, 1.0, 3.0, 1.0)
    scaled, _ = rope_frequencies(16, 10000.0, None, factors)
    np.testing.assert_allclose(scaled, base / np.array(factors), rtol=1e-7)
    with pytest.raises(ValueError, match="3 rope frequency factors for 8 rotating pairs"):
        rope_frequencies(16, 10000.0, None, (1.0, 2.0, 3.0))


@pytest.mark.parametrize("hparams, expected", [
    ({}, None),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}, RopeScaling("linear", 4.0, 64)),
    ({"rope.scale_linear": 2.0}, RopeScaling("linear", 2.0, 64)),  # older files: the type defaults to linear
    ({"rope.scaling.type": "none", "rope.scaling.factor": 1.0}, None),
])
def test_gguf_linear_rope_scaling(tmp_path, hparams, expected):
    path = write_gguf(tmp_path / "t.gguf", byte_level_fields("gpt-2"), hparams=hparams)
    assert load_checkpoint(path).config.rope_scaling == expected


def test_gguf_rope_scaling_types_we_do_not_read_are_clear_errors(tmp_path):
    hparams = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}
    path = write_gguf(tmp_path / "t.gguf", byte_level_fields("gpt-2"), hparams=hparams)
    with pytest.raises(ValueError, match=r"llama.rope.scaling.type='yarn' is not supported"):
        load_checkpoint(path)
