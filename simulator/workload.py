"""What arrives: request arrival times and lengths, drawn for a seed or read from a trace.

The paper's datasets (its Fig. 11): ShareGPT conversations, prompts of 161 tokens on average and outputs of 338;
Alpaca instructions, 19 and 58. The paper shows their histograms, not parameters, so the lengths here are
log-normal with those means and a spread `sigma` of 0.8 (a coefficient of variation near 1, as the histograms'
long tails show), capped so that a request fits max_model_len. Arrivals are a Poisson process (exponential gaps),
or burstier with a gamma of shape below 1, as vLLM's benchmark_serving draws them (`--burstiness`).
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Lengths:
    """Log-normal prompt and output lengths with these means and spread."""

    prompt_mean: float
    output_mean: float
    sigma: float

    def draw(self, rng: np.random.Generator, count: int, max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
        def lognormal(mean: float) -> np.ndarray:
            return rng.lognormal(math.log(mean) - self.sigma**2 / 2, self.sigma, count)

        prompts = np.clip(np.rint(lognormal(self.prompt_mean)), 1, max_model_len - 1).astype(int)
        outputs = np.clip(np.rint(lognormal(self.output_mean)), 1, max_model_len - prompts).astype(int)
        return prompts, outputs


DATASETS = {"sharegpt": Lengths(161.31, 337.99, 0.8), "alpaca": Lengths(19.31, 58.45, 0.8)}


def synthetic(dataset: str, rate: float, num_requests: int, seed: int = 0, max_model_len: int = 2048,
              burstiness: float = 1.0) -> list[TraceRequest]:
    """`num_requests` requests of `dataset`'s lengths arriving at `rate` per second on average (gaps drawn from a
    gamma of shape `burstiness`: 1 is Poisson, below 1 burstier); the same for the same seed."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {sorted(DATASETS)} or a JSONL trace, got {dataset!r}")
    if rate <= 0 or num_requests < 1 or burstiness <= 0:
        raise ValueError(f"need rate > 0, num_requests >= 1 and burstiness > 0; got {rate}, {num_requests}, "
                         f"{burstiness}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.gamma(burstiness, 1 / (rate * burstiness), num_requests))
    prompts, outputs = DATASETS[dataset].draw(rng, num_requests, max_model_len)
    return [TraceRequest(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs)]


def load_trace(path: str | Path) -> list[TraceRequest]:
    """A JSONL trace: one {"arrival": seconds, "prompt_len": tokens, "output_len": tokens} per line."""
    if not Path(path).is_file():
        raise ValueError(f"dataset must be one of {sorted(DATASETS)} or a JSONL trace file; no file {str(path)!r}")
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            try:
                requests.append(TraceRequest(float(row["arrival"]), int(row["prompt_len"]), int(row["output_len"])))
            except KeyError as missing:
                raise ValueError(f"{path}:{number}: a trace line needs arrival, prompt_len and output_len; "
                                 f"{missing} is missing") from None
    return sorted(requests, key=lambda r: r.arrival_s)
