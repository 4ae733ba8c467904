"""`jax-engine bench throughput`: offline throughput on a synthetic trace, side by side with HF transformers.

    jax-engine bench throughput --length-mode sharegpt-like --num-requests 256 --compare hf

Every request samples (temperature 1) exactly its output length (EOS ignored), as vLLM's benchmark does; with
--top-k / --top-p / --min-p, through those filters too (on both sides of --compare hf).
Throughput counts the requested prompt and output tokens; compile time is reported apart from run time.
"""

import argparse
import json
import sys
import time

import numpy as np

from jax_engine.bench import roofline, sampling_filters
from jax_engine.bench.workloads import LENGTH_MODES, make_requests
from jax_engine.config import EngineArgs
from jax_engine.loader import load_checkpoint


def run_engine(checkpoint, requests, engine_args: EngineArgs, runs: int, sampling: dict):
    """Yield the result of each run of the workload, all in one engine started once, every request sampled with
    `sampling` (sampling_filters.sampling: temperature 1 and the filters).

    Between runs the prefix cache is reset, so a later run computes the same prompts again as the first did;
    what differs is only what the first run met for the first time (compiles, first calls of programs).
    Counts (steps, compilations, preemptions, prefix hits) are per run; mean batch and KV usage since start-up.
    """
    from jax_engine import LLM, LLMEngine, SamplingParams

    engine = LLMEngine(engine_args, checkpoint=checkpoint)
    llm = LLM.from_engine(engine)
    params = [SamplingParams(**sampling, seed=i, max_tokens=o, ignore_eos=True) for i, (_, o) in enumerate(requests)]
    for run in range(1, runs + 1):
        before = engine.stats()
        started = time.perf_counter()
        llm.generate([p for p, _ in requests], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        stats = engine.stats()
        compile_s = stats["compile_seconds"] - before["compile_seconds"]
        yield dict(backend="jax_engine" if run == 1 else f"jax_engine, run {run}",
                   attention_backend=engine.attention_backend.name, elapsed_s=elapsed, compile_s=compile_s,
                   run_s=elapsed - compile_s, num_steps=stats["num_steps"] - before["num_steps"],
                   mean_batch_size=stats["mean_batch_size"], mean_kv_cache_usage=stats["mean_kv_cache_usage"],
                   num_preemptions=stats["num_preemptions"] - before["num_preemptions"],
                   num_compilations=stats["num_compilations"] - before["num_compilations"],
                   prefix_cache_hits=stats["prefix_cache_hits"] - before["prefix_cache_hits"])
        llm.reset_prefix_cache()


HF_MODES = ("static", "continuous")


def run_hf(checkpoint, requests, batch_size: int, modes, sampling: dict):
    """Yield each HF way of running the workload's result as it finishes (sampling as run_engine's)."""
    import torch

    from jax_engine.bench.hf_baseline import hf_model_from_checkpoint, run_continuous_batching, run_static_batches

    torch.set_num_threads(torch.get_num_threads())
    model = hf_model_from_checkpoint(checkpoint)
    if "static" in modes:
        static = run_static_batches(model, requests, batch_size, sampling=sampling)
        yield dict(backend=f"hf generate (static batches of {batch_size})", elapsed_s=static, run_s=static)
    if "continuous" in modes:
        continuous, generated = run_continuous_batching(model, requests, sampling)
        yield dict(backend="hf generate_batch (continuous)", elapsed_s=continuous, run_s=continuous,
                   generated_tokens=generated)


def _rates(result: dict, requests) -> dict:
    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = result.get("generated_tokens", sum(o for _, o in requests))
    seconds = result["run_s"]
    return dict(result, num_requests=len(requests), requests_per_s=len(requests) / seconds,
                output_tokens_per_s=output_tokens / seconds,
                total_tokens_per_s=(prompt_tokens + output_tokens) / seconds)


def _finished(result: dict) -> dict:
    # On stderr as each backend finishes: a long comparison that is cut short still leaves its figures.
    print(f"finished {result['backend']}: {result['total_tokens_per_s']:.1f} total tok/s "
          f"({result['run_s']:.1f} s)", file=sys.stderr, flush=True)
    return result


def main(ns: argparse.Namespace) -> dict:
    checkpoint = load_checkpoint(ns.model)
    requests = make_requests(ns.num_requests, ns.length_mode, checkpoint.config.vocab_size, ns.max_model_len,
                             ns.input_len, ns.output_len, ns.seed)
    if ns.prompt_kind == "text":  # round-trip through text, as a user's prompts would arrive
        tok = checkpoint.tokenizer
        requests = [(tok.encode(tok.decode(p)), o) for p, o in requests]
        requests = [(p[: ns.max_model_len - o], o) for p, o in requests]
    results, sampling = [], sampling_filters.sampling(ns)
    probe_before = roofline.measure(checkpoint.config.num_params)
    if ns.backend == "jax_engine" or ns.compare == "hf":
        for result in run_engine(checkpoint, requests, EngineArgs.from_cli_args(ns), ns.runs, sampling):
            results.append(_finished(_rates(result, requests)))
    if ns.backend == "hf" or ns.compare == "hf":
        # HF may run a prefix of the same trace: its rate per token is what is compared, and on a long trace
        # its padded static batches would take hours.
        hf_requests = requests[: ns.hf_num_requests or len(requests)]
        for result in run_hf(checkpoint, hf_requests, ns.hf_batch_size, ns.hf_modes, sampling):
            results.append(_finished(_rates(result, hf_requests)))
    bounds = roofline.best(probe_before, roofline.measure(checkpoint.config.num_params))
    report = dict(workload=dict(length_mode=ns.length_mode, num_requests=len(requests),
                                mean_input_len=float(np.mean([len(p) for p, _ in requests])),
                                mean_output_len=float(np.mean([o for _, o in requests])), sampling=sampling),
                  roofline=bounds.__dict__, results=results)
    print_report(report) if not ns.json else print(json.dumps(report, indent=2))
    return report


def print_report(report: dict) -> None:
    w, r = report["workload"], report["roofline"]
    print(f"workload: {w['num_requests']} requests, {w['length_mode']}, mean input {w['mean_input_len']:.0f} / "
          f"output {w['mean_output_len']:.0f} tokens, sampling "
          + ", ".join(f"{name} {value}" for name, value in w["sampling"].items()))
    print(f"roofline: matmul {r['matmul_gflops']:.0f} GFLOP/s, memory {r['bandwidth_gbps']:.1f} GB/s -> "
          f"compute bound {r['compute_bound_tokens_per_s']:.0f} tokens/s (large batch), bandwidth bound "
          f"{r['bandwidth_bound_tokens_per_s']:.0f} tokens/s (batch 1)")
    print(f"{'backend':<38}{'requests':>9}{'req/s':>8}{'out tok/s':>11}{'total tok/s':>13}{'of roofline':>13}"
          f"{'run s':>9}{'compile s':>11}")
    for x in report["results"]:
        print(f"{x['backend']:<38}{x['num_requests']:>9}{x['requests_per_s']:>8.2f}{x['output_tokens_per_s']:>11.1f}"
              f"{x['total_tokens_per_s']:>13.1f}{x['total_tokens_per_s'] / r['compute_bound_tokens_per_s']:>13.1%}"
              f"{x['run_s']:>9.1f}{x.get('compile_s', 0.0):>11.1f}")
    engine = next((x for x in report["results"] if x["backend"] == "jax_engine"), None)
    if engine:
        print(f"jax_engine ({engine['attention_backend']} attention): mean batch {engine['mean_batch_size']:.1f} "
              f"sequences, mean KV cache usage "
              f"{engine['mean_kv_cache_usage']:.1%}, {engine['num_preemptions']} preemptions, "
              f"{engine['num_compilations']} compilations, {engine['num_steps']} steps")
        later = [x for x in report["results"] if x["backend"].startswith("jax_engine, run")]
        if later:
            print(f"jax_engine run time: first run {engine['run_s']:.1f} s, "
                  + ", ".join(f"run {i + 2} {x['run_s']:.1f} s (first / this: {engine['run_s'] / x['run_s']:.2f})"
                              for i, x in enumerate(later)))
        peers = [x for x in report["results"] if not x["backend"].startswith("jax_engine")]
        if peers:
            best = max(peers, key=lambda x: x["total_tokens_per_s"])
            print(f"jax_engine / best HF ({best['backend']}): {engine['total_tokens_per_s'] / best['total_tokens_per_s']:.2f}x")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--length-mode", default="sharegpt-like", choices=["fixed", *LENGTH_MODES])
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--prompt-kind", default="ids", choices=["ids", "text"])
    parser.add_argument("--backend", default="jax_engine", choices=["jax_engine", "hf"])
    parser.add_argument("--compare", default=None, choices=["hf"])
    sampling_filters.add_arguments(parser)
    parser.add_argument("--runs", type=int, default=1,
                        help="run the workload this many times in one engine (the prefix cache reset between "
                             "runs): the first run against later ones shows what it paid for meeting things first")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--hf-num-requests", type=int, default=None,
                        help="run HF on only the first N requests of the trace (default: all)")
    parser.add_argument("--hf-modes", nargs="+", default=list(HF_MODES), choices=HF_MODES,
                        help="static: generate on padded batches; continuous: generate_batch, which runs every "
                             "request to the longest output length (slow on long-tailed workloads)")
    # The engine's flags, and the seed of the workload; the workload's longest request is max_model_len.
    EngineArgs.add_cli_args(parser, max_model_len=2048)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
