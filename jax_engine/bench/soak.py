"""`jax-engine bench soak`: mixed, partly hostile traffic against a running server, then a health check.

    jax-engine serve &
    jax-engine bench soak --num-requests 10000

Requests: completions and chat completions, streamed or not, n 1-3, stop strings and seeds, and every other
option a request can set: penalties, logit_bias, allowed_token_ids, bad_words, min_tokens with stop tokens,
logprobs, prompt_logprobs and echo, structured output of each kind (JSON schema, json_object, regex, choice,
grammar) and tools under each tool_choice; clients that disconnect mid-stream, time out (aborts) or stop
reading for a while; invalid bodies (bad JSON, wrong types, lone surrogates, forged roles, oversized values).
At the end it waits for the server to go idle and checks what a soak is for: no 5xx, every KV block free,
nothing running or waiting, and resident memory and memory maps flat once warm (a compiled program adds
both: none may be compiled after start-up).
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


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name"]}
STRUCTURED = [{"structured_outputs": {"json": SCHEMA}}, {"structured_outputs": {"regex": "[a-z]{2,6}( [a-z]{2,6})?"}},
              {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
              {"structured_outputs": {"grammar": 'start: "a" rest\nrest: "b" | "c" rest'}},
              {"response_format": {"type": "json_object"}},
              {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 10}}, "required": ["query"]}}}
TOOL_CHOICES = ["auto", "required", "none", {"type": "function", "function": {"name": "lookup"}}]


def _sampling(rng: random.Random, max_tokens: int, vocab: int = 256) -> dict:
    body = {"max_tokens": rng.randint(1, max_tokens), "n": rng.choice([1, 1, 2, 3]),
            "temperature": rng.choice([0.0, 0.7, 1.0])}
    options = {  # each on in some requests, so that every combination comes up
        "stop": lambda: [rng.choice(WORDS)],
        "seed": lambda: rng.randrange(2**32),
        "presence_penalty": lambda: rng.uniform(-2, 2),
        "frequency_penalty": lambda: rng.uniform(-2, 2),
        "repetition_penalty": lambda: rng.uniform(0.5, 2),
        "top_p": lambda: rng.uniform(0.1, 1),
        "top_k": lambda: rng.randint(1, 50),
        "min_p": lambda: rng.uniform(0, 0.5),
        "logit_bias": lambda: {str(rng.randrange(vocab)): rng.uniform(-100, 100) for _ in range(rng.randint(1, 300))},
        "allowed_token_ids": lambda: [rng.randrange(vocab) for _ in range(rng.randint(1, 200))],
        "bad_words": lambda: [rng.choice(WORDS)],
        "stop_token_ids": lambda: [rng.randrange(vocab) for _ in range(rng.randint(1, 256))],
        "min_tokens": lambda: rng.randint(0, 2),
        "prompt_logprobs": lambda: rng.randint(0, 20),
    }
    for name, value in options.items():
        if rng.random() < 0.15:
            body[name] = value()
    body["min_tokens"] = min(body.get("min_tokens", 0), body["max_tokens"])
    if rng.random() < 0.1:
        body.update(rng.choice(STRUCTURED))
    return body


async def _drain(response: httpx.Response, leave_after: int | None, stall: float = 0.0) -> None:
    """Read a stream to its end, or leave after `leave_after` events (the client disconnects); after the first
    event stop reading for `stall` seconds (the server must buffer no more than a bounded amount meanwhile)."""
    events = 0
    async for line in response.aiter_lines():
        events += line.startswith("data: ")
        if events == 1 and stall:
            await asyncio.sleep(stall)
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
        if rng.random() < 0.3:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 20)
        if rng.random() < 0.1 and not any(k in body for k in ("structured_outputs", "response_format")):
            body["tools"], body["tool_choice"] = [TOOL], rng.choice(TOOL_CHOICES)
    else:
        body["prompt"] = _text(rng, rng.randint(1, 20))
        if rng.random() < 0.2:
            body["logprobs"] = rng.randint(0, 20)
        if rng.random() < 0.1:
            body["echo"] = True
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if rng.random() < 0.1:  # a client that gives up: the server must abort its request
        try:
            await client.post(path, json=body, timeout=rng.uniform(0.01, 0.3))
            return "timeout-abort/finished-first"
        except httpx.TimeoutException:
            return "timeout-abort/left"
    if rng.random() < 0.4:
        leave_after = rng.choice([None, None, 1, 2])
        stall = rng.choice([0.0, 0.0, 0.0, rng.uniform(0.5, 2.0)])
        async with client.stream("POST", path, json={**body, "stream": True}) as response:
            await _drain(response, leave_after, stall)
            kind = "stream" if leave_after is None else "disconnect"
            return f"{kind}{'-stalled' if stall else ''}/{response.status_code}"
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
        slots, outcomes, rss, maps = asyncio.Semaphore(concurrency), Counter(), {}, {}
        warm_at = max(1, int(num_requests * warm_fraction))
        tenth = max(1, num_requests // 10)

        async def worker(i: int) -> None:
            async with slots:
                if i == warm_at:
                    rss["warm"] = await _metric(client, "process_resident_memory_bytes")
                if i % tenth == 0:
                    rss[i] = await _metric(client, "process_resident_memory_bytes")
                    maps[i] = await _metric(client, "jax_engine:num_memory_maps")
                try:
                    outcomes[await _one(client, random.Random(rng.random()), max_tokens)] += 1
                except httpx.TransportError as error:  # the server dropped a connection: count it, go on
                    outcomes[f"transport-error/{type(error).__name__}"] += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(num_requests)))
        duration = time.perf_counter() - started
        idle = await _wait_idle(client, timeout=60)
        rss["end"] = await _metric(client, "process_resident_memory_bytes")
        maps["end"] = await _metric(client, "jax_engine:num_memory_maps")
        compilations = await _metric(client, "jax_engine:compilations_total")
        health = (await client.get("/health")).status_code
    statuses = Counter(int(o.split("/")[1]) for o in outcomes if o.split("/")[1].isdigit())
    return {"num_requests": num_requests, "duration_s": round(duration, 1),
            "requests_per_s": round(num_requests / duration, 1), "outcomes": dict(sorted(outcomes.items())),
            "num_5xx": sum(n for status, n in statuses.items() if status >= 500),
            "idle_with_every_block_free": idle, "health": health,
            "rss_warm_mb": round(rss.get("warm", rss["end"]) / 2**20, 1), "rss_end_mb": round(rss["end"] / 2**20, 1),
            "rss_growth_mb": round((rss["end"] - rss.get("warm", rss["end"])) / 2**20, 1),
            "rss_mb_every_tenth": [round(rss[i] / 2**20) for i in sorted(k for k in rss if isinstance(k, int))],
            "rss_slope_mb_per_1000_requests": _slope(rss, warm_at, 1000 / 2**20),
            "memory_maps_every_tenth": [int(maps[i]) for i in sorted(k for k in maps if isinstance(k, int))],
            "memory_maps_growth": int(maps["end"] - maps[min(k for k in maps if isinstance(k, int) and k >= warm_at)]
                                      if any(isinstance(k, int) and k >= warm_at for k in maps) else 0),
            "compilations_after_start_up": int(compilations)}


def _slope(samples: dict, since: int, scale: float) -> float:
    """Least-squares slope of the samples taken at request counts >= `since`, times `scale`."""
    points = sorted((k, v) for k, v in samples.items() if isinstance(k, int) and k >= since)
    if len(points) < 3:
        return 0.0
    xs, ys = zip(*points)
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    return round(slope * scale, 2)


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
