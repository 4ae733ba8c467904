"""Tutorial pages 1-5: the measurement behind a figure runs, and the data files record how they were made."""

import json
import subprocess
import sys

from docs.figures._figure import DATA


def test_batching_benchmark_writes_what_the_figure_reads(tiny_checkpoint_dir, tmp_path):
    out = tmp_path / "batching.json"
    command = [sys.executable, "-m", "jax_engine", "bench", "batching", "--model", tiny_checkpoint_dir,
               "--batch-sizes", "1", "2", "--decode-steps", "2", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["command"].startswith("jax-engine bench batching --batch-sizes 1 2")
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert r["timed_steps"] == 2 and r["tokens_per_s"] > 0 and r["median_step_s"] > 0
    # Start-up compiled every step shape: a compile during the timed batches would be reported here.
    assert all(r["compile_s"] == 0 for r in report["results"])
    assert report["weight_bytes"] > 0 and report["kv_bytes_per_token"] > 0
    assert {"bandwidth_gbps", "matmul_gflops", "compute_bound_tokens_per_s"} <= set(report["roofline"])


def test_committed_measurements_record_their_command_and_machine():
    for name, command in [("batching.json", "jax-engine bench batching"), ("sharing.json", "jax-engine bench sharing")]:
        data = json.loads((DATA / name).read_text())
        assert command in data["command"] and data["machine"], name
    sharing = json.loads((DATA / "sharing.json").read_text())
    assert len(sharing["results"]) == 6 and set(sharing["paper"]) >= {"parallel sampling", "beam search"}
