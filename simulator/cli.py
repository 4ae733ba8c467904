"""`jax-engine simulate`: replay a workload through the paper's systems at several request rates, on any hardware.

    jax-engine simulate --model opt-13b --hardware a100-40gb --dataset sharegpt \\
        --systems vllm,orca-oracle,orca-pow2,orca-max,ft --rates 0.5,1,1.5,2 --num-requests 1000 [--json]

One line per (system, rate): normalized latency (s/token), mean batched requests, throughput (over the whole
run, the drain after the last arrival included), KV usage, preemptions; with --json, one JSON object per line
instead. Then, per system, the highest rate whose normalized latency stays within --latency-bound (by default
twice the lowest normalized latency measured at the lowest rate: where queueing has doubled it): the highest such
rate of the grid, refined by bisection up to the next rate of the grid.

A run is finite: at a rate the system cannot sustain, continuous batching first admits everyone and only the
batch grows, until memory runs out and requests queue. Give --num-requests enough that the arrivals span many
request lifetimes, or an overloaded rate can look sustainable.
"""

import argparse
import dataclasses
import json

from simulator.hardware import GiB
from simulator.options import add_cost_model_arguments, cost_model
from simulator.simulate import Report, max_sustainable_rate, simulate
from simulator.systems import SYSTEMS, make_system
from simulator.workload import DATASETS, load_trace, synthetic


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _rates(text: str) -> list[float]:
    try:
        return [float(rate) for rate in _names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates must be numbers separated by commas, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cost_model_arguments(parser)
    parser.add_argument("--dataset", default="sharegpt",
                        help=f"{' or '.join(DATASETS)} (lengths as the paper reports them), or a JSONL trace of "
                             "{arrival, prompt_len, output_len} (its own arrivals: --rates is ignored)")
    parser.add_argument("--systems", type=_names, default=list(SYSTEMS), help=f"some of {','.join(SYSTEMS)}")
    parser.add_argument("--rates", type=_rates, default=[0.5, 1.0, 1.5, 2.0], help="requests per second")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="arrival gaps are a gamma of this shape: 1 is Poisson, below 1 burstier (vLLM's name)")
    parser.add_argument("--latency-bound", type=float, default=None,
                        help="normalized latency (s/token) a sustainable rate keeps within")
    parser.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                        help="how vLLM frees blocks when the cache runs out (the paper's Fig. 19)")
    parser.add_argument("--swap-space", type=float, default=4.0,
                        help="GiB of host memory per device for swapped blocks (vLLM's default: 4)")
    parser.add_argument("--json", action="store_true", help="one JSON object per (system, rate)")


def _system(name: str, cost, args: argparse.Namespace):
    return make_system(name, cost, args.max_num_seqs, args.block_size, args.swap_space * GiB, args.preemption_mode)


def run(args: argparse.Namespace) -> list[Report]:
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        raise ValueError(f"--systems: unknown {unknown}; known: {list(SYSTEMS)}")
    if args.swap_space < 0:
        raise ValueError(f"--swap-space must be >= 0 GiB, got {args.swap_space}")
    cost = cost_model(args)
    trace = None if args.dataset in DATASETS else load_trace(args.dataset)
    reports = []
    for rate in [0.0] if trace else args.rates:
        workload = trace or synthetic(args.dataset, rate, args.num_requests, args.seed, cost.model.max_model_len,
                                      args.burstiness)
        for name in args.systems:
            reports.append(simulate(name, _system(name, cost, args), workload, rate))
            print(json.dumps(dataclasses.asdict(reports[-1])) if args.json else reports[-1].row(), flush=True)
    return reports


def latency_bound(reports: list[Report], bound: float | None) -> float:
    """--latency-bound, or twice the lowest normalized latency at the lowest rate (where queueing doubled it)."""
    if bound is not None:
        return bound
    lowest = min(r.rate for r in reports)
    return 2 * min(r.normalized_latency for r in reports if r.rate == lowest)


def max_rate(args: argparse.Namespace, name: str, reports: list[Report], bound: float) -> str:
    """`name`'s highest sustainable rate: the grid's highest rate within `bound`, refined by bisection (to 5%)
    up to the next rate of the grid, which was not."""
    sustained = max((r.rate for r in reports if r.system == name and r.normalized_latency <= bound), default=0.0)
    overloaded = min((r.rate for r in reports if r.system == name and r.rate > sustained), default=None)
    if sustained == 0:
        return f"< {min(args.rates):g}"
    if overloaded is None:
        return f">= {sustained:g}"
    cost = cost_model(args)

    def latency_at(rate: float) -> float:
        workload = synthetic(args.dataset, rate, args.num_requests, args.seed, cost.model.max_model_len,
                             args.burstiness)
        return simulate(name, _system(name, cost, args), workload, rate).normalized_latency

    return f"{max_sustainable_rate(latency_at, bound, sustained, overloaded):.3g}"


def main(args: argparse.Namespace) -> None:
    reports = run(args)
    if args.dataset in DATASETS and not args.json:
        bound = latency_bound(reports, args.latency_bound)
        best = {name: max_rate(args, name, reports, bound) for name in args.systems}
        print(f"highest rate within {bound:.3f} s/token: " + ", ".join(f"{s} {r} req/s" for s, r in best.items()))
