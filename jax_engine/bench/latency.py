"""Latency: time to first token and decode tokens/s at small batches, beside the memory-bandwidth bound and peers.

What a user of one or a few streams waits for. For each batch size B, B different prompts of --input-len
tokens are generated greedily for --output-len tokens each (EOS ignored). Time to first token is from
submitting the batch until every request has its first token; decode tokens/s counts the B x (output-1)
tokens after that. Beside each figure: the bound a decode step cannot beat, reading every weight once per
step (B x bandwidth / weight bytes, or the matmul peak, whichever is lower), from the roofline probe.

Start-up (loading, and compiling or loading every step shape) is timed and printed on its own; the timed
runs follow a warm-up batch, as a server's requests follow its start.

--compare hf runs the same token ids through transformers (torch, float32, model.generate);
--compare llama.cpp through llama-cpp-python on the default GGUF file (its Q4_1 weights as shipped), with
batched decoding of B sequences (an optional extra: see docs/benchmarks.md for the build).
"""

import argparse
import os
import time

import numpy as np

from jax_engine.bench import roofline
from jax_engine.config import EngineArgs

FIXED_ENGINE_ARGS = ("max_num_seqs", "max_model_len", "quantization")
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern, a notebook "
        "and a flask of tea. From the gallery he watched the ships pass, wrote down their names and flags, and "
        "wondered where each was bound. One night a storm broke the great lens, and the keeper had to choose ")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--quantizations", nargs="+", default=["none", "bf16", "int8", "gguf"],
                        help="weight formats of this engine to time, each its own start-up (gguf: a .gguf "
                             "model's blocks as the file has them, skipped for other models)")
    parser.add_argument("--num-iters-warmup", type=int, default=0,
                        help="untimed runs of each batch first, on other prompts of the same lengths (as vLLM's "
                             "option): where step shapes compile on first use (Pallas on a GPU), the timed run "
                             "then meets compiled shapes")
    parser.add_argument("--compare", nargs="*", default=[], choices=["hf", "llama.cpp"],
                        help="peers to run the same workload through, in this process")
    EngineArgs.add_cli_args(parser, exclude=FIXED_ENGINE_ARGS)


def prompts(tokenizer, batch_size: int, input_len: int, first: int = 0) -> list[list[int]]:
    """batch_size different prompts of exactly input_len tokens (rotations of one text, from rotation `first`: no
    shared prefix)."""
    ids = tokenizer.encode(TEXT * (1 + input_len // 40), add_special_tokens=False)
    return [(ids[row:] + ids[:row])[:input_len] for row in range(first, first + batch_size)]


def time_ours(engine, batch: list[list[int]], output_len: int) -> tuple[float, float]:
    """(seconds to the first token of every request, decode tokens/s after it) through LLMEngine.step."""
    from jax_engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    for i, ids in enumerate(batch):
        engine.add_request(f"latency-{started}-{i}", {"prompt_token_ids": ids}, params)
    first_token, produced = None, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
        if first_token is None and len(produced) == len(batch) and min(produced.values()) >= 1:
            first_token = time.perf_counter()
    decode_seconds = time.perf_counter() - first_token
    return first_token - started, len(batch) * (output_len - 1) / decode_seconds


def warm_up(engine, tokenizer, batch_size: int, args: argparse.Namespace) -> None:
    """--num-iters-warmup untimed runs of a batch's shapes, on other rotations: no prefix cache hit for the timed run."""
    for _ in range(args.num_iters_warmup):
        time_ours(engine, prompts(tokenizer, batch_size, args.input_len, first=batch_size), args.output_len)


def time_hf(model, batch: list[list[int]], output_len: int) -> tuple[float, float]:
    import torch

    ids = torch.tensor(batch)
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        total = time.perf_counter() - started
    return ttft, len(batch) * (output_len - 1) / max(total - ttft, 1e-9)


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API: B sequences decoded together in one llama_batch."""

    def __init__(self, gguf_path: str, max_batch: int, max_len: int) -> None:
        import llama_cpp as ll
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp logs every tensor it loads otherwise
        self.ll = ll
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(gguf_path.encode(), ll.llama_model_default_params())
        params = ll.llama_context_default_params()
        params.n_ctx = max_batch * -(-max_len // 256) * 256  # split evenly between the sequences
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = max_batch
        params.n_threads = params.n_threads_batch = os.cpu_count() or 1
        self.ctx = ll.llama_init_from_model(self.model, params)
        self.vocab_size = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.batch = ll.llama_batch_init(512, 0, 1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Run (token, position, sequence, wants logits) entries in chunks; the argmax of each wanted row."""
        ll, chosen = self.ll, []
        for first in range(0, len(entries), 512):
            chunk = entries[first : first + 512]
            self.batch.n_tokens = len(chunk)
            for i, (token, pos, seq, logits) in enumerate(chunk):
                self.batch.token[i], self.batch.pos[i], self.batch.n_seq_id[i] = token, pos, 1
                self.batch.seq_id[i][0], self.batch.logits[i] = seq, logits
            if ll.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, _, logits) in enumerate(chunk):
                if logits:
                    row = np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, i), shape=(self.vocab_size,))
                    chosen.append(int(row.argmax()))
        return chosen

    def time(self, batch: list[list[int]], output_len: int) -> tuple[float, float]:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        started = time.perf_counter()
        tokens = self._decode([(t, pos, seq, pos == len(ids) - 1) for seq, ids in enumerate(batch)
                               for pos, t in enumerate(ids)])
        ttft = time.perf_counter() - started
        started = time.perf_counter()
        for step in range(output_len - 1):
            tokens = self._decode([(t, len(batch[seq]) + step, seq, True) for seq, t in enumerate(tokens)])
        return ttft, len(batch) * (output_len - 1) / (time.perf_counter() - started)


