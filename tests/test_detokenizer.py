"""Incremental detokenization gives exactly the text of decoding all tokens at once."""

from hypothesis import given
from hypothesis import strategies as st

from jax_engine.detokenizer import IncrementalDetokenizer

PIECES = list("ab cé日本\n\t😀") + ["<|im_end|>", " the", "12"]
TEXTS = st.lists(st.sampled_from(PIECES), max_size=20).map("".join)


@given(prompt=TEXTS, output=TEXTS)
def test_incremental_text_equals_full_decode(default_checkpoint, prompt, output):
    tokenizer = default_checkpoint.tokenizer
    prompt_ids, output_ids = tokenizer.encode(prompt) or [1], tokenizer.encode(output)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detokenizer.add_token(t) for t in output_ids]
    assert "".join(deltas) == detokenizer.text == tokenizer.decode(output_ids, skip_special_tokens=True)


@given(token_ids=st.lists(st.integers(0, 49151), max_size=12))
def test_random_token_ids_only_ever_emit_final_text(default_checkpoint, token_ids):
    """Text once emitted is never taken back: every intermediate text is a prefix of the final decode."""
    tokenizer = default_checkpoint.tokenizer
    detokenizer = IncrementalDetokenizer(tokenizer, [1, 2, 3], skip_special_tokens=False)
    texts = []
    for token in token_ids:
        detokenizer.add_token(token)
        texts.append(detokenizer.text)
    full = tokenizer.decode(token_ids, skip_special_tokens=False)
    assert all(full.startswith(text) for text in texts)
    assert full[len(detokenizer.text):].strip("\ufffd") == ""  # only an unfinished character is held back


class CountingTokenizer:
    """A tokenizer that counts how often its special-token list is built (transformers builds it at each lookup)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.lookups = tokenizer, 0

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)

    @property
    def all_special_ids(self) -> list[int]:
        self.lookups += 1
        return self.tokenizer.all_special_ids


def test_a_tokenizer_s_special_tokens_are_looked_up_once_for_all_requests(default_checkpoint):
    """Gemma 3's tokenizer has 6,249 special tokens: building their list for each request's detokenizer (twice)
    took 4.4 ms a request. Each detokenizer still skips them, in the prompt's window as in the output."""
    tokenizer = CountingTokenizer(default_checkpoint.tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    hello, world = tokenizer.encode("Hello"), tokenizer.encode(" world")
    for _ in range(10):
        detokenizer = IncrementalDetokenizer(tokenizer, hello + [end])
        assert detokenizer.tokens == tokenizer.convert_ids_to_tokens(hello)  # the prompt's special token skipped
        assert [detokenizer.add_token(t) for t in [end, *world]] == ["", " world"]
    assert tokenizer.lookups == 1


def test_a_tokenizer_that_cannot_be_a_weak_key_still_detokenizes(default_checkpoint):
    """A tokenizer class that defines equality and no hash cannot key the lookup's cache: it is looked up per
    request, as before, instead of failing the request."""

    class UnhashableTokenizer(CountingTokenizer):
        __hash__ = None

    tokenizer = UnhashableTokenizer(default_checkpoint.tokenizer)
    for _ in range(2):
        detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"))
        assert detokenizer.add_token(tokenizer.encode(" world")[0]) == " world"
    assert tokenizer.lookups == 2
