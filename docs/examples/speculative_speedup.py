"""Tokens per step against the draft's agreement with the target, counted in steps."""

import numpy as np

from reference import ReferenceEngine, SamplingParams
from reference.speculative import DraftModelProposer
from reference.tutorial.tiny_llama import tiny_llama  # 2 layers, 4 heads, 32 tokens

PROMPT, NUM_DECODED = [1, 2, 3, 4], 400
GREEDY = SamplingParams(temperature=0, max_tokens=1 + NUM_DECODED)  # 1 from prefill
RATES, KS = [0.2, 0.4, 0.6, 0.8, 0.9], [1, 2, 4]
CACHE = dict(num_blocks=8, block_size=64)  # large blocks: fewer to walk, same steps
target = tiny_llama()
[plain] = ReferenceEngine(target, **CACHE).generate([PROMPT], GREEDY)
answer = PROMPT + plain.output_token_ids  # the target's greedy token at each position


class AgreeingDraft:
    """A stand-in draft model: at each position it proposes the target's greedy token
    with probability `rate` (a coin fixed by the seed and the position), another token
    otherwise."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate, self.seed = rate, seed

    def last_logits(self, token_ids: list[int]) -> np.ndarray:
        position = len(token_ids)
        logits = np.eye(target.config.vocab_size)[answer[position]]
        agrees = np.random.default_rng([self.seed, position]).random() < self.rate
        return logits if agrees else np.roll(logits, 1)  # the argmax moves one id up


def measure(k: int, rate: float, seed: int) -> tuple[int, float]:
    """Decode steps for NUM_DECODED tokens, and the engine's accepted / drafted."""
    proposer = DraftModelProposer(AgreeingDraft(rate, seed), k)
    engine = ReferenceEngine(target, **CACHE, proposer=proposer)
    [out] = engine.generate([PROMPT], GREEDY)
    assert out.output_token_ids == plain.output_token_ids  # same tokens, fewer steps
    return len(engine.trace) - 1, engine.num_accepted_tokens / engine.num_draft_tokens


def expected(k: int, rate: float) -> float:
    """Tokens a step emits on average when each draft agrees with probability rate."""
    return (1 - rate ** (k + 1)) / (1 - rate)


print(f"{NUM_DECODED} tokens take {len(plain.output_token_ids) - 1} decode steps "
      "without drafts")
print(" k  agreement  steps  tokens/step  expected  accepted/drafted")
measured = {}
for k in KS:
    for seed, rate in enumerate(RATES):
        steps, acceptance = measure(k, rate, seed=10 * k + seed)
        measured[k, rate] = NUM_DECODED / steps
        print(f"{k:>2}  {rate:>9}  {steps:>5}  {measured[k, rate]:>11.2f}  "
              f"{expected(k, rate):>8.2f}  {acceptance:>16.2f}")
