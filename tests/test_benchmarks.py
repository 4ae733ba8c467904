"""The benchmark scripts run (tiny settings), so the commands in docs/benchmarks.md keep working."""

import subprocess
import sys


def test_sharing_benchmark_prints_the_table():
    result = subprocess.run([sys.executable, "-m", "jax_engine", "bench", "sharing", "--num-prompts", "2", "--output-len", "4"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("parallel sampling", "beam search"))]
    assert len(rows) == 6 and all(line.rstrip()[-1].isdigit() for line in rows)


def test_kernel_benchmark_explains_it_needs_a_gpu():
    result = subprocess.run([sys.executable, "-m", "jax_engine", "bench", "kernels"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "needs a CUDA GPU" in result.stdout or "of peak" in result.stdout
