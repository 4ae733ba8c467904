"""Latency: time to first token and decode tokens/s at small batches, beside the memory-bandwidth bound and peers.

What a user of one or a few streams waits for. For each batch size B, B different prompts of the --workload
(latency_prompts.py: by default token rotations of one text, --input-len tokens, EOS ignored; or chat answers, or
copy-heavy rewrites of a passage, which stop at EOS) are generated greedily for up to --output-len tokens each. Time
to first token is from submitting the batch until every request has its first token; decode tokens/s counts the
tokens after each request's first, over the time after that. Beside each figure: the bound a decode step cannot
beat, reading every weight once per step (B x bandwidth / weight bytes, or the matmul peak, whichever is lower),
from the roofline probe.

Start-up (loading, and compiling or loading every step shape) is timed and printed on its own; the timed
runs follow a warm-up batch, as a server's requests follow its start. --num-iters N (vLLM's option) times each
batch N times and reports the medians; llama.cpp, when compared, then runs each batch right after each of ours,
so that both meet the same moments of a machine whose speed drifts (a quiet 2-core host's decode rates moved by
10-15% between two runs, docs/performance-notes.md).

--speculative-config '{json}' times each weight format twice in the same run, without and with speculative
decoding, and prints the speculating run's acceptance, its speedup over the plain run at the same batch, and
whether its tokens are the plain run's (greedy: they must be).
--compare hf runs the same token ids through transformers (torch, float32, model.generate);
--compare llama.cpp through llama-cpp-python on the default GGUF file (its Q4_1 weights as shipped), with
batched decoding of B sequences (an optional extra: see docs/benchmarks.md for the build); with n-gram
--speculative-config on chat or copy work, also llama.cpp's own prompt-lookup drafting at batch 1
(llama_cpp_peer.py).
"""

import argparse
import time
from typing import NamedTuple

import numpy as np

from jax_engine.bench import roofline
from jax_engine.bench.latency_prompts import WORKLOADS, workload_prompts
from jax_engine.bench.llama_cpp_peer import LlamaCpp, time_prompt_lookup
from jax_engine.config import EngineArgs
from jax_engine.spec_decode import SpeculativeConfig

FIXED_ENGINE_ARGS = ("max_num_seqs", "max_model_len", "quantization")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--workload", default="rotations", choices=WORKLOADS,
                        help="rotations: token rotations of one text, exactly --input-len long, EOS ignored; chat: "
                             "free answers to questions; copy: rewrites of a given passage (chat and copy go "
                             "through the chat template and stop at EOS or --output-len)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (rotations)")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens per request (at most)")
    parser.add_argument("--quantizations", nargs="+", default=["none", "bf16", "int8", "gguf"],
                        help="weight formats of this engine to time, each its own start-up (gguf: a .gguf "
                             "model's blocks as the file has them, skipped for other models)")
    parser.add_argument("--num-iters-warmup", type=int, default=0,
                        help="untimed runs of each batch first, on other prompts of the same lengths (as vLLM's "
                             "option): where step shapes compile on first use (Pallas on a GPU), the timed run "
                             "then meets compiled shapes")
    parser.add_argument("--num-iters", type=_at_least_one, default=1,
                        help="timed runs of each batch (vLLM's option); the medians are reported, and a llama.cpp "
                             "peer runs each batch after each of ours, in turns")
    parser.add_argument("--compare", nargs="*", default=[], choices=["hf", "llama.cpp"],
                        help="peers to run the same workload through, in this process")
    EngineArgs.add_cli_args(parser, exclude=FIXED_ENGINE_ARGS)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class Timing(NamedTuple):
    ttft_s: float  # submitting the batch until every request has its first token
    decode_tokens_per_s: float  # the tokens after each request's first, over the time after the last first token
    token_ids: list[list[int]]  # each request's output, in batch order


def time_ours(engine, batch: list[list[int]], output_len: int, ignore_eos: bool = True) -> Timing:
    """The batch through LLMEngine.step, greedy, for output_len tokens (or to EOS unless ignore_eos), from an empty
    prefix cache: each batch's prompts repeat the smaller batches' (the first B of one list), and a cached prefix
    would both shorten the prefill and give it step shapes a warm-up never met, compiled in the timed run where a
    backend compiles on first use (Pallas on a GPU)."""
    from jax_engine import SamplingParams

    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=ignore_eos)
    started = time.perf_counter()
    ids = [f"latency-{started}-{i}" for i in range(len(batch))]
    for request_id, prompt in zip(ids, batch):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    first_token, produced = None, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = out.outputs[0].token_ids
        if first_token is None and len(produced) == len(batch) and min(map(len, produced.values())) >= 1:
            first_token = time.perf_counter()
    decode_tokens = sum(len(tokens) - 1 for tokens in produced.values())
    return Timing(first_token - started, decode_tokens / max(time.perf_counter() - first_token, 1e-9),
                  [list(produced[i]) for i in ids])


