"""A soak: 400 mixed requests (streamed or not, n 1-3, every sampler option, structured output of each kind,
tools, logprobs, echo, aborts, disconnects, stalled readers, invalid bodies) against `jax-engine serve` on
the tiny model. Nothing may answer 5xx, nothing may compile after start-up, and the server must end idle,
with every block free and its memory and memory maps flat once warm.

`make soak` runs the same with 10,000 requests and prints the figures (docs/benchmarks.md records them):

    python -m tests.test_soak --num-requests 10000
"""

import argparse
import asyncio
import json
import pathlib
import sys
import tempfile

from jax_engine.bench.soak import soak
from tests.server_helpers import cli_flags, start_server_process, stop_server_process

# 16 requests in flight with n up to 3 against max_num_seqs 16: the scheduler admits a request with the samples
# it will fork, so no step runs more rows than start-up compiled. (When it admitted by the running count alone,
# steps of 20-48 rows compiled when first needed, late in a run as often as early: one run grew 86 MB at its
# last tenth that way, failing the bound below.)
SERVER_ARGS = cli_flags(max_model_len=256, num_gpu_blocks_override=128, block_size=8, max_num_seqs=16,
                        max_waiting_requests=64, log_level="warning")
# Measured from the middle of the run, once the allocator's pools have grown to the load. A leak of
# per-request state grows with the request count; `make soak` shows it over 10,000 requests.
MAX_RSS_GROWTH_MB = 64
MAX_MEMORY_MAPS_GROWTH = 20  # one compiled program adds ~9-175
# `make soak`: the slope of resident memory once warm. A per-request leak of 1 KB is 1 MB per 1000 requests.
MAX_RSS_SLOPE_MB_PER_1000 = 2.0


def soak_server(checkpoint_dir: str, log_dir: pathlib.Path, num_requests: int, warm_fraction: float) -> dict:
    process, url = start_server_process(checkpoint_dir, *SERVER_ARGS, log_path=str(log_dir / "server.log"))
    try:
        return asyncio.run(soak(url, num_requests, warm_fraction=warm_fraction))
    finally:
        stop_server_process(process)


def test_a_soak_of_mixed_requests_leaves_no_trace(tiny_checkpoint_dir, tmp_path):
    report = soak_server(tiny_checkpoint_dir, tmp_path, num_requests=400, warm_fraction=0.5)
    print(json.dumps(report, indent=2))
    assert report["num_5xx"] == 0, report["outcomes"]
    assert report["idle_with_every_block_free"] and report["health"] == 200
    assert not any(o.startswith("transport-error") for o in report["outcomes"]), report["outcomes"]
    assert report["rss_growth_mb"] < MAX_RSS_GROWTH_MB, report
    assert report["compilations_after_start_up"] == 0, report
    assert report["memory_maps_growth"] <= MAX_MEMORY_MAPS_GROWTH, report
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def main() -> None:
    from tests.tiny_checkpoints import make_tiny_checkpoint

    parser = argparse.ArgumentParser(description="soak `jax-engine serve` on a tiny random model")
    parser.add_argument("--num-requests", type=int, default=10_000)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = pathlib.Path(directory) / "tiny"
        make_tiny_checkpoint(checkpoint, "llama")
        report = soak_server(str(checkpoint), pathlib.Path(directory), ns.num_requests, warm_fraction=0.2)
        log = (pathlib.Path(directory) / "server.log").read_text()
    report["tracebacks_in_log"] = log.count("Traceback")
    print(json.dumps(report, indent=2))
    failed = (report["num_5xx"] or not report["idle_with_every_block_free"] or report["tracebacks_in_log"]
              or report["compilations_after_start_up"] or report["memory_maps_growth"] > MAX_MEMORY_MAPS_GROWTH
              or report["rss_slope_mb_per_1000_requests"] > MAX_RSS_SLOPE_MB_PER_1000)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
