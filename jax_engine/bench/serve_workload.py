"""The client side of `jax-engine bench serve`: a workload of streamed completions, sent at its arrival times, and
the report vLLM's `bench serve` prints (TTFT, TPOT, ITL, end-to-end latency, and the paper's normalized latency).
"""

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from jax_engine.bench.sampling_filters import sampling
from jax_engine.bench.workloads import request_lengths

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


@dataclass
class Workload:
    bodies: list[dict]  # streamed /v1/completions requests, prompts as token ids
    gaps: np.ndarray  # seconds from each arrival to the next


def client_for(base_url: str, api_key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits)


async def make_workload(client: httpx.AsyncClient, ns: argparse.Namespace, request_rate: float) -> Workload:
    """--num-prompts requests of --length-mode lengths from --seed, prompts drawn from the server's tokens."""
    model, max_model_len = await _model_info(client)
    pool = await _token_pool(client)
    inputs, outputs, rng = request_lengths(ns.num_prompts, ns.length_mode, max_model_len, ns.input_len,
                                           ns.output_len, ns.seed)
    filters = sampling(ns)
    bodies = [{"model": model, "prompt": rng.choice(pool, n).tolist(), "max_tokens": int(o), "ignore_eos": True,
               **filters, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
              for i, (n, o) in enumerate(zip(inputs, outputs))]
    gaps = rng.exponential(1.0 / request_rate, len(bodies)) if np.isfinite(request_rate) else np.zeros(len(bodies))
    return Workload(bodies, gaps)


async def send_workload(client: httpx.AsyncClient, workload: Workload,
                        max_concurrency: int | None = None) -> tuple[list[RequestResult], float]:
    """Send each request at its arrival time (at most `max_concurrency` in flight); the results and the duration."""
    limit = asyncio.Semaphore(max_concurrency or len(workload.bodies))

    async def one(body: dict) -> RequestResult:
        async with limit:
            return await _send(client, body)

    started, tasks = time.perf_counter(), []
    for body, gap in zip(workload.bodies, workload.gaps):
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
