"""`jax-engine simulate`: replay a workload through the paper's systems at several request rates, on any hardware.

    jax-engine simulate --model opt-13b --hardware a100-40gb --dataset sharegpt \\
        --systems vllm,orca-oracle,orca-pow2,orca-max,ft --rates 0.5,1,1.5,2 --num-requests 1000 [--json]

One line per (system, rate): normalized latency (s/token), mean batched requests, throughput (over the whole
run, the drain after the last arrival included), KV usage, preemptions; with --json, one JSON object per line
instead. Then, per system, the highest of the rates whose normalized latency stays within --latency-bound (by
default twice the lowest normalized latency measured at the lowest rate: where queueing has doubled it).

A run is finite: at a rate the system cannot sustain, continuous batching first admits everyone and only the
batch grows, until memory runs out and requests queue. Give --num-requests enough that the arrivals span many
request lifetimes, or an overloaded rate can look sustainable.
"""

import argparse
import dataclasses
import json

from simulator.options import add_cost_model_arguments, cost_model
from simulator.simulate import Report, simulate
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
    parser.add_argument("--latency-bound", type=float, default=None,
                        help="normalized latency (s/token) a sustainable rate keeps within")
    parser.add_argument("--json", action="store_true", help="one JSON object per (system, rate)")


def run(args: argparse.Namespace) -> list[Report]:
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        raise ValueError(f"--systems: unknown {unknown}; known: {list(SYSTEMS)}")
    cost = cost_model(args)
    trace = None if args.dataset in DATASETS else load_trace(args.dataset)
    reports = []
    for rate in [0.0] if trace else args.rates:
        workload = trace or synthetic(args.dataset, rate, args.num_requests, args.seed, cost.model.max_model_len)
        for name in args.systems:
            system = make_system(name, cost, args.max_num_seqs, args.block_size)
            reports.append(simulate(name, system, workload, rate))
            print(json.dumps(dataclasses.asdict(reports[-1])) if args.json else reports[-1].row(), flush=True)
    return reports


def sustainable_rates(reports: list[Report], bound: float | None) -> tuple[float, dict[str, float]]:
    """(the latency bound, each system's highest rate whose normalized latency keeps within it; 0: none)."""
    if bound is None:
        lowest = min(r.rate for r in reports)
        bound = 2 * min(r.normalized_latency for r in reports if r.rate == lowest)
    best = {}
    for r in reports:
        best[r.system] = max(best.get(r.system, 0.0), r.rate if r.normalized_latency <= bound else 0.0)
    return bound, best


def main(args: argparse.Namespace) -> None:
    reports = run(args)
    if args.dataset in DATASETS and not args.json:
        bound, best = sustainable_rates(reports, args.latency_bound)
        print(f"highest rate within {bound:.3f} s/token: " + ", ".join(f"{s} {r:g} req/s" for s, r in best.items()))
