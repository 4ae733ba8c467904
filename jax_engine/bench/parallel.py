"""Tensor parallelism: decode step time, tokens/s and memory per device for tp = 1, 2, 4, side by side.

Each tensor-parallel size runs in its own process (XLA splits the host CPU into --devices devices only
before JAX starts), through the same workload as `bench latency`: B prompts of --input-len tokens, greedy,
--output-len tokens each, timed after a warm-up, start-up printed on its own. Step time is a decode step's
wall time (B / decode tokens/s). Memory per device is what device 0 holds: its share of the weights and of
the KV cache.

On a CPU the "devices" are slices of the same cores and the same memory: splitting a layer cannot read the
weights any faster, and every layer adds two all-reduces, so tp > 1 is expected to be slower here, not
faster. The figure shows what the split costs and that memory per device shrinks; on GPUs each device
brings its own memory bandwidth, which is what tensor parallelism buys.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from jax_engine.config import EngineArgs

FIXED_ENGINE_ARGS = ("max_num_seqs", "max_model_len", "tensor_parallel_size")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--devices", type=int, default=4, help="CPU devices XLA splits the host into")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    EngineArgs.add_cli_args(parser, exclude=FIXED_ENGINE_ARGS)


def device_bytes(arrays, device) -> int:
    """Bytes of `arrays` held on `device`."""
    return sum(shard.data.nbytes for a in arrays for shard in a.addressable_shards if shard.device == device)


def run_one(args: argparse.Namespace, tp: int) -> dict:
    """Start an engine split over tp devices and time the workload (in the child process)."""
    import jax
    from flax import nnx

    from jax_engine import LLMEngine
    from jax_engine.bench.latency import time_ours
    from jax_engine.bench.latency_prompts import rotations as prompts
    from jax_engine.loader import load_checkpoint

    checkpoint = load_checkpoint(args.model)
    sizes = sorted(args.batch_sizes)
    started = time.perf_counter()
    engine = LLMEngine(EngineArgs.from_cli_args(args, max_num_seqs=sizes[-1], tensor_parallel_size=tp,
                                                max_model_len=args.input_len + args.output_len),
                       checkpoint=checkpoint)
    startup = time.perf_counter() - started
    runner, device = engine.runner, jax.devices()[0]
    result = {"tp": tp, "startup_s": startup, "compile_s": engine.startup_compile_seconds,
              "weights_bytes": device_bytes(jax.tree.leaves(nnx.state(runner.model)), device),
              "kv_cache_bytes": device_bytes([runner.k_cache, runner.v_cache], device), "rows": []}
    time_ours(engine, prompts(checkpoint.tokenizer, sizes[0], args.input_len), 4)  # warm-up
    for b in sizes:
        ttft, rate, _ = time_ours(engine, prompts(checkpoint.tokenizer, b, args.input_len), args.output_len)
        result["rows"].append({"batch": b, "ttft_s": ttft, "tokens_per_s": rate, "step_ms": 1e3 * b / rate})
    return result


def main(args: argparse.Namespace) -> dict:
    from jax_engine.bench import roofline
    from jax_engine.loader import load_checkpoint

    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}".strip()
    options = json.dumps({k: v for k, v in vars(args).items() if k != "run"})
    results = []
    for tp in args.tensor_parallel_sizes:
        run = subprocess.run([sys.executable, "-m", "jax_engine.bench.parallel", options, str(tp)],
                             env={**os.environ, "XLA_FLAGS": flags}, capture_output=True, text=True)
        line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
        if run.returncode != 0 or line is None:
            raise RuntimeError(f"tp={tp} failed:\n{run.stderr[-3000:]}")
        results.append(json.loads(line[len("RESULT "):]))
        print_result(results[-1], results[0])
    num_params = load_checkpoint(args.model).config.num_params
    probe = roofline.measure(num_params)
    weights = results[0]["weights_bytes"]
    for b in sorted(args.batch_sizes):
        limit = min(b * probe.bandwidth_gbps * 1e9 / weights, probe.matmul_gflops * 1e9 / (2 * num_params))
        print(f"bound at batch {b:>3} (all devices share this machine's memory): {limit:7.1f} tokens/s")
    print(f"probe: memory {probe.bandwidth_gbps:.1f} GB/s, matmul {probe.matmul_gflops:.0f} GFLOP/s; "
          f"{os.cpu_count()} cores split into {args.devices} devices")
    return {"results": results, "roofline": probe.__dict__}


def print_result(result: dict, unsplit: dict) -> None:
    tp, mib = result["tp"], 1 << 20
    print(f"tp={tp}: start-up {result['startup_s']:.1f} s (compiling or loading {result['compile_s']:.1f} s); "
          f"per device: weights {result['weights_bytes'] / mib:.0f} MiB, KV cache {result['kv_cache_bytes'] / mib:.0f} MiB",
          flush=True)
    for row, base in zip(result["rows"], unsplit["rows"]):
        print(f"  tp={tp} batch {row['batch']:>3}: TTFT {row['ttft_s'] * 1e3:8.1f} ms  decode step {row['step_ms']:7.1f} ms"
              f"  {row['tokens_per_s']:7.1f} tokens/s  ({row['tokens_per_s'] / base['tokens_per_s']:.2f} x tp=1)",
              flush=True)


if __name__ == "__main__":  # a child of main(): one tensor-parallel size, its options as JSON
    print("RESULT " + json.dumps(run_one(argparse.Namespace(**json.loads(sys.argv[1])), int(sys.argv[2]))), flush=True)
