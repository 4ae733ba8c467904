"""A cost model of this project's CPU, from recorded runs of the engine rather than from a roofline.

On 2 CPU cores the engine's step time is not a roofline plus a constant: rows run well below the probe's peak
FLOP/s at some batch sizes and near it at others. So the CPU preset interpolates what `jax-engine bench batching`
measured, the median step of a batch computing as many tokens as the simulated step computes, and adds what a
server spends per sequence and step beyond the engine (HTTP, detokenizing, streaming each token as an event),
measured apart: a streamed token's time with n requests decoding together, less the engine's step at batch n,
over n.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simulator.cost_model import CostModel
from simulator.hardware import GiB, Hardware
from simulator.model_spec import model_spec

# The engine's KV budget on a CPU (jax_engine/kv_cache_plan.py's DEFAULT_CPU_KV_CACHE_BYTES).
CPU_KV_CACHE_BYTES = 2 * GiB


@dataclass(frozen=True)
class MeasuredCostModel(CostModel):
    """Step time read off measured decode steps (`measured_tokens` -> `measured_step_s`, interpolated by the tokens
    a step computes), plus `serving_overhead_s` per sequence in the step."""

    measured_tokens: tuple[float, ...] = ()
    measured_step_s: tuple[float, ...] = ()
    serving_overhead_s: float = 0.0

    def step_time(self, chunks: list[tuple[int, int]], paged: bool) -> float:
        tokens = sum(n for _, n in chunks)
        return float(np.interp(tokens, self.measured_tokens, self.measured_step_s)) + (
            self.serving_overhead_s * len(chunks))


def serving_overhead(measured_tokens: np.ndarray, measured_step_s: np.ndarray, serving: dict) -> float:
    """Seconds a server adds per streamed token: a `bench serve` run of n requests decoding together
    (`--max-concurrency n`), its mean time per output token, less the engine's step at batch n, over n.

    n = 1 works (one request at a time), but then the estimate is a small difference of two large numbers measured
    in two processes: 32.7 - 30.2 ms in one run, 27.0 - 25.8 in another. With 16 requests together (all at once,
    fixed lengths, so the steps decode 16 rows) the overhead is 16 times larger against the same noise."""
    run = serving["runs"][-1]
    n = run["report"]["max_concurrency"] or run["num_prompts"]
    step = float(np.interp(n, measured_tokens, measured_step_s))
    return max((run["report"]["mean_tpot_ms"] / 1e3 - step) / n, 0.0)


def fit_cpu_cost_model(batching_json: str | Path, serving_json: str | Path | None = None,
                       model: str = "smollm2-135m") -> MeasuredCostModel:
    """The CPU cost model a `bench batching --out` file (and, for a server, a `bench serve --max-concurrency n
    --json-out` file: serving_overhead) records, for the model it measured."""
    run = json.loads(Path(batching_json).read_text())
    spec = model_spec(model)
    if abs(spec.num_params / run["num_params"] - 1) > 1e-3:  # the norms' weights aside
        raise ValueError(f"{batching_json} measured a model of {run['num_params']:,} parameters, not {model} "
                         f"({spec.num_params:,})")
    probe = run["roofline"]
    cpu = Hardware("this-cpu", float("inf"), probe["bandwidth_gbps"] * 1e9, probe["matmul_gflops"] * 1e9, float("inf"))
    dtype_bytes = round(run["weight_bytes"] / run["num_params"])
    tokens = np.array([float(r["batch_size"]) for r in run["results"]])
    steps = np.array([r["median_step_s"] for r in run["results"]])
    overhead = 0.0 if serving_json is None else serving_overhead(tokens, steps,
                                                                  json.loads(Path(serving_json).read_text()))
    return MeasuredCostModel(cpu, spec, dtype_bytes=dtype_bytes, kv_dtype_bytes=dtype_bytes, paging_overhead=0.0,
                             kv_cache_memory_bytes=CPU_KV_CACHE_BYTES, measured_tokens=tuple(tokens),
                             measured_step_s=tuple(steps), serving_overhead_s=overhead)
