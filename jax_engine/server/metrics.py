"""Prometheus metrics for /metrics, under vLLM's names (vllm:...), so existing dashboards work.

Gauges and engine counters are read from the engine when scraped; latencies are observed as outputs
arrive (AsyncLLMEngine.on_output). Speculative decoding's counters appear only when it is configured, as in vLLM.
"""

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jax_engine.async_llm_engine import AsyncLLMEngine
from jax_engine.outputs import RequestOutput

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0


class _EngineCollector:
    """Reads the engine's state at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine, self.labels = engine, {"model_name": model_name}

    def collect(self):
        stats = self.engine.engine.stats()
        values = [
            (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.",
             self.engine.num_running_requests()),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to start.",
             self.engine.num_waiting_requests()),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
             stats["kv_cache_usage"]),
            (GaugeMetricFamily, "vllm:num_free_kv_blocks", "Free KV-cache blocks (cached ones count as free).",
             stats["num_free_blocks"]),
            (GaugeMetricFamily, "vllm:num_kv_blocks", "KV-cache blocks in all.", stats["num_blocks"]),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats["prefix_cache_queries"]),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats["prefix_cache_hits"]),
            (CounterMetricFamily, "vllm:num_preemptions", "Sequences preempted for lack of KV blocks.",
             stats["num_preemptions"]),
            (GaugeMetricFamily, "jax_engine:num_programs", "Compiled device programs held (start-up's and later "
             "ones).", stats["num_programs"]),
            (CounterMetricFamily, "jax_engine:compilations", "Programs compiled after start-up (each is logged with "
             "its cause).", stats["num_compilations"]),
            (CounterMetricFamily, "jax_engine:compile_seconds", "Seconds spent compiling after start-up.",
             stats["compile_seconds"]),
            (GaugeMetricFamily, "jax_engine:num_memory_maps", "Memory maps of the server process (each compiled "
             "program adds some; the kernel caps them at vm.max_map_count).", _memory_maps()),
            (CounterMetricFamily, "jax_engine:program_evictions", "Programs compiled after start-up and freed again "
             "(at most MAX_LATE_PROGRAMS are kept).", stats["num_program_evictions"]),
        ]
        for family, name, doc, value in values:
            metric = family(name, doc, labels=list(self.labels))
            metric.add_metric(list(self.labels.values()), value)
            yield metric
        spec_decode = _spec_decode_counters(self.engine)
        if spec_decode is not None:
            yield from self._spec_decode_metrics(spec_decode)

    def _spec_decode_metrics(self, counters: dict):
        """vLLM's spec-decode counters; the acceptance rate and mean acceptance length are left to PromQL, as
        vLLM leaves them (rate(accepted) / rate(draft tokens), 1 + rate(accepted) / rate(drafts))."""
        for key, doc in (("num_drafts", "Verification steps of drafted tokens (one per sequence and step)."),
                         ("num_draft_tokens", "Drafted tokens verified."),
                         ("num_accepted_tokens", "Drafted tokens accepted.")):
            metric = CounterMetricFamily(f"vllm:spec_decode_{key}", doc, labels=list(self.labels))
            metric.add_metric(list(self.labels.values()), counters[key])
            yield metric
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Drafted tokens accepted, by position in the draft (0 = the first).",
                                           labels=[*self.labels, "position"])
        for position, count in enumerate(counters["num_accepted_tokens_per_pos"]):
            per_position.add_metric([*self.labels.values(), str(position)], count)
        yield per_position


def _spec_decode_counters(engine) -> dict | None:
    """The speculators' counters, summed over data-parallel replicas (the gauges above are replica 0's, but these
    are totals a dashboard would add up anyway); None when speculation is off."""
    replicas = getattr(engine, "replicas", [engine])  # DataParallelEngine, or one AsyncLLMEngine
    counters = [r.engine.speculator.stats() for r in replicas if r.engine.speculator is not None]
    if not counters:
        return None
    totals = {key: sum(c[key] for c in counters) for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    per_pos = [sum(pos) for pos in zip(*(c["num_accepted_tokens_per_pos"] for c in counters))]
    return totals | {"num_accepted_tokens_per_pos": per_pos}


class ServingMetrics:
    """The registry behind /metrics, fed by every RequestOutput the engine loop dispatches."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.registry.register(_EngineCollector(engine, model_name))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and friends, as vLLM has
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", list(labels),
                                     registry=self.registry).labels(**labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", list(labels),
                                         registry=self.registry).labels(**labels)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first generated token.",
                              list(labels), buckets=_TTFT_BUCKETS, registry=self.registry).labels(**labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two generated tokens.",
                             list(labels), buckets=_ITL_BUCKETS, registry=self.registry).labels(**labels)
        self._seen: dict[str, tuple[int, float]] = {}  # request id -> (tokens reported, time of the last)
        engine.on_output = self.observe

    def observe(self, output: RequestOutput) -> None:
        now = time.time()
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        previous = self._seen.get(output.request_id)
        if previous is None and num_tokens:
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            if output.metrics is not None:
                self.ttft.observe(max(0.0, now - output.metrics.arrival_time))
        elif previous is not None and num_tokens > previous[0]:
            gap = (now - previous[1]) / (num_tokens - previous[0])
            for _ in range(num_tokens - previous[0]):
                self.itl.observe(gap)
        if previous is None or num_tokens > previous[0]:
            self.generation_tokens.inc(num_tokens - (previous[0] if previous else 0))
            self._seen[output.request_id] = (num_tokens, now)
        if output.finished:
            self._seen.pop(output.request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)
