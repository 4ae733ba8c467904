"""`jax-engine bench serve --compare llama-server BINARY`: our server and llama.cpp's on the same GGUF file, one run.

    make llama-server   # builds build/llama-server/bin/llama-server from llama-cpp-python's sdist (cmake)
    jax-engine bench serve --compare llama-server build/llama-server/bin/llama-server --num-prompts 64

Each server starts fresh on a free port, serves one warm-up run of the requests all at once (our start-up has
compiled its shapes already; this fills both servers' caches and allocators), then the same requests with the same
arrival times at each of --rates:
- `jax-engine serve --quantization Q` for each of --quantizations (gguf keeps the file's blocks; int8);
- llama-server, continuous batching, threads = the cores, each slot holding --max-model-len tokens, at its best
  of --slots: every slot count serves the saturating run (rate inf), and the best by served rate then serves the
  other rates.
It prints one row per server and rate (served rate, normalized latency, TTFT and ITL percentiles) and the ratios
the targets are set in (docs/benchmarks.md).
"""

import argparse
import asyncio
import json
import math
import os
import pathlib
import sys
import tempfile
from dataclasses import dataclass

from jax_engine.bench import sampling_filters, serve_workload
from jax_engine.bench.server_process import RunningServer, server_process

PEERS = ("llama-server",)
WARM_UP_SEED = 99


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compare", nargs=2, metavar=("PEER", "BINARY"), default=None,
                        help="start our server and PEER (llama-server, at BINARY) on --model, and run the same "
                             "workload against both at each of --rates")
    parser.add_argument("--model", default=None, help="with --compare: the GGUF file (default: the default model)")
    parser.add_argument("--quantizations", nargs="+", default=["gguf", "int8"], help="with --compare: ours")
    parser.add_argument("--rates", nargs="+", type=float, default=[1.0, 2.0, 4.0, math.inf],
                        help="with --compare: request rates per second (inf: all at once)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="with --compare: each of ours also with --async-scheduling, beside it in lockstep")
    parser.add_argument("--slots", nargs="+", type=int, default=[8, 16, 32], help="with --compare: llama-server's")
    parser.add_argument("--max-model-len", type=int, default=1024, help="with --compare: both servers' context")
    parser.add_argument("--log-dir", default=None, help="with --compare: where the servers' logs go")


def _checked_peer(compare: list[str], rates: list[float]) -> str:
    peer, binary = compare
    if peer not in PEERS:
        raise ValueError(f"--compare: the peer must be one of {', '.join(PEERS)}, got {peer!r}")
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        raise ValueError(f"--compare: {binary!r} is not an executable file (build one with `make llama-server`)")
    if any(rate <= 0 for rate in rates):
        raise ValueError(f"--rates must be > 0 (inf: all at once), got {rates}")
    return binary


def _our_server(gguf: str, quantization: str, max_model_len: int) -> list[str]:
    return [sys.executable, "-m", "jax_engine", "serve", "--model", gguf, "--quantization", quantization,
            "--max-model-len", str(max_model_len)]


def _llama_server(binary: str, gguf: str, slots: int, max_model_len: int) -> list[str]:
    threads = str(len(os.sched_getaffinity(0)))
    return [binary, "--model", gguf, "--parallel", str(slots), "--ctx-size", str(slots * max_model_len),
            "--cont-batching", "--threads", threads, "--threads-batch", threads, "--host", "127.0.0.1"]


@dataclass
class Workloads:
    warm_up: serve_workload.Workload  # all at once, its own seed
    by_rate: dict[float, serve_workload.Workload]


def _workloads(url: str, ns: argparse.Namespace) -> Workloads:
    """Each rate's requests and arrivals, and the warm-up's, made once with our server's tokenizer (the same
    file, so the same token ids for llama-server)."""
    async def make() -> Workloads:
        async with serve_workload.client_for(url) as client:
            warm_up = argparse.Namespace(**{**vars(ns), "seed": WARM_UP_SEED})
            return Workloads(await serve_workload.make_workload(client, warm_up, math.inf),
                             {rate: await serve_workload.make_workload(client, ns, rate)
                              for rate in {*ns.rates, math.inf}})  # inf picks llama-server's slot count
    return asyncio.run(make())


def _measure(name: str, server: RunningServer, workloads: Workloads, rates: list[float]) -> list[dict]:
    """The warm-up, then one row per rate."""
    async def send(workload: serve_workload.Workload) -> dict:
        async with serve_workload.client_for(server.url) as client:
            return serve_workload.summarize(*await serve_workload.send_workload(client, workload))

    asyncio.run(send(workloads.warm_up))
    rows = []
    for rate in rates:
        rows.append({"server": name, "rate": rate, "ready_s": server.ready_seconds,
                     **asyncio.run(send(workloads.by_rate[rate]))})
        _print_row(rows[-1])
    return rows


COLUMNS = (("server", "server", "<28", "s"), ("rate", "rate", ">5", "g"), ("req/s", "request_throughput", ">8", ".2f"),
           ("norm ms", "mean_normalized_latency_ms", ">9", ".1f"), ("TTFT p50", "median_ttft_ms", ">9", ".0f"),
           ("TTFT p99", "p99_ttft_ms", ">9", ".0f"), ("ITL p50", "median_itl_ms", ">8", ".1f"),
           ("ITL p99", "p99_itl_ms", ">8", ".1f"), ("ready s", "ready_s", ">8", ".1f"),
           ("failed", "failed_requests", ">7", "d"))


def _print_header() -> None:
    print("".join(f"{title:{align}}" for title, _, align, _ in COLUMNS), flush=True)


def _print_row(row: dict) -> None:
    print("".join(f"{row[key]:{align}{form}}" for _, key, align, form in COLUMNS), flush=True)


def _summary(rows: list[dict], servers: list[str]) -> list[str]:
    """The targets' ratios: served rate at saturation, and normalized latency at each rate, against llama-server,
    for each of our `servers` ("gguf", "int8 +async", ...)."""
    peer = {row["rate"]: row for row in rows if row["server"].startswith("llama-server") and row.get("chosen")}
    lines = []
    for name in servers:
        ours = {row["rate"]: row for row in rows if row["server"] == f"jax-engine, {name}"}
        if math.inf in ours and math.inf in peer:
            ratio = ours[math.inf]["request_throughput"] / peer[math.inf]["request_throughput"]
            lines.append(f"{name}: served rate at saturation {ratio:.2f}x llama-server's")
        latency = [f"{rate:g}: {ours[rate]['mean_normalized_latency_ms']:.0f} vs "
                   f"{peer[rate]['mean_normalized_latency_ms']:.0f} ms" for rate in ours if rate in peer]
        lines.append(f"{name}: normalized latency, ours vs llama-server's, by rate: {'; '.join(latency)}")
    return lines


def main(ns: argparse.Namespace) -> dict:
    binary = _checked_peer(ns.compare, ns.rates)
    if ns.model is None:
        from jax_engine.loader.load import default_model_path

        ns.model = default_model_path()
    logs = pathlib.Path(ns.log_dir or tempfile.mkdtemp(prefix="bench-serve-compare-"))
    logs.mkdir(parents=True, exist_ok=True)
    sampling = sampling_filters.sampling(ns)
    filters = ", ".join(f"{name} {value:g}" for name, value in sampling.items())
    print(f"{ns.num_prompts} {ns.length_mode} requests a run ({filters}), on {ns.model}; server logs in {logs}")
    _print_header()
    rows, workloads, ours = [], None, []
    for quantization in ns.quantizations:
        for flags in [[], ["--async-scheduling"]] if ns.async_scheduling else [[]]:
            ours.append(quantization + (" +async" if flags else ""))
            command = _our_server(ns.model, quantization, ns.max_model_len) + flags
            with server_process(command, logs / f"jax-engine-{ours[-1].replace(' +', '-')}.log") as server:
                workloads = workloads or _workloads(server.url, ns)
                rows += _measure(f"jax-engine, {ours[-1]}", server, workloads, ns.rates)
    saturation = {}
    for slots in ns.slots:
        with server_process(_llama_server(binary, ns.model, slots, ns.max_model_len),
                            logs / f"llama-server-{slots}.log") as server:
            saturation[slots] = _measure(f"llama-server, {slots} slots", server, workloads, [math.inf])[0]
    best = max(saturation, key=lambda slots: saturation[slots]["request_throughput"])
    saturation[best]["chosen"] = True
    rows += saturation.values()
    with server_process(_llama_server(binary, ns.model, best, ns.max_model_len), logs / "llama-server.log") as server:
        chosen = _measure(f"llama-server, {best} slots", server, workloads, [r for r in ns.rates if r != math.inf])
    rows += [row | {"chosen": True} for row in chosen]
    report = {"rows": rows, "summary": _summary(rows, ours), "best_slots": best, "sampling": sampling}
    print("\n".join(report["summary"]))
    if ns.json_out:
        from jax_engine.bench.kernels import record_run

        record_run(ns.json_out, {"compare": ns.compare[0], "model": ns.model, "num_prompts": ns.num_prompts,
                                 "length_mode": ns.length_mode, "seed": ns.seed, "report": report})
    if ns.json:
        print(json.dumps(report, indent=2, default=str))
    return report
