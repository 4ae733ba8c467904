"""`jax-engine bench serve`: latency and throughput of a running server under load (vLLM's `bench serve`).

    jax-engine serve &
    jax-engine bench serve --num-prompts 64 --request-rate 2 --length-mode alpaca-like

Requests arrive as a Poisson process at --request-rate per second (inf: all at once), optionally at most
--max-concurrency in flight. Each streams a completion of exactly its output length (EOS ignored) over
/v1/completions; TTFT, TPOT, ITL and end-to-end latency come from the client's clock.
"""

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from jax_engine.bench.workloads import LENGTH_MODES, request_lengths

# Text whose tokens make up the random prompts (the server tokenizes it once, so ids are valid for its model).
_VOCABULARY_TEXT = (
    "The quick brown fox jumps over the lazy dog while a paged attention kernel reads keys and values from "
    "blocks scattered across memory; schedulers batch requests every iteration, preempt the latest arrival, "
    "and share prefixes copy-on-write. Numbers 0 1 2 3 4 5 6 7 8 9, words like river, mountain, library, "
    "engine, quantum, harvest, melody, violet, summer, winter, journey, and punctuation: ; , . ! ? ( ) ")


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


async def _send(client: httpx.AsyncClient, body: dict) -> RequestResult:
    started = last = time.perf_counter()
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return RequestResult(False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk, now = json.loads(line[len("data: "):]), time.perf_counter()
                if "error" in chunk:
                    return RequestResult(False, error=chunk["error"]["message"])
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    if result.ttft == 0.0:
                        result.ttft = now - started
                    else:
                        result.itls.append(now - last)
                    last = now
    except httpx.HTTPError as error:
        return RequestResult(False, error=repr(error))
    result.latency, result.ok = time.perf_counter() - started, True
    return result


async def _token_pool(client: httpx.AsyncClient) -> list[int]:
    response = await client.post("/tokenize", json={"prompt": _VOCABULARY_TEXT, "add_special_tokens": False})
    response.raise_for_status()
    return sorted(set(response.json()["tokens"]))


async def _model_info(client: httpx.AsyncClient) -> tuple[str, int]:
    response = await client.get("/v1/models")
    response.raise_for_status()
    card = response.json()["data"][0]
    return card["id"], card["max_model_len"]


async def run(ns: argparse.Namespace) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=ns.base_url, headers=headers, timeout=None, limits=limits) as client:
        model, max_model_len = await _model_info(client)
        pool = await _token_pool(client)
        inputs, outputs, rng = request_lengths(ns.num_prompts, ns.length_mode, max_model_len, ns.input_len,
                                               ns.output_len, ns.seed)
        bodies = [{"model": model, "prompt": rng.choice(pool, n).tolist(), "max_tokens": int(o), "ignore_eos": True,
                   "temperature": 1.0, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
                  for i, (n, o) in enumerate(zip(inputs, outputs))]
        gaps = rng.exponential(1.0 / ns.request_rate, len(bodies)) if np.isfinite(ns.request_rate) else np.zeros(len(bodies))
        limit = asyncio.Semaphore(ns.max_concurrency or len(bodies))

        async def one(body: dict) -> RequestResult:
            async with limit:
                return await _send(client, body)

        started, tasks = time.perf_counter(), []
        for body, gap in zip(bodies, gaps):
            tasks.append(asyncio.create_task(one(body)))
            await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - started


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    report = {"successful_requests": len(ok), "failed_requests": len(results) - len(ok), "duration_s": duration,
              "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
              "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
              "total_token_throughput": (prompt_tokens + output_tokens) / duration}
    series = {"ttft": [r.ttft for r in ok], "tpot": tpots, "itl": [x for r in ok for x in r.itls],
              "e2el": [r.latency for r in ok]}
    for name, values in series.items():
        values = np.array(values or [0.0]) * 1000
        report |= {f"mean_{name}_ms": float(values.mean()), f"median_{name}_ms": float(np.median(values)),
                   f"p99_{name}_ms": float(np.percentile(values, 99))}
    # The PagedAttention paper's normalized latency: each request's end-to-end latency over its output length.
    normalized = [r.latency / r.output_tokens for r in ok if r.output_tokens]
    report["mean_normalized_latency_ms"] = float(np.mean(normalized or [0.0]) * 1000)
    report["errors"] = sorted({r.error for r in results if not r.ok})[:5]
    return report


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
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--json-out", default=None, help="also append the report to this JSON file")


def main(ns: argparse.Namespace) -> dict:
    if ns.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {ns.request_rate}")
    results, duration = asyncio.run(run(ns))
    report = summarize(results, duration) | {"request_rate": ns.request_rate, "max_concurrency": ns.max_concurrency}
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report, ns)
    if ns.json_out:
        from jax_engine.bench.kernels import record_run

        record_run(ns.json_out, {"length_mode": ns.length_mode, "num_prompts": ns.num_prompts,
                                 "seed": ns.seed, "report": report})
    return report
