"""`jax-engine bench soak`: mixed, partly hostile traffic against a running server, then a health check.

    jax-engine serve &
    jax-engine bench soak --duration 600      # or --num-requests 10000

Requests: completions and chat completions, streamed or not, n 1-3, stop strings and seeds, and every other
option a request can set: penalties, logit_bias, allowed_token_ids, bad_words, min_tokens with stop tokens,
logprobs, prompt_logprobs and echo, structured output of each kind (JSON schema, json_object, regex, choice,
grammar) and tools under each tool_choice; clients that disconnect mid-stream, time out (aborts) or stop
reading for a while; invalid bodies (bad JSON, wrong types, lone surrogates, forged roles, oversized values).
At the end it waits for the server to go idle and checks what a soak is for: no 5xx, every KV block free,
nothing running or waiting, and resident memory and memory maps flat once warm (a compiled program adds
both: none may be compiled after start-up). Valid requests the server refuses (a 400 for a limit, say) are
listed by their error message, so that a refusal nobody meant shows.
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


def _refusal(response: httpx.Response) -> str | None:
    """The error message of a 4xx answer to a request the soak meant as valid, digits blurred so they group."""
    if not 400 <= response.status_code < 500:
        return None
    try:
        message = json.loads(response.content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    return re.sub(r"\d+", "N", str(message))[:160]


async def _one(client: httpx.AsyncClient, rng: random.Random, max_tokens: int, refusals: Counter) -> str:
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
            if response.status_code >= 400:
                await response.aread()
                refusals[_refusal(response)] += 1
            await _drain(response, leave_after, stall)
            kind = "stream" if leave_after is None else "disconnect"
            return f"{kind}{'-stalled' if stall else ''}/{response.status_code}"
    response = await client.post(path, json=body)
    if (refusal := _refusal(response)) is not None:
        refusals[refusal] += 1
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


async def soak(base_url: str, num_requests: int | None = None, duration_s: float | None = None,
               concurrency: int = 16, max_tokens: int = 16, seed: int = 0, api_key: str | None = None,
               warm_fraction: float = 0.2, num_samples: int = 10) -> dict:
    """Run the soak, `num_requests` requests or for `duration_s` seconds, and return its figures (see the module
    docstring). Resident memory and memory maps are sampled `num_samples` times, on the clock for a timed soak."""
    if (num_requests is None) == (duration_s is None):
        raise ValueError("give the soak either num_requests or duration_s")
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120, limits=limits) as client:
        outcomes, refusals, samples = Counter(), Counter(), []  # samples: (requests done, rss, memory maps)
        started = time.perf_counter()
        sent = 0

        def progress() -> float:  # how far the soak is, 0 to 1
            if duration_s is not None:
                return (time.perf_counter() - started) / duration_s
            return sent / num_requests

        async def sample() -> None:
            samples.append((sum(outcomes.values()), await _metric(client, "process_resident_memory_bytes"),
                            await _metric(client, "jax_engine:num_memory_maps")))

        async def worker() -> None:
            nonlocal sent
            while progress() < 1:
                sent += 1
                try:
                    outcomes[await _one(client, random.Random(rng.random()), max_tokens, refusals)] += 1
                except httpx.TransportError as error:  # the server dropped a connection: count it, go on
                    outcomes[f"transport-error/{type(error).__name__}"] += 1

        async def sampler() -> None:
            for k in range(num_samples):
                while progress() < k / num_samples:
                    await asyncio.sleep(0.05)
                await sample()

        await asyncio.gather(sampler(), *(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - started
        idle = await _wait_idle(client, timeout=60)
        await sample()
        compilations = await _metric(client, "jax_engine:compilations_total")
        health = (await client.get("/health")).status_code
    return _figures(outcomes, refusals, samples, duration, warm_fraction, idle, health, compilations)


def _figures(outcomes: Counter, refusals: Counter, samples: list[tuple], duration: float, warm_fraction: float,
             idle: bool, health: int, compilations: float) -> dict:
    """The soak's figures from what it saw: its outcomes, its memory samples (requests done, rss, memory maps;
    growth counts from the first sample after `warm_fraction` of the requests) and the server's state after."""
    done = sum(outcomes.values())
    warm = [s for s in samples if s[0] >= warm_fraction * done] or samples[-1:]
    statuses = Counter(int(o.split("/")[1]) for o in outcomes if o.split("/")[1].isdigit())
    return {"num_requests": done, "duration_s": round(duration, 1), "requests_per_s": round(done / duration, 1),
            "outcomes": dict(sorted(outcomes.items())), "refused_valid_requests": dict(refusals.most_common()),
            "num_5xx": sum(n for status, n in statuses.items() if status >= 500),
            "idle_with_every_block_free": idle, "health": health,
            "rss_warm_mb": round(warm[0][1] / 2**20, 1), "rss_end_mb": round(samples[-1][1] / 2**20, 1),
            "rss_growth_mb": round((samples[-1][1] - warm[0][1]) / 2**20, 1),
            "rss_mb_samples": [round(s[1] / 2**20) for s in samples],
            "rss_slope_mb_per_1000_requests": _slope([(s[0], s[1]) for s in warm], 1000 / 2**20),
            "memory_maps_samples": [int(s[2]) for s in samples],
            "memory_maps_growth": int(samples[-1][2] - warm[0][2]),
            "compilations_after_start_up": int(compilations)}


def _slope(points: list[tuple[float, float]], scale: float) -> float:
    """Least-squares slope of (x, y) points, times `scale`."""
    if len({x for x, _ in points}) < 3:
        return 0.0
    xs, ys = zip(*points)
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    return round(slope * scale, 2)


def add_length_arguments(parser: argparse.ArgumentParser) -> None:
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--num-requests", type=int, default=None, help="send this many requests")
    length.add_argument("--duration", type=float, default=None, help="send requests for this many seconds "
                        "(the default: 600)")


def soak_length(ns: argparse.Namespace) -> dict:
    """The soak's length from --num-requests or --duration: 10 minutes when neither is given."""
    if ns.num_requests is not None:
        return {"num_requests": ns.num_requests}
    return {"duration_s": 600.0 if ns.duration is None else ns.duration}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    add_length_arguments(parser)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens a request asks for")
    parser.add_argument("--seed", type=int, default=0)


def main(ns: argparse.Namespace) -> dict:
    report = asyncio.run(soak(ns.base_url, **soak_length(ns), concurrency=ns.concurrency, max_tokens=ns.max_tokens,
                              seed=ns.seed, api_key=ns.api_key))
    print(json.dumps(report, indent=2))
    if report["num_5xx"] or not report["idle_with_every_block_free"] or report["health"] != 200:
        raise SystemExit("soak: FAILED (5xx answers, blocks left held, or an unhealthy server)")
    return report