def weight_bytes(engine) -> int:
    import jax
    from flax import nnx

    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(engine.runner.model)))


def bound(probe: roofline.Roofline, num_params: int, nbytes: int, batch_size: int) -> float:
    """Decode tokens/s no step can beat: every weight read once per step, or the matmul peak."""
    return min(batch_size * probe.bandwidth_gbps * 1e9 / nbytes, probe.matmul_gflops * 1e9 / (2 * num_params))


def main(args: argparse.Namespace) -> dict:
    from jax_engine import LLMEngine
    from jax_engine.loader import load_checkpoint
    from jax_engine.loader.load import default_model_path

    checkpoint = load_checkpoint(args.model)
    cfg = checkpoint.config
    sizes = sorted(args.batch_sizes)
    max_len = args.input_len + args.output_len
    batches = {b: prompts(checkpoint.tokenizer, b, args.input_len) for b in sizes}
    probe = roofline.measure(cfg.num_params)
    rows = []  # (engine label, batch size, ttft s, decode tokens/s, bound tokens/s or None)

    def report(label, b, ttft, rate, limit=None):
        rows.append((label, b, ttft, rate, limit))
        beside = f"  bound {limit:7.1f} tokens/s ({rate / limit:4.0%})" if limit else ""
        print(f"{label:<22} batch {b:>3}: TTFT {ttft * 1e3:8.1f} ms  decode {rate:7.1f} tokens/s{beside}", flush=True)

    for quantization in args.quantizations:
        q = None if quantization == "none" else quantization
        if q == "gguf" and not checkpoint.blocks:
            print("jax_engine gguf: skipped, the model has no GGUF blocks", flush=True)
            continue
        started = time.perf_counter()
        engine = LLMEngine(EngineArgs.from_cli_args(args, max_num_seqs=sizes[-1], max_model_len=max_len,
                                                    quantization=q), checkpoint=checkpoint)
        label = f"jax_engine {quantization if q else np.dtype(engine.dtype).name}"
        print(f"{label}: start-up {time.perf_counter() - started:.1f} s (of which compiling or loading step "
              f"shapes {engine.startup_compile_seconds:.1f} s)", flush=True)
        nbytes = weight_bytes(engine)
        time_ours(engine, batches[sizes[0]], 4)  # warm-up: the first step's host-side caches
        for b in sizes:
            warm_up(engine, checkpoint.tokenizer, b, args)
            report(label, b, *time_ours(engine, batches[b], args.output_len), bound(probe, cfg.num_params, nbytes, b))
        del engine
    if "hf" in args.compare:
        from jax_engine.bench.hf_baseline import hf_model_from_checkpoint

        model = hf_model_from_checkpoint(checkpoint)
        time_hf(model, batches[sizes[0]], 2)
        for b in sizes:
            report("transformers float32", b, *time_hf(model, batches[b], args.output_len))
    if "llama.cpp" in args.compare:
        peer = LlamaCpp(args.model or default_model_path(), sizes[-1], max_len)
        peer.time(batches[sizes[0]], 2)
        for b in sizes:
            report("llama.cpp (GGUF as is)", b, *peer.time(batches[b], args.output_len))
    print(f"probe: memory {probe.bandwidth_gbps:.1f} GB/s, matmul {probe.matmul_gflops:.0f} GFLOP/s; "
          f"{cfg.num_params / 1e6:.0f}M parameters")
    return {"rows": rows, "roofline": probe.__dict__}
