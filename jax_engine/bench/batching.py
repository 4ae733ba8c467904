"""Decode throughput against batch size: one step reads the weights once for the whole batch.

    jax-engine bench batching [--batch-sizes 1 2 4 ... 256] [--prompt-len 16] [--decode-steps 16] \
        [--out docs/figures/data/batching.json]

For each batch size B, B requests with random prompts are prefilled, then `--decode-steps` steps in which all B
sequences decode one token each are timed one by one (`LLMEngine.step`: scheduling, the model, sampling and
bookkeeping). The first step of each new shape compiles it (about 2 s on CPU with the layers unrolled): such a
step is timed apart as compile time and left out of the decode rate, because it is paid once per shape, not per
token (a server compiles its shapes at start-up or keeps them in jax's persistent cache). The rate is B tokens
over the median step time. The tutorial's first page draws `docs/figures/data/batching.json` (see
docs/figures/memory_bound_batching.py).

Bounds, from a probe of this machine (jax_engine/bench/roofline.py) before and after the runs, the better of the
two: a decode step must read every weight once and every sequence's K/V once, so at batch B it takes at least
(weight bytes + B x context x KV bytes per token) / bandwidth; and it must compute 2 x params FLOPs per token, so
B tokens take at least B x 2 x params / peak.
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

import numpy as np

from jax_engine.bench import roofline
from jax_engine.config import EngineArgs
from reference.block_manager import cdiv

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Set by the experiment (room for the largest batch, no prefix sharing between prompts), not by flags.
FIXED_ENGINE_ARGS = ("max_model_len", "max_num_seqs", "enable_prefix_caching", "max_num_batched_tokens",
                     "kv_cache_memory_bytes")
TOKEN_BUDGET = 2048  # tokens per step (max_num_batched_tokens): the prompts of a large batch take a few steps


def output_len(batch_size: int, prompt_len: int, decode_steps: int) -> int:
    """Tokens each request generates: enough that nobody finishes before the timed steps are done.

    The prompts are prefilled over several steps (the first prefilled start decoding before the last), and a
    few steps compile; eight spare steps cover those.
    """
    return decode_steps + cdiv(batch_size * prompt_len, TOKEN_BUDGET) + 8


def _machine() -> str:
    import jax

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor() or platform.machine()) if os.path.exists("/proc/cpuinfo") else platform.machine()
    device = jax.devices()[0]
    return (f"{os.cpu_count()} CPU cores ({cpu}), {device.platform} device {device.device_kind!r}, "
            f"Python {platform.python_version()}, jax {jax.__version__}")


def time_batch(engine, batch_size: int, prompt_len: int, decode_steps: int, rng: np.random.Generator,
               lora_requests: list | None = None) -> dict:
    """Prefill `batch_size` random prompts, then time `decode_steps` full-batch decode steps (compiles apart).
    Request i runs with lora_requests[i mod their count], if given (a None in it: the base model)."""
    from jax_engine import SamplingParams

    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_len(batch_size, prompt_len, decode_steps), ignore_eos=True)
    ids = [f"b{batch_size}-{i}" for i in range(batch_size)]
    adapters = lora_requests or [None]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, {"prompt_token_ids": rng.integers(100, vocab, prompt_len).tolist()}, params,
                           lora_request=adapters[i % len(adapters)])
    trace = engine.enable_trace()
    step_seconds, compile_seconds, contexts = [], 0.0, []
    while len(step_seconds) < decode_steps:
        assert engine.has_unfinished_requests(), "requests finished before the decode steps were timed"
        compiled_before = engine.runner.compile_seconds
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        scheduled = trace[-1].scheduled
        if engine.runner.compile_seconds > compiled_before:  # this step compiled a new shape
            compile_seconds += elapsed
        elif len(scheduled) == batch_size and all(n == 1 for _, n in scheduled):
            step_seconds.append(elapsed)
            contexts.append(np.mean([r.num_computed_tokens for r in engine.scheduler.running]))
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    median = statistics.median(step_seconds)
    return dict(batch_size=batch_size, tokens_per_s=batch_size / median, median_step_s=median,
                min_step_s=min(step_seconds), max_step_s=max(step_seconds), timed_steps=len(step_seconds),
                mean_context=float(np.mean(contexts)), compile_s=compile_seconds)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(DEFAULT_BATCH_SIZES))
    parser.add_argument("--prompt-len", type=int, default=16, help="short, so the weights dominate each step")
    parser.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per batch size")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write the report as JSON to this file")
    EngineArgs.add_cli_args(parser, exclude=FIXED_ENGINE_ARGS)


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run."""
    parts = ["jax-engine bench batching", "--batch-sizes", *map(str, args.batch_sizes), "--prompt-len",
             str(args.prompt_len), "--decode-steps", str(args.decode_steps)]
    if args.model:
        parts += ["--model", args.model]
    if args.attention_backend != "auto":
        parts += ["--attention-backend", args.attention_backend]
    if args.out:
        parts += ["--out", str(args.out)]
    return " ".join(parts)


def main(args: argparse.Namespace) -> dict:
    from jax_engine import LLMEngine
    from jax_engine.kv_cache_plan import bytes_per_block
    from jax_engine.loader import load_checkpoint

    checkpoint = load_checkpoint(args.model)
    cfg = checkpoint.config
    largest = max(args.batch_sizes)
    max_model_len = args.prompt_len + output_len(largest, args.prompt_len, args.decode_steps)
    # Room for every sequence of the largest batch at once (float32 K/V, plus blocks' rounding): no preemption.
    cache_bytes = largest * (max_model_len + 128) * bytes_per_block(cfg, 1, "float32")
    engine_args = EngineArgs.from_cli_args(args, max_model_len=max_model_len, max_num_seqs=largest,
                                           enable_prefix_caching=False, max_num_batched_tokens=TOKEN_BUDGET,
                                           kv_cache_memory_bytes=cache_bytes)
    engine = LLMEngine(engine_args, checkpoint=checkpoint)
    probe_before = roofline.measure(cfg.num_params)
    rng = np.random.default_rng(args.seed)
    results = []
    for batch_size in sorted(args.batch_sizes):
        result = time_batch(engine, batch_size, args.prompt_len, args.decode_steps, rng)
        results.append(result)
        print(f"batch {batch_size:>4}: {result['tokens_per_s']:8.1f} tokens/s  (median step "
              f"{result['median_step_s'] * 1e3:7.1f} ms over {result['timed_steps']} steps, context "
              f"{result['mean_context']:.0f}; compile {result['compile_s']:.1f} s, not counted)", flush=True)
    bounds = roofline.best(probe_before, roofline.measure(cfg.num_params))
    itemsize = np.dtype(engine.dtype).itemsize
    report = dict(
        command=command_line(args), machine=_machine(),
        model="SmolLM2-135M-Instruct" if args.model is None else args.model,
        attention_backend=engine.attention_backend.name, dtype=str(np.dtype(engine.dtype)), prompt_len=args.prompt_len,
        decode_steps=args.decode_steps, num_params=cfg.num_params, weight_bytes=cfg.num_params * itemsize,
        kv_bytes_per_token=bytes_per_block(cfg, 1, engine.runner.k_cache.dtype), roofline=bounds.__dict__,
        results=results)
    print(f"probe: matmul {bounds.matmul_gflops:.0f} GFLOP/s, memory {bounds.bandwidth_gbps:.1f} GB/s -> "
          f"compute bound {bounds.compute_bound_tokens_per_s:.0f} tokens/s, bandwidth bound at batch 1 "
          f"{bounds.bandwidth_bound_tokens_per_s:.0f} tokens/s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return report
