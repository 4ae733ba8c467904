"""The engine's input hardening (jax_engine/input_checks.py): strict types, finite numbers, bounded sizes, and
messages that name the field and its limit. The oracle keeps only a plain range check (tests/test_reference_engine.py)."""

import ast
import math
import pathlib

import numpy as np
import pytest

from jax_engine import SamplingParams
from jax_engine.input_checks import check_bool, check_int, check_real, is_int, is_unicode, token_id_tuple

ROOT = pathlib.Path(__file__).parents[1]


@pytest.mark.parametrize("field, value, limit", [
    ("temperature", math.nan, r"a number in \[0, 3.40282e\+38\]"),
    ("temperature", math.inf, r"a number in \[0, 3.40282e\+38\]"),
    ("temperature", -0.5, r"a number in \[0, 3.40282e\+38\]"),
    ("top_p", 0.0, r"a number in \(0, 1\]"),
    ("top_p", 1.5, r"a number in \(0, 1\]"),
    ("top_k", -2, r"an integer in \[-1, 2147483647\]"),
    ("min_p", 2.0, r"a number in \[0, 1\]"),
    ("max_tokens", 0, "an integer >= 1 or None"),
    ("max_tokens", 2.0, "an integer >= 1 or None"),
    ("ignore_eos", 1, "true or false"),
    ("seed", 2**64, "a 64-bit integer or None"),
    ("stop_token_ids", [True], r"an integer in \[0, 2147483647\]"),
])
def test_bad_sampling_params_name_the_field_and_limit(field, value, limit):
    with pytest.raises(ValueError, match=f"{field} must be {limit}"):
        SamplingParams(**{field: value})


def test_token_controls_are_checked():
    with pytest.raises(ValueError, match="logit_bias must be a number in"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="logit_bias must be a dict of at most 300"):
        SamplingParams(logit_bias={i: 1.0 for i in range(301)})
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words_token_ids must be non-empty token-id sequences"):
        SamplingParams(bad_words_token_ids=[[]])
    with pytest.raises(ValueError, match="bad_words_token_ids must be at most 256"):
        SamplingParams(bad_words_token_ids=[[1]] * 257)


def test_checked_fields_are_stored_in_their_normal_form():
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), stop_token_ids=[np.int32(7)],
                            allowed_token_ids=[1, 2], bad_words_token_ids=[[4, 3]], logit_bias={np.int64(1): 2})
    assert type(params.temperature) is float and type(params.top_k) is int
    assert params.stop_token_ids == (7,) and type(params.stop_token_ids[0]) is int
    assert params.allowed_token_ids == (1, 2) and params.bad_words_token_ids == ((4, 3),)
    assert params.logit_bias == {1: 2.0} and type(next(iter(params.logit_bias))) is int


def test_the_helpers_refuse_coercions():
    assert is_int(3) and is_int(np.int32(3)) and not is_int(True) and not is_int(3.0)
    assert check_int(np.int64(5), "n", 1) == 5
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 4\], got 5"):
        check_int(5, "n", 1, 4)
    assert check_int(None, "n", 1, optional=True) is None
    with pytest.raises(ValueError, match=r"x must be a number in \(0, 1\]"):
        check_real(0, "x", 0, 1, low_open=True)
    with pytest.raises(ValueError, match="flag must be true or false"):
        check_bool("yes", "flag")
    assert not is_unicode("a\ud800b") and is_unicode("héllo")
    with pytest.raises(ValueError, match="ids must be a list of at most 2 token ids"):
        token_id_tuple([1, 2, 3], "ids", 2)


def test_error_messages_cut_huge_values_short():
    with pytest.raises(ValueError) as error:
        check_int(10**500, "max_tokens", 1, 100)
    assert "an integer of 1661 bits" in str(error.value)
    with pytest.raises(ValueError) as error:
        check_bool("x" * 10**6, "ignore_eos")
    assert len(str(error.value)) < 200 and "(1000002 characters)" in str(error.value)


def test_the_engine_takes_no_input_hardening_from_the_oracle():
    """reference/ is the oracle and the tutorial's source: the engine imports its contract types (RequestStatus,
    SchedulerConfig, block hashes) from it, never its input checks."""
    hardening = {"check", "check_int", "check_real", "check_bool", "is_int", "is_unicode", "token_id_tuple",
                 "MAX_LOGIT_BIAS", "MAX_BAD_WORDS", "MAX_STOP_TOKEN_IDS", "INT32_MAX", "FLOAT32_MAX"}
    offenders = []
    for path in sorted((ROOT / "jax_engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("reference"):
                offenders += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name in hardening]
    assert offenders == []
