"""`jax-engine bench serve`: latency and throughput of a running server under load (vLLM's `bench serve`).

    jax-engine serve &
    jax-engine bench serve --num-prompts 64 --request-rate 2 --length-mode alpaca-like

Requests arrive as a Poisson process at --request-rate per second (inf: all at once), optionally at most
--max-concurrency in flight. Each streams a completion of exactly its output length (EOS ignored) over
/v1/completions; TTFT, TPOT, ITL and end-to-end latency come from the client's clock. With
`--compare llama-server BINARY` it starts our server and llama.cpp's itself and runs both (serve_compare.py).
"""

import argparse
import asyncio
import json

from jax_engine.bench import sampling_filters, serve_compare
from jax_engine.bench.serve_workload import RequestResult, client_for, make_workload, send_workload, summarize
from jax_engine.bench.workloads import LENGTH_MODES


async def run(ns: argparse.Namespace) -> tuple[list[RequestResult], float]:
    async with client_for(ns.base_url, ns.api_key) as client:
        workload = await make_workload(client, ns, ns.request_rate)
        return await send_workload(client, workload, ns.max_concurrency)


def _print(report: dict, ns: argparse.Namespace) -> None:
    print(f"{' Serving Benchmark Result ':=^60}")
    print(f"{'Request rate (req/s):':<44}{ns.request_rate:>16}")
    print(f"{'Max concurrency:':<44}{str(ns.max_concurrency or 'unlimited'):>16}")
    rows = [("Successful requests:", "successful_requests", "d"), ("Failed requests:", "failed_requests", "d"),
            ("Benchmark duration (s):", "duration_s", ".2f"), ("Total input tokens:", "total_input_tokens", "d"),
            ("Total generated tokens:", "total_output_tokens", "d"),
            ("Request throughput (req/s):", "request_throughput", ".2f"),
            ("Output token throughput (tok/s):", "output_throughput", ".2f"),
            ("Total token throughput (tok/s):", "total_token_throughput", ".2f")]
    for label, key, fmt in rows:
        print(f"{label:<44}{report[key]:>16{fmt}}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name, title in titles.items():
        print(f"{' ' + title + ' ':-^60}")
        for stat in ("mean", "median", "p99"):
            print(f"{f'{stat.capitalize()} {name.upper()} (ms):':<44}{report[f'{stat}_{name}_ms']:>16.2f}")
    for error in report["errors"]:
        print(f"error: {error}")
    print("=" * 60)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--length-mode", default="alpaca-like", choices=["fixed", *LENGTH_MODES])
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    sampling_filters.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--json-out", default=None, help="also append the report to this JSON file")
    serve_compare.add_arguments(parser)


def main(ns: argparse.Namespace) -> dict:
    sampling_filters.sampling(ns)  # its flags are checked before anything starts
    if ns.compare:
        return serve_compare.main(ns)
    if ns.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {ns.request_rate}")
    results, duration = asyncio.run(run(ns))
    report = summarize(results, duration) | {"request_rate": ns.request_rate, "max_concurrency": ns.max_concurrency,
                                             "sampling": sampling_filters.sampling(ns)}
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report, ns)
    if ns.json_out:
        from jax_engine.bench.kernels import record_run

        record_run(ns.json_out, {"length_mode": ns.length_mode, "num_prompts": ns.num_prompts,
                                 "seed": ns.seed, "report": report})
    return report
