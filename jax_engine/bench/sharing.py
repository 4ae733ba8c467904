"""Memory saved by sharing KV blocks: parallel sampling and beam search on an Alpaca-like workload.

The paper (Figure 15, OPT-13B on Alpaca) reports 6.1-9.8% saved for parallel sampling and 37.6-55.2% for
beam search. Saved = 1 - (physical blocks held) / (blocks the same sequences would hold without sharing),
averaged over every engine step.

    jax-engine bench sharing [--num-prompts 8] [--block-size 16]
"""

import argparse
import time

import numpy as np

from jax_engine import LLM, BeamSearchParams, EngineArgs, LLMEngine, SamplingParams
from jax_engine.loader import load_checkpoint

PAPER = {"parallel sampling": "6.1-9.8%", "beam search": "37.6-55.2%"}


def alpaca_like_prompts(num_prompts: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token prompts whose lengths average 19 tokens, like Alpaca instructions."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.poisson(19, num_prompts), 4, 60)
    return [rng.integers(100, vocab_size, n).tolist() for n in lengths]


def saved(checkpoint, args, prompts, params) -> tuple[float, float]:
    engine = LLMEngine(EngineArgs.from_cli_args(args), checkpoint=checkpoint)
    started = time.perf_counter()
    LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
    return engine.stats()["memory_saved_by_sharing"], time.perf_counter() - started


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=58, help="Alpaca's mean output length")
    # Room for every sequence of the widest request at once: what is measured is sharing, not preemption.
    EngineArgs.add_cli_args(parser, block_size=16, max_model_len=256, num_gpu_blocks_override=4096)


def main(args: argparse.Namespace) -> None:
    checkpoint = load_checkpoint(args.model)
    prompts = alpaca_like_prompts(args.num_prompts, checkpoint.config.vocab_size)
    print(f"{len(prompts)} prompts, mean length {np.mean([len(p) for p in prompts]):.1f}, "
          f"{args.output_len} output tokens, block size {args.block_size}")
    print(f"{'workload':<22}{'width':>6}{'saved (ours)':>14}{'saved (paper)':>15}{'seconds':>9}")
    for kind, width in [("parallel sampling", w) for w in (2, 4, 6)] + [("beam search", w) for w in (2, 4, 6)]:
        if kind == "parallel sampling":
            params = SamplingParams(n=width, temperature=1.0, seed=0, max_tokens=args.output_len, ignore_eos=True)
        else:
            params = BeamSearchParams(beam_width=width, max_tokens=args.output_len, ignore_eos=True)
        fraction, seconds = saved(checkpoint, args, prompts, params)
        print(f"{kind:<22}{width:>6}{fraction:>13.1%}{PAPER[kind]:>15}{seconds:>9.1f}")

