"""Structured output's cost: the grammar masks on the host, and decoding with 0, 1 or every row constrained.

Mask time is llguidance's bitmask fill for one row over the model's vocabulary, step by step along a JSON
answer to a schema with nested objects, arrays and enums (what each decode step asks of the host per
constrained row); with `--compare xgrammar` the same walk through xgrammar, when it is installed (it needs
torch, which the engine does not: why llguidance is the engine's library, docs/structured-output.md).

Step time: B greedy requests of --output-len tokens, none, one or all of them held by a JSON schema that
cannot close before they end (a long array), timed over the decode steps after a warm-up run. Throughput:
--num-requests seeded requests at temperature 1, each asked for a person as JSON, with and without the
schema, output tokens per second over the whole run.
"""

import argparse
import json
import time

import numpy as np

from jax_engine.config import EngineArgs

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 4}},
    "required": ["name", "age", "address", "pets"]}
ANSWER = {"name": "Ada Lovelace", "age": 36, "address": {"city": "London", "zip": "12345"}, "pets": ["cat", "dog"]}
# Open for the whole run: at least 64 objects before the array may close.
LONG_ARRAY = {"type": "array", "minItems": 64, "items": PERSON}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (step-time runs)")
    parser.add_argument("--output-len", type=int, default=48, help="generated tokens per request (step-time runs)")
    parser.add_argument("--num-requests", type=int, default=32, help="requests of the throughput run")
    parser.add_argument("--compare", nargs="*", default=[], choices=["xgrammar"], help="grammar libraries to time "
                        "beside llguidance (installed separately)")
    EngineArgs.add_cli_args(parser, exclude=("max_num_seqs", "max_model_len"))


def llguidance_mask_times(engine) -> list[float]:
    """Seconds per bitmask fill along ANSWER's tokens, through the engine's own GrammarCompiler."""
    from jax_engine.structured_output import StructuredOutputsParams

    compiler = engine.grammar_compiler
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(json=PERSON)))
    times = []
    for token in engine.tokenizer.encode(json.dumps(ANSWER), add_special_tokens=False):
        started = time.perf_counter()
        compiler.fill_bitmask([matcher])
        times.append(time.perf_counter() - started)
        matcher.accept(token)
    return times


def xgrammar_mask_times(engine) -> list[float]:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(engine.tokenizer, vocab_size=engine.model_config.vocab_size)
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(PERSON)))
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for token in engine.tokenizer.encode(json.dumps(ANSWER), add_special_tokens=False):
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - started)
        matcher.accept_token(token)
    return times


def decode_step_seconds(engine, batch: list[list[int]], output_len: int, constrained: int) -> float:
    """Mean wall time of a decode step with the first `constrained` requests held by LONG_ARRAY."""
    from jax_engine import SamplingParams

    started = time.perf_counter()
    for i, ids in enumerate(batch):
        grammar = {"json": LONG_ARRAY} if i < constrained else None
        engine.add_request(f"structured-{started}-{i}", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                                          structured_outputs=grammar))
    produced, steps, decode_started = {}, 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
        if decode_started is None:
            if len(produced) == len(batch) and min(produced.values()) >= 1:
                decode_started = time.perf_counter()
        else:
            steps += 1
    return (time.perf_counter() - decode_started) / max(steps, 1)


def throughput(llm, num_requests: int, constrained: bool) -> tuple[float, int]:
    """(output tokens/s, requests that finished on their own) for persons asked at temperature 1."""
    from jax_engine import SamplingParams

    grammar = {"json": PERSON} if constrained else None
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=160, structured_outputs=grammar)
              for seed in range(num_requests)]
    started = time.perf_counter()
    outputs = llm.generate(["A person with an address and pets, as JSON:"] * num_requests, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / seconds, sum(o.outputs[0].finish_reason == "stop" for o in outputs)


def main(args: argparse.Namespace) -> dict:
    from jax_engine import LLM, LLMEngine
    from jax_engine.bench.latency_prompts import rotations as prompts

    sizes = sorted(args.batch_sizes)
    engine = LLMEngine(EngineArgs.from_cli_args(args, max_num_seqs=max(sizes[-1], args.num_requests),
                                                max_model_len=max(args.input_len + args.output_len, 224)))
    result = {"mask_us": {}, "step_ms": {}, "throughput": {}}
    libraries = {"llguidance": llguidance_mask_times, "xgrammar": xgrammar_mask_times}
    for name in ["llguidance", *args.compare]:
        times = np.array(libraries[name](engine)) * 1e6
        result["mask_us"][name] = {"median": float(np.median(times)), "p99": float(np.percentile(times, 99))}
        print(f"{name:>10} mask per row: median {np.median(times):7.1f} us  P99 {np.percentile(times, 99):7.1f} us "
              f"({len(times)} steps of a JSON answer, vocabulary {engine.model_config.vocab_size})")
    for b in sizes:
        batch = prompts(engine.tokenizer, b, args.input_len)
        decode_step_seconds(engine, batch, 4, b)  # warm-up: the constrained sampler's first compile
        row = {}
        for constrained in (0, 1, b):
            row[constrained] = decode_step_seconds(engine, batch, args.output_len, constrained) * 1e3
        result["step_ms"][b] = row
        print(f"batch {b:3d}: decode step " + "  ".join(f"{c} constrained {ms:6.1f} ms" for c, ms in row.items())
              + f"  (all / none: {row[b] / row[0]:.2f})")
    llm = LLM.from_engine(engine)
    throughput(llm, 4, True)  # warm-up
    for constrained in (False, True):
        rate, stopped = throughput(llm, args.num_requests, constrained)
        result["throughput"]["json schema" if constrained else "free text"] = rate
        print(f"{'json schema' if constrained else 'free text':>11}: {rate:6.1f} output tok/s "
              f"({args.num_requests} requests at temperature 1, {stopped} ended on their own)")
    return result
