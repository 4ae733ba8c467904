"""The discrete-event loop: requests arrive on the workload's clock, the system steps, each step advances the
clock by its cost; and what a run reports, as the paper's figures measure it."""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from simulator.workload import TraceRequest


@dataclass(frozen=True)
class Report:
    """One (system, rate) run. normalized_latency: the paper's metric, each request's end-to-end seconds over its
    output tokens, averaged over requests; mean_batched_requests: requests per step, weighted by each step's time
    (the paper's Fig. 13)."""

    system: str
    rate: float
    normalized_latency: float
    mean_batched_requests: float
    throughput_tokens_per_s: float
    preemptions: int
    mean_kv_usage: float
    mean_ttft_s: float
    duration_s: float

    def row(self) -> str:
        return (f"{self.system:<12} {self.rate:6.2f} req/s: normalized latency {self.normalized_latency:7.3f} s/token"
                f"  batched {self.mean_batched_requests:6.2f}  {self.throughput_tokens_per_s:8.1f} tokens/s"
                f"  KV {self.mean_kv_usage:4.0%}  preemptions {self.preemptions:4d}  TTFT {self.mean_ttft_s:6.2f} s")


def simulate(name: str, system, workload: list[TraceRequest], rate: float = 0.0) -> Report:
    """Replay `workload` (sorted by arrival) through `system` (systems.make_system) until every request ends."""
    now, next_arrival, steps = 0.0, 0, []
    first_token, finish = {}, {}
    while next_arrival < len(workload) or system.has_unfinished():
        while next_arrival < len(workload) and workload[next_arrival].arrival_s <= now:
            system.add(next_arrival, workload[next_arrival])
            next_arrival += 1
        if not system.has_unfinished():  # idle until the next request arrives
            now = workload[next_arrival].arrival_s
            continue
        step = system.step()
        now += step.duration_s
        steps.append((step.duration_s, step.num_batched, step.kv_usage))
        first_token |= dict.fromkeys(step.first_tokens, now)
        finish |= dict.fromkeys(step.finished, now)
    durations, batched, usage = (np.array(column) for column in zip(*steps))
    latency = [(finish[i] - r.arrival_s) / r.output_len for i, r in enumerate(workload)]
    ttft = [first_token[i] - r.arrival_s for i, r in enumerate(workload)]
    span = now - workload[0].arrival_s
    return Report(name, rate, float(np.mean(latency)), float(np.average(batched, weights=durations)),
                  sum(r.output_len for r in workload) / span, system.num_preemptions,
                  float(np.average(usage, weights=durations)), float(np.mean(ttft)), span)


def max_sustainable_rate(latency_at: Callable[[float], float], bound: float, sustained: float, overloaded: float,
                         tolerance: float = 0.05) -> float:
    """The highest request rate whose normalized latency (`latency_at(rate)`) keeps within `bound`, by bisection
    between a rate that does and one that does not, to `tolerance` (relative). Latency grows with the rate."""
    while overloaded > sustained * (1 + tolerance):
        rate = (sustained * overloaded) ** 0.5
        sustained, overloaded = (rate, overloaded) if latency_at(rate) <= bound else (sustained, rate)
    return sustained
