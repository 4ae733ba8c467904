"""vLLM's periodic log line: every VLLM_LOG_STATS_INTERVAL seconds (10), what the server served since the last line
and where the engine stands, at INFO while there is work and at DEBUG when idle, as vLLM logs it.
`--disable-log-stats` turns it off; with --api-server-count N, the first API server alone logs, the others' tokens
counted in (they are /metrics' figures)."""

import asyncio
import logging
import time
from typing import NamedTuple

from jax_engine.server.metrics import ServingMetrics

logger = logging.getLogger(__name__)


class Counts(NamedTuple):
    """What the server has counted so far, at `time`."""

    time: float
    prompt_tokens: float
    generation_tokens: float
    prefix_cache_queries: int
    prefix_cache_hits: int


class StatsLogger:
    def __init__(self, engine, metrics: ServingMetrics, interval: float) -> None:
        self.replicas = getattr(engine, "replicas", [engine])  # DataParallelEngine, or one AsyncLLMEngine
        self.metrics, self.interval = metrics, interval
        self._last = self._counts([replica.engine.stats() for replica in self.replicas])

    def _counts(self, stats: list[dict]) -> Counts:
        return Counts(time.monotonic(), *self.metrics.token_totals(), sum(s["prefix_cache_queries"] for s in stats),
                      sum(s["prefix_cache_hits"] for s in stats))

    def line(self) -> tuple[str, bool]:
        """The line for the time since the last one, and whether the server was idle through it."""
        stats = [replica.engine.stats() for replica in self.replicas]
        then, now = self._last, self._counts(stats)
        self._last = now
        seconds = max(now.time - then.time, 1e-9)
        prompt, generated = now.prompt_tokens - then.prompt_tokens, now.generation_tokens - then.generation_tokens
        hit_rate = (now.prefix_cache_hits - then.prefix_cache_hits) / max(
            now.prefix_cache_queries - then.prefix_cache_queries, 1)
        running = sum(replica.num_running_requests() for replica in self.replicas)
        waiting = sum(replica.num_waiting_requests() for replica in self.replicas)
        usage = " / ".join(f"{s['kv_cache_usage']:.1%}" for s in stats)
        text = (f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, Avg generation throughput: "
                f"{generated / seconds:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {usage}, Prefix cache hit rate: {hit_rate:.1%}")
        return text, prompt == generated == 0 and running == waiting == 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                text, idle = self.line()
            except Exception:  # a line is not worth the server: say why, and try again next time
                logger.exception("the stats line could not be made")
                continue
            logger.log(logging.DEBUG if idle else logging.INFO, text)
