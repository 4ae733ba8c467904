"""A cost model of this project's CPU, fitted to a recorded `jax-engine bench batching` run.

The run records the machine's roofline probe (memory bandwidth, matmul FLOP/s) and the median decode step time at
each batch size. The probe gives the hardware; what the roofline cannot explain (the engine's Python step:
scheduling, the sampler, bookkeeping, growing with the batch) is fitted as a cost per step plus a cost per
sequence, by least squares on each batch size's residual.
"""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from simulator.cost_model import CostModel
from simulator.hardware import GiB, Hardware
from simulator.model_spec import model_spec

# The engine's KV budget on a CPU (jax_engine/config.py's DEFAULT_CPU_KV_CACHE_BYTES).
CPU_KV_CACHE_BYTES = 2 * GiB


def fit_cpu_cost_model(batching_json: str | Path, model: str = "smollm2-135m") -> CostModel:
    """The CPU cost model `batching_json` (a bench batching --out file) implies, for the model it measured."""
    run = json.loads(Path(batching_json).read_text())
    spec = model_spec(model)
    if abs(spec.num_params / run["num_params"] - 1) > 1e-3:  # the norms' weights aside
        raise ValueError(f"{batching_json} measured a model of {run['num_params']:,} parameters, not {model} "
                         f"({spec.num_params:,})")
    probe = run["roofline"]
    cpu = Hardware("this-cpu", float("inf"), probe["bandwidth_gbps"] * 1e9, probe["matmul_gflops"] * 1e9, float("inf"))
    dtype_bytes = round(run["weight_bytes"] / run["num_params"])
    roofline = CostModel(cpu, spec, dtype_bytes=dtype_bytes, kv_dtype_bytes=dtype_bytes, paging_overhead=0.0,
                         kv_cache_memory_bytes=CPU_KV_CACHE_BYTES)
    sizes = np.array([r["batch_size"] for r in run["results"]], float)
    residuals = np.array([r["median_step_s"] - roofline.step_time([(round(r["mean_context"]) - 1, 1)]
                                                                   * r["batch_size"], paged=False)
                          for r in run["results"]])
    per_sequence, per_step = np.polyfit(sizes, residuals, 1)
    return replace(roofline, step_overhead_s=max(float(per_step), 0.0),
                   sequence_overhead_s=max(float(per_sequence), 0.0))
