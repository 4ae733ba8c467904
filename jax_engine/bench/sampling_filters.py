"""The sampling filters a benchmark applies to every request: --top-k, --top-p and --min-p, off by default (vLLM's
benchmarks sample with temperature 1 alone), checked before anything starts, and named in every request even when
off: a peer's defaults differ (llama-server filters by top_k 40, top_p 0.95 and min_p 0.05 unless told
otherwise), and both sides must do the same work."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--top-k", type=int, default=0, help="every request's top_k (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (1.0: off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="every request's min_p (0.0: off)")


def sampling(ns: argparse.Namespace) -> dict:
    """Every request's sampling fields, or a ValueError naming the flag out of range."""
    checks = {"top_k": (ns.top_k >= 0, ">= 0 (0: off)"), "top_p": (0 < ns.top_p <= 1, "in (0, 1] (1: off)"),
              "min_p": (0 <= ns.min_p <= 1, "in [0, 1] (0: off)")}
    for name, (ok, limit) in checks.items():
        if not ok:
            raise ValueError(f"--{name.replace('_', '-')} must be {limit}, got {getattr(ns, name)}")
    return {"temperature": 1.0, "top_k": ns.top_k, "top_p": ns.top_p, "min_p": ns.min_p}
