"""`jax-engine bench preemption`: a workload that overflows a small KV cache, preempting by recompute or by swap.

    jax-engine bench preemption --num-requests 32 --input-len 64 --output-len 64 --cache-tokens 1024 \\
        --block-sizes 16 32 64

The PagedAttention paper's Figure 19 compares the two ways to preempt by block size. Here every request
arrives at once and generates exactly its output length (EOS ignored) in a cache of `--cache-tokens` tokens,
so that the engine must preempt. Each (block size, mode) gets a fresh engine with prefix caching off (a
recomputed sequence then really computes its tokens again) and serves the workload twice: the first run
compiles the step shapes, the second is measured. Reported: its time (less any compile time left in it),
the mean latency per output token of a request (the paper's normalized latency), the preemptions, the
tokens computed again (recompute), and the blocks swapped and the time spent copying them (swap).
"""

import argparse
import time

import numpy as np

from jax_engine.bench.workloads import LENGTH_MODES, make_requests
from jax_engine.config import EngineArgs
from jax_engine.loader import load_checkpoint

MODES = ("recompute", "swap")


def run_one(checkpoint, requests, block_size: int, mode: str, ns: argparse.Namespace) -> dict:
    """Serve `requests` twice on a fresh engine; the figures of the second run."""
    import jax

    from jax_engine import LLM, LLMEngine, SamplingParams

    args = EngineArgs.from_cli_args(ns, block_size=block_size, num_gpu_blocks_override=ns.cache_tokens // block_size,
                                    preemption_mode=mode, enable_prefix_caching=False)
    engine = LLMEngine(args, checkpoint=checkpoint)
    llm = LLM.from_engine(engine)

    def params(batch):
        return [SamplingParams(temperature=1.0, seed=i, max_tokens=o, ignore_eos=True)
                for i, (_, o) in enumerate(batch)]

    # A first run compiles the step shapes, so the measured run is the engine's own speed. Prefix caching is
    # off: the second run computes everything again, preempting at the same steps.
    llm.generate([p for p, _ in requests], params(requests), use_tqdm=False)
    compiled_before, preempted_before, steps_before = (engine.stats()["compile_seconds"],
                                                       engine.scheduler.num_preemptions, engine.num_steps)
    trace = engine.enable_trace()
    moves = {"seconds": 0.0, "blocks": 0}
    apply_block_moves = engine.runner.apply_block_moves

    def timed_moves(out) -> None:  # the swap traffic, timed to completion
        started = time.perf_counter()
        apply_block_moves(out)
        jax.block_until_ready((engine.runner.k_cache, engine.runner.v_cache))
        moves["seconds"] += time.perf_counter() - started
        moves["blocks"] += len(out.swap_out) + len(out.swap_in)

    engine.runner.apply_block_moves = timed_moves
    started = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params(requests), use_tqdm=False)
    elapsed = time.perf_counter() - started
    compile_s = engine.stats()["compile_seconds"] - compiled_before
    computed = sum(n for step in trace for _, n in step.scheduled)
    needed = sum(len(p) + o - 1 for p, o in requests)  # the last sampled token is never computed
    normalized = [(o.metrics.finished_time - o.metrics.arrival_time) / len(o.outputs[0].token_ids) for o in outputs]
    return dict(block_size=block_size, preemption_mode=mode, num_blocks=args.num_gpu_blocks_override,
                elapsed_s=elapsed, compile_s=compile_s, run_s=elapsed - compile_s,
                mean_normalized_latency_s=float(np.mean(normalized)), num_steps=engine.num_steps - steps_before,
                num_preemptions=engine.scheduler.num_preemptions - preempted_before,
                recomputed_tokens=computed - needed,
                swapped_blocks=moves["blocks"], swap_s=moves["seconds"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--length-mode", default="fixed", choices=["fixed", *LENGTH_MODES])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--cache-tokens", type=int, default=1024, help="KV cache size, in tokens (all block sizes)")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--json-out", default=None, help="also append the report to this JSON file")
    # The cache is --cache-tokens in blocks of each --block-sizes, in each of --modes, with no prefix sharing.
    EngineArgs.add_cli_args(parser, exclude=("block_size", "num_gpu_blocks_override", "preemption_mode",
                                             "enable_prefix_caching"), max_model_len=512, max_num_seqs=64)


def main(ns: argparse.Namespace) -> list[dict]:
    if ns.cache_tokens < ns.max_model_len:
        raise ValueError(f"--cache-tokens ({ns.cache_tokens}) must hold one request of --max-model-len "
                         f"({ns.max_model_len})")
    checkpoint = load_checkpoint(ns.model)
    requests = make_requests(ns.num_requests, ns.length_mode, checkpoint.config.vocab_size, ns.max_model_len,
                             ns.input_len, ns.output_len, ns.seed)
    print(f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt and "
          f"{sum(o for _, o in requests)} output tokens, in a cache of {ns.cache_tokens} tokens")
    print(f"{'block size':>10}{'mode':>11}{'run s':>8}{'s/token':>9}{'preempted':>11}{'recomputed':>12}"
          f"{'swapped':>9}{'swap s':>8}{'compile s':>11}")
    results = []
    for block_size in ns.block_sizes:
        for mode in ns.modes:
            r = run_one(checkpoint, requests, block_size, mode, ns)
            results.append(r)
            print(f"{block_size:>10}{mode:>11}{r['run_s']:>8.1f}{r['mean_normalized_latency_s']:>9.3f}"
                  f"{r['num_preemptions']:>11}{r['recomputed_tokens']:>12}{r['swapped_blocks']:>9}"
                  f"{r['swap_s']:>8.2f}{r['compile_s']:>11.1f}", flush=True)
    if ns.json_out:
        from jax_engine.bench.kernels import record_run

        workload = dict(num_requests=len(requests), length_mode=ns.length_mode, input_len=ns.input_len,
                        output_len=ns.output_len, cache_tokens=ns.cache_tokens, max_num_seqs=ns.max_num_seqs)
        record_run(ns.json_out, {"workload": workload, "results": results})
    return results
