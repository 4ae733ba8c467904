"""Incremental detokenization: each step decodes only the newest tokens (vLLM's algorithm).

Byte-level BPE tokens do not map one-to-one to characters: a character may span several tokens, and a
token's leading space depends on its neighbour. We keep a small window of token strings, decode the window
with and without the new token, and emit the difference, holding text back while it ends in an incomplete
UTF-8 sequence (decoded as U+FFFD).
"""

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported: the engine core process imports this module and needs no transformers
    from transformers import PreTrainedTokenizerBase

# Start the window with a few prompt tokens so the first output token's spacing is right.
_PROMPT_WINDOW = 5

_special_ids: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> its special token ids


def special_token_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's special token ids, looked up once per tokenizer (an engine's never changes): transformers
    builds the list again at every lookup, and at every conversion that skips them, which took 4.4 ms of each
    Gemma 3 request (6,249 special tokens) where SmolLM2's 17 take 0.02."""
    try:
        ids = _special_ids.get(tokenizer)
    except TypeError:  # a tokenizer that cannot be a weak key (unhashable, or without weak references)
        return frozenset(tokenizer.all_special_ids)
    if ids is None:
        ids = _special_ids[tokenizer] = frozenset(tokenizer.all_special_ids)
    return ids


def decoded_text(tokenizer, token_ids: list[int]) -> str:
    """Token ids' whole text ("" without a tokenizer): what beam search reports, its beams being reordered."""
    return "" if tokenizer is None else tokenizer.decode(token_ids, skip_special_tokens=True)


def decoded_token(tokenizer, token: int) -> str | None:
    """A token's text in logprobs (None without a tokenizer, as vLLM's decoded_token)."""
    return None if tokenizer is None else tokenizer.decode([int(token)])


def searches_stop_strings(params, output_len: int, stop_terminated: bool) -> bool:
    """Whether the text a new token added is searched for stop strings, by vLLM's rule: once the output (this token
    included, `output_len` tokens) is longer than min_tokens, and not where the token itself ended the sequence as
    EOS or a stop token (`stop_terminated`). A token that reached max_tokens is searched."""
    return bool(params.stop) and output_len > params.min_tokens and not stop_terminated


def find_stop_string(text: str, new_chars: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The first of `stops` that ends within the last `new_chars` characters of `text`: (where it starts, which)."""
    for stop in stops:
        index = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if index >= 0:
            return index, stop
    return None


def cut_at_stop(text: str, index: int, stop: str, include_stop: bool) -> str:
    """The text a stop string found at `index` ends: up to it, or through it with include_stop_str_in_output."""
    return text[: index + (len(stop) if include_stop else 0)]


class NoDetokenizer:
    """The detokenizer of an engine without a tokenizer (skip_tokenizer_init): no text, only token ids."""

    text = ""

    def add_token(self, token_id: int) -> str:
        return ""


class IncrementalDetokenizer:
    def __init__(self, tokenizer: "PreTrainedTokenizerBase", prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skipped_ids = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        window = [t for t in prompt_token_ids[-_PROMPT_WINDOW - 1 :] if t not in self.skipped_ids]
        self.tokens = tokenizer.convert_ids_to_tokens(window)
        self.prefix_offset = max(len(self.tokens) - _PROMPT_WINDOW, 0)
        self.read_offset = len(self.tokens)
        self.text = ""

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (possibly empty)."""
        if token_id not in self.skipped_ids:
            self.tokens.append(self.tokenizer.convert_ids_to_tokens(token_id))
        before = self.tokenizer.convert_tokens_to_string(self.tokens[self.prefix_offset : self.read_offset])
        after = self.tokenizer.convert_tokens_to_string(self.tokens[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new yet, or half a character
        delta = after[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta
