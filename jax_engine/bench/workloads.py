"""Synthetic request traces for benchmarks: fixed lengths, or lengths whose means match real traces.

The PagedAttention paper's traces: ShareGPT (mean input 161, output 338 tokens) and Alpaca (19 and 58).
Lengths are drawn from a log-normal (long-tailed, like real conversations) rescaled to the target mean.
"""

import numpy as np

LENGTH_MODES = {"sharegpt-like": (161, 338), "alpaca-like": (19, 58)}


def _lengths(rng: np.random.Generator, mean: int, count: int, low: int, high: int) -> np.ndarray:
    raw = rng.lognormal(0.0, 0.7, count)
    lengths = np.clip(np.round(raw / raw.mean() * mean), low, high).astype(int)
    return lengths


def request_lengths(num_requests: int, mode: str, max_model_len: int, input_len: int | None = None,
                    output_len: int | None = None, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
    """(input lengths, output lengths, the generator for what is drawn next) of a seeded trace.

    Args:
        mode: "fixed" (input_len / output_len) or one of LENGTH_MODES.
    """
    rng = np.random.default_rng(seed)
    if mode == "fixed":
        if not input_len or not output_len:
            raise ValueError("length mode 'fixed' needs --input-len and --output-len")
        inputs, outputs = np.full(num_requests, input_len), np.full(num_requests, output_len)
    elif mode in LENGTH_MODES:
        mean_in, mean_out = LENGTH_MODES[mode]
        inputs = _lengths(rng, mean_in, num_requests, 4, max_model_len // 2)
        outputs = _lengths(rng, mean_out, num_requests, 4, max_model_len // 2)
    else:
        raise ValueError(f"length mode must be 'fixed' or one of {list(LENGTH_MODES)}, got {mode!r}")
    if (inputs + outputs).max() > max_model_len:
        raise ValueError(f"input + output length {(inputs + outputs).max()} exceeds max_model_len={max_model_len}")
    return inputs, outputs, rng


def make_requests(num_requests: int, mode: str, vocab_size: int, max_model_len: int, input_len: int | None = None,
                  output_len: int | None = None, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs; prompts are random ids avoiding the first 100 (specials)."""
    inputs, outputs, rng = request_lengths(num_requests, mode, max_model_len, input_len, output_len, seed)
    return [(rng.integers(100, vocab_size, n).tolist(), int(o)) for n, o in zip(inputs, outputs)]
