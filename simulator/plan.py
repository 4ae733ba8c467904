"""`jax-engine plan`: the capacity planner. How many tokens' KV cache a model leaves on a device, how many
sequences of a dataset's lengths that holds, and the request rate it sustains within a latency target.

    jax-engine plan --model llama-3-8b --hardware l4 --dataset sharegpt --latency-target 0.1

Every figure comes with its arithmetic; the engine sizes its own cache with the same functions (capacity.py).

The rate is a steady state, by Little's law: N sequences decode together, each step taking step(N), so a request
lives output x step(N) seconds and N of them finish in that time. N is as many as the KV cache holds at the
tokens a running request holds on average (its prompt and half its output, weighted by how long it runs: long
requests hold more for longer), as max_num_seqs allows, and as keep step(N) within the target. A simulation at
that rate then checks it. (A short simulation alone can mislead: continuous batching admits every request, and
at a rate it cannot sustain only the batch grows until memory runs out.)
"""

import argparse
from dataclasses import dataclass

import numpy as np

from simulator.cost_model import CostModel
from simulator.options import add_cost_model_arguments, cost_model
from simulator.simulate import Report, simulate
from simulator.systems import make_system
from simulator.workload import DATASETS, synthetic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cost_model_arguments(parser)
    parser.add_argument("--dataset", default="sharegpt", choices=sorted(DATASETS), help="request lengths")
    parser.add_argument("--latency-target", type=float, default=0.1,
                        help="seconds per output token a request may take end to end (normalized latency)")


def plan_lines(cost: CostModel, args: argparse.Namespace) -> list[str]:
    model, tp, capacity = cost.model, cost.tensor_parallel_size, cost.capacity
    lengths = DATASETS[args.dataset]
    whole = lengths.prompt_mean + lengths.output_mean
    return [
        f"{model.name} on {tp} x {cost.hardware.name}, {args.dtype} weights, KV cache in {cost.kv_dtype_bytes}-byte "
        f"values; beyond the roofline {cost.step_overhead_s * 1e3:g} ms a step, {cost.sequence_overhead_s * 1e3:g} ms"
        " a sequence",
        f"weights: {model.num_params / 1e9:.2f}B parameters x {cost.dtype_bytes} bytes / {tp} = "
        f"{cost.weight_bytes / 2**30:.2f} GiB per device",
        f"KV per token: 2 x {model.num_layers} layers x {model.num_kv_heads} KV heads x {model.head_dim} dims x "
        f"{cost.kv_dtype_bytes} bytes / {tp} = {cost.kv_bytes_per_token / 1024:.0f} KiB per device",
        *capacity.lines(),
        f"sequences at {args.dataset}'s lengths ({lengths.prompt_mean:.0f} + {lengths.output_mean:.0f} tokens on "
        f"average): {capacity.num_tokens / whole:.0f} at their full length, "
        f"{capacity.num_tokens / (lengths.prompt_mean + lengths.output_mean / 2):.0f} half-way through their outputs",
    ]


@dataclass(frozen=True)
class SteadyState:
    held_tokens: float  # KV tokens a running request holds on average
    num_seqs: int  # sequences decoding together
    step_s: float  # one decode step of that many
    lifetime_s: float  # a request's prefill and decode
    rate: float  # requests per second: num_seqs / lifetime_s


def steady_state(cost: CostModel, dataset: str, latency_target: float, max_num_seqs: int,
                 seed: int = 0) -> SteadyState | None:
    """The steady state the module docstring describes; None when not even one sequence meets the target."""
    rng = np.random.default_rng(seed)
    prompts, outputs = DATASETS[dataset].draw(rng, 20_000, cost.model.max_model_len)
    held = float(prompts.mean() + (outputs.astype(float) ** 2).mean() / (2 * outputs.mean()))

    def step(n: int) -> float:
        return cost.step_time([(int(held), 1)] * n, paged=True)

    n = min(max_num_seqs, int(cost.kv_cache_tokens // held))
    while n >= 1 and step(n) > latency_target:
        n -= 1
    if n < 1:
        return None
    lifetime = float(outputs.mean()) * step(n) + cost.step_time([(0, int(prompts.mean()))], paged=True)
    return SteadyState(held, n, step(n), lifetime, n / lifetime)


def check_by_simulation(cost: CostModel, args: argparse.Namespace, state: SteadyState) -> Report:
    """vLLM simulated at the steady state's rate, on arrivals spanning ten request lifetimes (1,000 to 5,000)."""
    count = int(min(max(1000, 10 * state.lifetime_s * state.rate), 5000))
    workload = synthetic(args.dataset, state.rate, count, args.seed, cost.model.max_model_len)
    return simulate("vllm", make_system("vllm", cost, args.max_num_seqs, args.block_size), workload, state.rate)


def main(args: argparse.Namespace) -> None:
    cost = cost_model(args)
    for line in plan_lines(cost, args):
        print(line)
    if cost.capacity.num_tokens < cost.model.max_model_len:
        print(f"the KV cache holds fewer tokens than one request of max_model_len ({cost.model.max_model_len}): "
              "add devices (--tensor-parallel-size) or serve shorter requests")
        return
    state = steady_state(cost, args.dataset, args.latency_target, args.max_num_seqs, args.seed)
    if state is None:
        print(f"no batch decodes within {args.latency_target} s/token on this hardware")
        return
    print(f"steady state: a running request holds {state.held_tokens:.0f} tokens on average")
    print(f"  {state.num_seqs} sequences at once (as many as the cache, max_num_seqs and the target allow)")
    print(f"  a step of {state.num_seqs} takes {state.step_s * 1e3:.1f} ms; a request lives {state.lifetime_s:.1f} s: "
          f"{state.num_seqs} / {state.lifetime_s:.1f} s = {state.rate:.2f} req/s")
    report = check_by_simulation(cost, args, state)
    print(f"simulated at {state.rate:.2f} req/s (vLLM, {report.duration_s:.0f} s): "
          f"{report.normalized_latency:.3f} s/token (target {args.latency_target}), {report.preemptions} preemptions")
