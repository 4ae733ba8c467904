"""Prometheus metrics for /metrics, under vLLM's names (vllm:...), so existing dashboards work.

Gauges and engine counters are read from the engine when scraped, from each data-parallel replica with the label
engine="r" (vLLM's); latencies and token counts are observed as outputs arrive from any replica
(AsyncLLMEngine.on_output). Speculative decoding's counters appear only when it is configured, as in vLLM.

With `--api-server-count N` each API server process counts what it served in prometheus_client's multiprocess
files (PROMETHEUS_MULTIPROC_DIR, set by api_servers.py), and /metrics, whichever process answers it, sums them; the
engine's gauges and counters are the one core's, as every API server sees them. The process_* metrics are left
out there, as in vLLM's multiprocess mode.
"""

import os
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jax_engine.async_llm_engine import AsyncLLMEngine
from jax_engine.outputs import PoolingRequestOutput, RequestOutput
from jax_engine.server.api_servers import METRICS_DIR_ENV

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0


class _EngineCollector:
    """Reads the engines' state at scrape time: one sample per data-parallel replica, labelled engine="r" as vLLM
    labels its engine cores (one replica: engine="0"), so that sum by (model_name) gives the server's totals."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.replicas = getattr(engine, "replicas", [engine])  # DataParallelEngine, or one AsyncLLMEngine
        self.model_name = model_name

    def collect(self):
        families = {}

        def add(family, name: str, doc: str, labels: dict, value) -> None:
            families.setdefault(name, family(name, doc, labels=list(labels))).add_metric(list(labels.values()), value)

        for r, replica in enumerate(self.replicas):
            labels = {"model_name": self.model_name, "engine": str(r)}
            for family, name, doc, value in _replica_values(replica):
                add(family, name, doc, labels, value)
            if replica.engine.speculator is not None:  # vLLM's spec-decode counters, only when it is configured
                counters = replica.engine.speculator.stats()
                for key, doc in _SPEC_DECODE_COUNTERS:
                    add(CounterMetricFamily, f"vllm:spec_decode_{key}", doc, labels, counters[key])
                for position, count in enumerate(counters["num_accepted_tokens_per_pos"]):
                    add(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens_per_pos", "Drafted tokens "
                        "accepted, by position in the draft (0 = the first).", labels | {"position": str(position)},
                        count)
        yield from families.values()
        maps = GaugeMetricFamily("jax_engine:num_memory_maps", "Memory maps of the server process (each compiled "
                                 "program adds some; the kernel caps them at vm.max_map_count).",
                                 labels=["model_name"])
        maps.add_metric([self.model_name], _memory_maps())
        yield maps


# The acceptance rate and mean acceptance length are left to PromQL, as vLLM leaves them (rate(accepted) /
# rate(draft tokens), 1 + rate(accepted) / rate(drafts)).
_SPEC_DECODE_COUNTERS = (("num_drafts", "Verification steps of drafted tokens (one per sequence and step)."),
                         ("num_draft_tokens", "Drafted tokens verified."),
                         ("num_accepted_tokens", "Drafted tokens accepted."))


def _replica_values(replica: AsyncLLMEngine) -> list[tuple]:
    """(family, name, help, value) of one replica's gauges and counters."""
    stats = replica.engine.stats()
    return [
        (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.",
         replica.num_running_requests()),
        (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to start.", replica.num_waiting_requests()),
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
        (CounterMetricFamily, "jax_engine:program_evictions", "Programs compiled after start-up and freed again "
         "(at most MAX_LATE_PROGRAMS are kept).", stats["num_program_evictions"]),
    ]


class ServingMetrics:
    """The registry behind /metrics, fed by every RequestOutput the engine loop dispatches."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._engine_collector = _EngineCollector(engine, model_name)
        self.registry.register(self._engine_collector)
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

    def observe(self, output: RequestOutput | PoolingRequestOutput) -> None:
        if isinstance(output, PoolingRequestOutput):  # one output, when its prompt is done: no tokens generated
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            return
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
        reported = previous[0] if previous else 0
        if num_tokens > reported:  # not before its first token: a prompt computed in chunks reports 0 tokens
            self.generation_tokens.inc(num_tokens - reported)
            self._seen[output.request_id] = (num_tokens, now)
        if output.finished:
            self._seen.pop(output.request_id, None)

    def render(self) -> bytes:
        if os.environ.get(METRICS_DIR_ENV):  # one of several API servers: all of their counts
            registry = self._all_servers_counts()
            registry.register(self._engine_collector)
            return generate_latest(registry)
        return generate_latest(self.registry)

    def token_totals(self) -> tuple[float, float]:
        """Prompt and generation tokens counted so far, every API server's: /metrics' two counters."""
        registry = self._all_servers_counts() if os.environ.get(METRICS_DIR_ENV) else self.registry
        totals = dict.fromkeys(("vllm:prompt_tokens", "vllm:generation_tokens"), 0.0)
        for family in registry.collect():
            if family.name in totals:
                totals[family.name] += sum(s.value for s in family.samples if s.name == f"{family.name}_total")
        return totals["vllm:prompt_tokens"], totals["vllm:generation_tokens"]

    @staticmethod
    def _all_servers_counts() -> CollectorRegistry:
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return registry