def median_timing(timings: list[Timing]) -> Timing:
    """The median TTFT and decode rate of runs of one batch (their tokens are the same: greedy)."""
    return Timing(float(np.median([t.ttft_s for t in timings])),
                  float(np.median([t.decode_tokens_per_s for t in timings])), timings[0].token_ids)


def warm_up(engine, tokenizer, batch_size: int, args: argparse.Namespace) -> None:
    """--num-iters-warmup untimed runs of a batch's shapes, on other prompts of the same lengths."""
    for _ in range(args.num_iters_warmup):
        batch = workload_prompts(args.workload, tokenizer, batch_size, args.input_len, first=batch_size)
        time_ours(engine, batch, args.output_len, ignore_eos=args.workload == "rotations")


def time_hf(model, batch: list[list[int]], output_len: int) -> tuple[float, float]:
    import torch

    width = max(map(len, batch))  # prompts of other lengths padded on the left, as generate expects
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        total = time.perf_counter() - started
    return ttft, len(batch) * (output_len - 1) / max(total - ttft, 1e-9)


def llama_cpp_prompt_lookup(path: str, prompt: list[int], output_len: int, max_len: int, spec: SpeculativeConfig,
                            report) -> None:
    """llama.cpp's own drafting beside ours: its one-sequence API at batch 1, plain, then drafting by prompt lookup
    (the binding's drafter: n-grams from prompt_lookup_max down to 1, k tokens)."""
    plain = time_prompt_lookup(path, prompt, output_len, max_len, None)
    drafting = time_prompt_lookup(path, prompt, output_len, max_len,
                                  (spec.num_speculative_tokens, spec.prompt_lookup_max))
    report("llama.cpp Llama API", 1, *plain[:2])
    report(f"llama.cpp Llama API +ngram k={spec.num_speculative_tokens}", 1, *drafting[:2])
    print(f"    {drafting[1] / plain[1]:.2f}x plain decode, tokens "
          f"{'identical' if drafting[2] == plain[2] else 'differ'}", flush=True)


def weight_bytes(engine) -> int:
    import jax
    from flax import nnx

    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(engine.runner.model)))


def bound(probe: roofline.Roofline, num_params: int, nbytes: int, batch_size: int) -> float:
    """Decode tokens/s no step can beat: every weight read once per step, or the matmul peak."""
    return min(batch_size * probe.bandwidth_gbps * 1e9 / nbytes, probe.matmul_gflops * 1e9 / (2 * num_params))


