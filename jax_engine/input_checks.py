"""Input hardening: what a careless or hostile caller may send, refused with a ValueError that names the field.

Everything a request carries passes these checks before the engine keeps it: strict types (True is not a
token id, 1.0 is not a count), finite numbers, and bounds on how much work one request can ask of every
step. The messages are the ones the server returns to clients, so a value is shown cut short.
"""

import math

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
# What a sampler packs into int32 arrays; token ids must also be below the model's vocabulary size.
INT32_MAX = 2**31 - 1
MAX_STOP_TOKEN_IDS = 256
# Bounds on what one request's token controls may ask of every step's sampler.
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
MAX_ALLOWED_TOKEN_IDS = 1 << 20
MAX_BAD_WORDS = 256


def _shown(value) -> str:
    """The value as an error message shows it: a 10 MB string or a 400-digit number is cut short."""
    if isinstance(value, int) and value.bit_length() > 256:  # repr() refuses over 4300 digits
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def check(ok: bool, name: str, limit: str, value) -> None:
    """Raise a ValueError naming the field, its limit and the value given, unless `ok`."""
    if not ok:
        raise ValueError(f"{name} must be {limit}, got {_shown(value)}")


def is_int(value) -> bool:
    """An integer, strictly: True and 1.0 are not (no bool-to-id or float-to-count coercion)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_unicode(text: str) -> bool:
    """Text that UTF-8 can encode: JSON and Python strings can hold lone surrogates ("\\ud800"), which no
    tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_int(value, name: str, low: int, high: int | None = None, optional: bool = False) -> int | None:
    """`value` as a Python int in [low, high] (or None if `optional`), or a ValueError naming the field."""
    if optional and value is None:
        return None
    limit = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
    check(is_int(value) and low <= value and (high is None or value <= high), name,
          limit + (" or None" if optional else ""), value)
    return int(value)


def check_real(value, name: str, low: float, high: float, low_open: bool = False) -> float:
    """`value` as a finite Python float in [low, high] ((low, high] if low_open), or a ValueError."""
    finite = is_int(value) or (isinstance(value, (float, np.floating)) and math.isfinite(value))
    in_range = finite and (low < value if low_open else low <= value) and value <= high
    check(in_range, name, f"a number in {'(' if low_open else '['}{low:g}, {high:g}]", value)
    return float(value)


def check_bool(value, name: str) -> bool:
    check(isinstance(value, (bool, np.bool_)), name, "true or false", value)
    return bool(value)


def token_id_tuple(value, name: str, max_len: int) -> tuple[int, ...]:
    """A list of token ids (ints >= 0, at most max_len of them) as a tuple."""
    check(isinstance(value, (list, tuple)) and len(value) <= max_len, name,
          f"a list of at most {max_len} token ids", value)
    return tuple(check_int(t, name, 0, INT32_MAX) for t in value)


def logit_bias(bias) -> dict[int, float] | None:
    """A logit_bias dict with int token ids and float biases in [-100, 100] (at most 300 entries)."""
    if bias is None:
        return None
    check(isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS, "logit_bias",
          f"a dict of at most {MAX_LOGIT_BIAS} token id -> bias entries", bias)
    return {check_int(token, "logit_bias", 0, INT32_MAX): check_real(value, "logit_bias", -MAX_BIAS, MAX_BIAS)
            for token, value in bias.items()}
