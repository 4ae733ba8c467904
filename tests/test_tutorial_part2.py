"""The measurement commands of tutorial pages 8 and 10 keep working and keep writing what their figures read.

Tiny settings: these check the commands and their data files, not the machine's speed.
"""

import json
import subprocess
import sys

from jax_engine.attention import cpu


def test_bench_preemption_preempts_by_both_modes_and_records_the_runs(tiny_checkpoint_dir, tmp_path):
    out = tmp_path / "preemption.json"
    command = [sys.executable, "-m", "jax_engine", "bench", "preemption", "--model", tiny_checkpoint_dir,
               "--num-requests", "4", "--input-len", "8", "--output-len", "8", "--cache-tokens", "32",
               "--max-model-len", "32", "--block-sizes", "4", "8", "--json-out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    [run] = json.loads(out.read_text())["runs"]
    assert run["command"].startswith("jax-engine bench preemption --model") and run["machine"]["cpu_count"]
    results = {(r["block_size"], r["preemption_mode"]): r for r in run["results"]}
    assert set(results) == {(4, "recompute"), (4, "swap"), (8, "recompute"), (8, "swap")}
    for (_, mode), r in results.items():
        assert r["num_preemptions"] > 0 and r["run_s"] > 0 and r["mean_normalized_latency_s"] > 0
        if mode == "recompute":
            assert r["recomputed_tokens"] > 0 and r["swapped_blocks"] == 0
        else:
            assert r["recomputed_tokens"] == 0 and r["swapped_blocks"] > 0


def test_bench_kernels_appends_one_run_per_block_size(tmp_path):
    if cpu.kernel_unavailable_reason():
        return  # no C++ compiler: test_benchmarks.py checks that the command says why
    out = tmp_path / "kernels.json"
    for block_size in ("8", "16"):
        result = subprocess.run([sys.executable, "-m", "jax_engine", "bench", "kernels", "--batch", "4", "--context",
                                 "40", "--layers", "2", "--cache-gb", "0.01", "--dtype", "float32", "--block-size",
                                 block_size, "--json-out", str(out)], capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert [run["settings"]["block_size"] for run in runs] == [8, 16]
    assert all({r["blocks"] for r in run["results"]} == {"in order", "scattered"} for run in runs)
