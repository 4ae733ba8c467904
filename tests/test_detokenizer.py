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
