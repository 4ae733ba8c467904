"""`jax-engine bench soak`: mixed, partly hostile traffic against a running server, then a health check.

    jax-engine serve &
    jax-engine bench soak --num-requests 10000

Requests: completions and chat completions, streamed or not, n 1-3, stop strings and seeds; clients that
disconnect mid-stream or time out (aborts); invalid bodies (bad JSON, wrong types, lone surrogates, forged
roles, oversized values). At the end it waits for the server to go idle and checks what a soak is for:
no 5xx, every KV block free, nothing running or waiting, and resident memory once warm.
"""

import argparse
import asyncio
import json
import random
import re
import time
from collections import Counter

import httpx

WORDS = ("river mountain library engine quantum harvest melody violet summer winter journey paged attention "
         "block table scheduler kernel cache prefix token").split()
INVALID_BODIES = [
    b"{not json",
    json.dumps({"prompt": "hi", "max_tokens": "5"}).encode(),
    json.dumps({"prompt": [True, False]}).encode(),
    json.dumps({"prompt": "hi", "top_k": 2**31}).encode(),
    json.dumps({"prompt": "hi", "min_tokens": 2, "stop_token_ids": [2**31]}).encode(),
    json.dumps({"prompt": "hi", "temperature": -1}).encode(),
    json.dumps({"prompt": "a\ud800b"}).encode(),
    json.dumps({"prompt": "hi", "stop": ["x"] * 1000}).encode(),
    json.dumps({"prompt": "hi", "n": 10**6}).encode(),
    json.dumps({"prompt": "hi", "max_tokens": 10**9}).encode(),
]
INVALID_CHATS = [json.dumps(body).encode() for body in (  # json.dumps escapes the surrogate, as a client could
    {"messages": [{"role": "system<|im_end|>", "content": "forged"}]},
    {"messages": [{"role": "user", "content": "\udfff"}]},
    {"messages": []},
)]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _sampling(rng: random.Random, max_tokens: int) -> dict:
    body = {"max_tokens": rng.randint(1, max_tokens), "n": rng.choice([1, 1, 2, 3]),
            "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2**32)
    return body


async def _drain(response: httpx.Response, leave_after: int | None) -> None:
    """Read a stream to its end, or leave after `leave_after` events (the client disconnects)."""
    events = 0
    async for line in response.aiter_lines():
        events += line.startswith("data: ")
        if leave_after is not None and events >= leave_after:
            return


async def _one(client: httpx.AsyncClient, rng: random.Random, max_tokens: int) -> str:
    """Send one request of a random kind; return its kind and outcome, e.g. 'stream/200'."""
    roll = rng.random()
    if roll < 0.13:
        path, body = (("/v1/completions", rng.choice(INVALID_BODIES)) if roll < 0.1
                      else ("/v1/chat/completions", rng.choice(INVALID_CHATS)))
        response = await client.post(path, content=body, headers={"content-type": "application/json"})
        return f"invalid/{response.status_code}"
    chat = roll < 0.35
    body = _sampling(rng, max_tokens)
    if chat:
        body["messages"] = [{"role": "user", "content": _text(rng, rng.randint(1, 12))}]
    else:
        body["prompt"] = _text(rng, rng.randint(1, 20))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if rng.random() < 0.1:  # a client that gives up: the server must abort its request
        try:
            await client.post(path, json=body, timeout=rng.uniform(0.01, 0.3))
            return "timeout-abort/finished-first"
        except httpx.TimeoutException:
            return "timeout-abort/left"
    if rng.random() < 0.4:
        leave_after = rng.choice([None, None, 1, 2])
        async with client.stream("POST", path, json={**body, "stream": True}) as response:
            await _drain(response, leave_after)
            return f"{'stream' if leave_after is None else 'disconnect'}/{response.status_code}"
    response = await client.post(path, json=body)
    return f"{'chat' if chat else 'completion'}/{response.status_code}"


async def _metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{name} is not in /metrics")
    return float(match.group(1))


async def _wait_idle(client: httpx.AsyncClient, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = await _metric(client, "vllm:num_requests_running")
        waiting = await _metric(client, "vllm:num_requests_waiting")
        free, total = await _metric(client, "vllm:num_free_kv_blocks"), await _metric(client, "vllm:num_kv_blocks")
        if running == waiting == 0 and free == total:
            return True
        await asyncio.sleep(0.2)
    return False


async def soak(base_url: str, num_requests: int, concurrency: int = 16, max_tokens: int = 16, seed: int = 0,
               api_key: str | None = None, warm_fraction: float = 0.2) -> dict:
    """Run the soak and return its figures (see the module docstring)."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120, limits=limits) as client:
        slots, outcomes, rss = asyncio.Semaphore(concurrency), Counter(), {}
        warm_at = max(1, int(num_requests * warm_fraction))
        tenth = max(1, num_requests // 10)

        async def worker(i: int) -> None:
            async with slots:
                if i == warm_at:
                    rss["warm"] = await _metric(client, "process_resident_memory_bytes")
                if i % tenth == 0:
                    rss[i] = await _metric(client, "process_resident_memory_bytes")
                try:
                    outcomes[await _one(client, random.Random(rng.random()), max_tokens)] += 1
                except httpx.TransportError as error:  # the server dropped a connection: count it, go on
                    outcomes[f"transport-error/{type(error).__name__}"] += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(num_requests)))
        duration = time.perf_counter() - started
        idle = await _wait_idle(client, timeout=60)
        rss["end"] = await _metric(client, "process_resident_memory_bytes")
        health = (await client.get("/health")).status_code
    statuses = Counter(int(o.split("/")[1]) for o in outcomes if o.split("/")[1].isdigit())
    return {"num_requests": num_requests, "duration_s": round(duration, 1),
            "requests_per_s": round(num_requests / duration, 1), "outcomes": dict(sorted(outcomes.items())),
            "num_5xx": sum(n for status, n in statuses.items() if status >= 500),
            "idle_with_every_block_free": idle, "health": health,
            "rss_warm_mb": round(rss.get("warm", rss["end"]) / 2**20, 1), "rss_end_mb": round(rss["end"] / 2**20, 1),
            "rss_growth_mb": round((rss["end"] - rss.get("warm", rss["end"])) / 2**20, 1),
            "rss_mb_every_tenth": [round(rss[i] / 2**20) for i in sorted(k for k in rss if isinstance(k, int))]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens a request asks for")
    parser.add_argument("--seed", type=int, default=0)


def main(ns: argparse.Namespace) -> dict:
    report = asyncio.run(soak(ns.base_url, ns.num_requests, ns.concurrency, ns.max_tokens, ns.seed, ns.api_key))
    print(json.dumps(report, indent=2))
    if report["num_5xx"] or not report["idle_with_every_block_free"] or report["health"] != 200:
        raise SystemExit("soak: FAILED (5xx answers, blocks left held, or an unhealthy server)")
    return report
