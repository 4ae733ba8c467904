"""vLLM's periodic log line: every VLLM_LOG_STATS_INTERVAL seconds (10), what the server served since the last line
and where the engine stands, at INFO while there is work and at DEBUG when idle, as vLLM logs it.
`--disable-log-stats` turns it off; with --api-server-count N, the first API server alone logs, the others' tokens
counted in (they are /metrics' figures)."""

import asyncio
import logging
import time

from jax_engine.server.metrics import ServingMetrics

logger = logging.getLogger(__name__)


class StatsLogger:
    def __init__(self, engine, metrics: ServingMetrics, interval: float) -> None:
        self.replicas = getattr(engine, "replicas", [engine])  # DataParallelEngine, or one AsyncLLMEngine
        self.metrics, self.interval = metrics, interval
        self._last = self._counts()

    def _counts(self) -> tuple[float, float, float, int, int]:
        """(time, prompt tokens, generation tokens, prefix-cache queries, hits) so far."""
        stats = [replica.engine.stats() for replica in self.replicas]
        return (time.monotonic(), *self.metrics.token_totals(), sum(s["prefix_cache_queries"] for s in stats),
                sum(s["prefix_cache_hits"] for s in stats))

    def line(self) -> tuple[str, bool]:
        """The line for the time since the last one, and whether the server was idle through it."""
        now = self._counts()
        (then, prompt, generated, queries, hits), self._last = self._last, now
        seconds = max(now[0] - then, 1e-9)
        running = sum(replica.num_running_requests() for replica in self.replicas)
        waiting = sum(replica.num_waiting_requests() for replica in self.replicas)
        usage = " / ".join(f"{replica.engine.stats()['kv_cache_usage']:.1%}" for replica in self.replicas)
        looked_up = now[3] - queries
        text = (f"Avg prompt throughput: {(now[1] - prompt) / seconds:.1f} tokens/s, Avg generation throughput: "
                f"{(now[2] - generated) / seconds:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {usage}, Prefix cache hit rate: {(now[4] - hits) / max(looked_up, 1):.1%}")
        return text, now[1:3] == (prompt, generated) and running == waiting == 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                text, idle = self.line()
            except Exception:  # a line is not worth the server: say why, and try again next time
                logger.exception("the stats line could not be made")
                continue
            logger.log(logging.DEBUG if idle else logging.INFO, text)
