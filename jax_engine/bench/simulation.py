"""The simulator's CPU preset against the real engine, measured side by side in one run.

    jax-engine bench simulation [--rates 0.5 1 2 4 8] [--num-prompts 32] [--out-dir DIR]

1. `jax-engine bench batching` measures the engine's decode steps, batch 1 to 128 (in a child process);
2. a fresh `jax-engine serve --max-model-len 1024` starts; after two warm-up runs, `jax-engine bench serve` measures
   its cost per streamed token with 16 requests decoding together (16 + 64 tokens each, all at once), then serves
   --num-prompts alpaca-like requests at each rate;
3. simulator/cpu_fit.py builds the CPU cost model from 1 and 2's first run (never from the sweep it predicts), and
   the simulator replays each rate's own requests: bench serve's lengths for the run's seed, with Poisson arrivals
   at the run's rate, averaged over three arrival seeds.

It prints, per rate, the served rate, the engine's normalized latency, the simulator's, and their ratio, and
writes the three recorded runs into --out-dir (tests/test_simulator.py replays docs/figures/data's).
"""

import argparse
import json
import pathlib
import subprocess
import sys

import numpy as np

from jax_engine.bench import serve as bench_serve
from jax_engine.bench.server_process import server_process
from jax_engine.bench.workloads import request_lengths
from simulator.cpu_fit import fit_cpu_cost_model
from simulator.simulate import simulate
from simulator.systems import make_system
from simulator.workload import TraceRequest

MAX_MODEL_LEN = 1024
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
FILES = {"batching": "sim_check_batching.json", "overhead": "sim_check_overhead.json",
         "serving": "sim_check_serving.json"}
TOGETHER = 16  # requests decoding together while the server's cost per streamed token is measured


def replayed_latency(run: dict, cost, arrival_seed: int) -> float:
    """The normalized latency the simulator predicts for a recorded `bench serve` run: the same requests (bench
    serve's own lengths for the run's seed), Poisson arrivals at the run's rate."""
    rate, report = run["report"]["request_rate"], run["report"]
    inputs, outputs, _ = request_lengths(run["num_prompts"], run["length_mode"], MAX_MODEL_LEN, seed=run["seed"])
    if outputs.sum() != report["total_output_tokens"]:
        raise ValueError(f"the run at {rate} req/s served {report['total_output_tokens']} tokens, not its requests' "
                         f"{outputs.sum()}: a failed request, or another max_model_len")
    gaps = np.random.default_rng(arrival_seed).exponential(1 / rate, len(inputs) - 1)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps)])
    trace = [TraceRequest(float(a), int(i), int(o)) for a, i, o in zip(arrivals, inputs, outputs)]
    return simulate("vllm", make_system("vllm", cost), trace, rate).normalized_latency


def predicted_latency(run: dict, cost, arrival_seeds: int = 3) -> float:
    return float(np.mean([replayed_latency(run, cost, seed) for seed in range(arrival_seeds)]))


def _bench_serve(url: str, *flags: str) -> dict:
    """One `jax-engine bench serve` run against `url` (its report, printed as bench serve prints it)."""
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return bench_serve.main(parser.parse_args(["--base-url", url, *flags]))


def measure(out_dir: pathlib.Path, rates: list[float], num_prompts: int) -> dict[str, pathlib.Path]:
    """Steps 1 and 2: the recorded runs, as files in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / file for name, file in FILES.items()}
    for path in paths.values():
        path.unlink(missing_ok=True)  # bench serve appends to its --json-out
    subprocess.run([sys.executable, "-m", "jax_engine", "bench", "batching", "--batch-sizes", *map(str, BATCH_SIZES),
                    "--out", str(paths["batching"])], check=True)
    serve = [sys.executable, "-m", "jax_engine", "serve", "--max-model-len", str(MAX_MODEL_LEN)]
    with server_process(serve, out_dir / "sim_check_server.log") as server:
        url = server.url
        _bench_serve(url, "--num-prompts", "64", "--request-rate", "inf", "--seed", "99")  # warm-ups: shapes compile
        _bench_serve(url, "--num-prompts", "32", "--request-rate", "2", "--seed", "98")
        _bench_serve(url, "--num-prompts", str(TOGETHER), "--request-rate", "inf", "--max-concurrency", str(TOGETHER),
                     "--length-mode", "fixed", "--input-len", "16", "--output-len", "64",
                     "--json-out", str(paths["overhead"]))
        for rate in rates:
            _bench_serve(url, "--num-prompts", str(num_prompts), "--request-rate", str(rate),
                         "--json-out", str(paths["serving"]))
    return paths


def compare(paths: dict[str, pathlib.Path]) -> list[dict]:
    """Step 3: the simulator's prediction beside each measured rate."""
    cost = fit_cpu_cost_model(paths["batching"], paths["overhead"])
    rows = []
    for run in json.loads(paths["serving"].read_text())["runs"]:
        report = run["report"]
        measured = report["mean_normalized_latency_ms"] / 1e3
        simulated = predicted_latency(run, cost)
        rows.append({"rate": report["request_rate"], "served": report["request_throughput"],
                     "measured_s": measured, "simulated_s": simulated, "ratio": simulated / measured})
    print(f"serving overhead ({TOGETHER} requests together, beyond the engine's step at batch {TOGETHER}): "
          f"{cost.serving_overhead_s * 1e3:.2f} ms a token")
    print(f"{'rate':>6} {'served':>7} {'engine ms/token':>16} {'simulated':>10} {'sim/engine':>11}")
    for row in rows:
        print(f"{row['rate']:6g} {row['served']:7.2f} {row['measured_s'] * 1e3:16.1f} "
              f"{row['simulated_s'] * 1e3:10.1f} {row['ratio']:11.2f}")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 4, 8], help="requests per second")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests a rate")
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("sim_check"),
                        help="where the three recorded runs and the server's log go")
    parser.add_argument("--compare-only", action="store_true",
                        help="skip the measurements: compare the runs already in --out-dir")


def main(args: argparse.Namespace) -> list[dict]:
    if any(rate <= 0 for rate in args.rates) or args.num_prompts < 2:
        raise ValueError(f"--rates must be > 0 and --num-prompts >= 2, got {args.rates} and {args.num_prompts}")
    paths = ({name: args.out_dir / file for name, file in FILES.items()} if args.compare_only
             else measure(args.out_dir, args.rates, args.num_prompts))
    return compare(paths)