def variants(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """(label suffix, engine arguments) of each engine a quantization runs: plain (one token a step, in lockstep),
    and beside it, when asked for, the engine with --speculative-config or --async-scheduling (same run, same
    machine)."""
    plain = {"speculative_config": None, "async_scheduling": False}
    if not args.speculative_config and not args.async_scheduling:
        return [("", plain)]
    other = {"speculative_config": args.speculative_config, "async_scheduling": args.async_scheduling}
    if args.async_scheduling:
        return [("", plain), (" +async scheduling", other)]
    spec = SpeculativeConfig.from_dict(args.speculative_config)
    drafter = spec.method if spec.model is None else f"draft {spec.model} {spec.quantization or ''}".rstrip()
    return [("", plain), (f" +{drafter} k={spec.num_speculative_tokens}", other)]


def beside_plain(engine, before: dict, plain: Timing | None, ours: Timing) -> str:
    """The timed run's speculation, if any: acceptance (the counters' growth over the run); then the speedup over
    the plain engine's decode at the same batch, and whether the tokens are the plain engine's (greedy: they must
    be)."""
    parts = []
    if (after := engine.stats().get("spec_decode")) is not None:
        drafted, accepted, drafts = (after[k] - before.get(k, 0) for k in
                                     ("num_draft_tokens", "num_accepted_tokens", "num_drafts"))
        parts.append(f"acceptance {accepted / max(drafted, 1):4.0%}, "
                     f"{1 + accepted / max(drafts, 1):.2f} tokens a verification")
    if plain is not None:
        differ = sum(a != b for a, b in zip(ours.token_ids, plain.token_ids))
        parts.append(f"{ours.decode_tokens_per_s / plain.decode_tokens_per_s:.2f}x plain decode, "
                     f"{plain.ttft_s / ours.ttft_s:.2f}x plain TTFT, tokens "
                     f"{f'differ in {differ} of {len(plain.token_ids)} requests' if differ else 'identical'}")
    return "    " + ", ".join(parts)


def time_engines(args, checkpoint, batches: dict, max_len: int, report, limit, peer=None) -> dict[int, list]:
    """Each quantization's engines (plain, then speculating) through every batch, reported as they finish; with
    `peer` (a LlamaCpp), the peer's run of the same batch after each of ours, returned as {batch: its runs}."""
    from jax_engine import LLMEngine

    sizes, ignore_eos = sorted(batches), args.workload == "rotations"
    peer_runs = {b: [] for b in sizes}
    for quantization in args.quantizations:
        q = None if quantization == "none" else quantization
        if q == "gguf" and not checkpoint.blocks:
            print("jax_engine gguf: skipped, the model has no GGUF blocks", flush=True)
            continue
        plain = {}
        for suffix, variant in variants(args):
            started = time.perf_counter()
            engine = LLMEngine(EngineArgs.from_cli_args(args, max_num_seqs=sizes[-1], max_model_len=max_len,
                                                        quantization=q, **variant), checkpoint=checkpoint)
            label = f"jax_engine {quantization if q else np.dtype(engine.dtype).name}{suffix}"
            print(f"{label}: start-up {time.perf_counter() - started:.1f} s (of which compiling or loading step "
                  f"shapes {engine.startup_compile_seconds:.1f} s)", flush=True)
            nbytes = weight_bytes(engine)
            time_ours(engine, batches[sizes[0]], 4)  # warm-up: the first step's host-side caches
            for b in sizes:
                warm_up(engine, checkpoint.tokenizer, b, args)
                before, runs = engine.stats(), []
                for _ in range(args.num_iters):
                    runs.append(time_ours(engine, batches[b], args.output_len, ignore_eos))
                    if peer is not None:
                        peer_runs[b].append(peer.time(batches[b], args.output_len, not ignore_eos))
                timing = median_timing(runs)
                report(label, b, timing.ttft_s, timing.decode_tokens_per_s, limit(nbytes, b))
                compiled = engine.stats()["num_compilations"] - before["num_compilations"]
                if compiled:
                    print(f"{label} batch {b}: {compiled} step shapes compiled in the timed run, their time "
                          "included (--num-iters-warmup 1 runs them first)", flush=True)
                if not suffix:
                    plain[b] = timing
                else:
                    print(beside_plain(engine, before.get("spec_decode", {}), plain.get(b), timing), flush=True)
            del engine
    return peer_runs


def main(args: argparse.Namespace) -> dict:
    from jax_engine.loader import load_checkpoint
    from jax_engine.loader.load import default_model_path

    checkpoint = load_checkpoint(args.model)
    cfg = checkpoint.config
    sizes = sorted(args.batch_sizes)
    batches = {b: workload_prompts(args.workload, checkpoint.tokenizer, b, args.input_len) for b in sizes}
    max_len = max(len(p) for batch in batches.values() for p in batch) + args.output_len
    probe = roofline.measure(cfg.num_params)
    rows = []  # (engine label, batch size, ttft s, decode tokens/s, bound tokens/s or None)

    def report(label, b, ttft, rate, limit=None):
        rows.append((label, b, ttft, rate, limit))
        beside = f"  bound {limit:7.1f} tokens/s ({rate / limit:4.0%})" if limit else ""
        print(f"{label:<30} batch {b:>3}: TTFT {ttft * 1e3:8.1f} ms  decode {rate:7.1f} tokens/s{beside}", flush=True)

    peer = path = None
    if "llama.cpp" in args.compare:  # loaded first: it runs in turns with ours
        path = args.model or default_model_path()
        peer = LlamaCpp(path, sizes[-1], max_len)
        peer.time(batches[sizes[0]], 2)
    peer_runs = time_engines(args, checkpoint, batches, max_len, report,
                             lambda nbytes, b: bound(probe, cfg.num_params, nbytes, b), peer)
    if "hf" in args.compare:
        from jax_engine.bench.hf_baseline import hf_model_from_checkpoint

        model = hf_model_from_checkpoint(checkpoint)
        time_hf(model, batches[sizes[0]], 2)
        for b in sizes:
            runs = [time_hf(model, batches[b], args.output_len) for _ in range(args.num_iters)]
            report("transformers float32", b, *np.median(runs, axis=0))
    if peer is not None:
        for b in sizes:
            report("llama.cpp (GGUF as is)", b, *np.median(peer_runs[b], axis=0))
        spec = SpeculativeConfig.from_dict(args.speculative_config)
        if spec is not None and spec.method == "ngram" and 1 in sizes and args.workload != "rotations":
            llama_cpp_prompt_lookup(path, batches[1][0], args.output_len, max_len, spec, report)
    print(f"probe: memory {probe.bandwidth_gbps:.1f} GB/s, matmul {probe.matmul_gflops:.0f} GFLOP/s; "
          f"{cfg.num_params / 1e6:.0f}M parameters")
    return {"rows": rows, "roofline": probe.__dict__}
