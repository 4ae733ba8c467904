"""The benchmark scripts run (tiny settings), so the commands in docs/benchmarks.md keep working."""

import json
import re
import subprocess
import sys

import pytest

from jax_engine.attention import cpu


def test_sharing_benchmark_prints_the_table():
    # 256 blocks hold the widest request here; the command's default 4096 are 3 GB of zeros made six times (~30 s).
    result = subprocess.run([sys.executable, "-m", "jax_engine", "bench", "sharing", "--num-prompts", "2", "--output-len", "4",
                             "--enforce-eager", "--num-gpu-blocks-override", "256"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("parallel sampling", "beam search"))]
    assert len(rows) == 6 and all(line.rstrip()[-1].isdigit() for line in rows)


def test_kernel_benchmark_times_the_kernels_of_this_platform():
    result = subprocess.run([sys.executable, "-m", "jax_engine", "bench", "kernels", "--batch", "4", "--context", "40",
                             "--layers", "2", "--cache-gb", "0.01", "--dtype", "float32"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    if "of peak" in result.stdout:  # a GPU: the Pallas kernels
        return
    if cpu.kernel_unavailable_reason():  # no C++ compiler: the command says why
        assert "unavailable" in result.stdout
        return
    rows = {line[:30].strip(): line[30:].split() for line in result.stdout.splitlines()
            if line.startswith(("in order", "scattered"))}  # name, then time (ms), GB/s, of probe
    assert set(rows) == {"in order", "scattered"}
    assert all(float(ms) > 0 and float(gbps) > 0 and share.endswith("%") for ms, gbps, share in rows.values())


def test_plot_draws_one_line_per_backend(tmp_path):
    import json

    reports = []
    for n, (ours, theirs) in {16: (145.0, 100.0), 64: (220.0, 130.0)}.items():
        hf = f"hf generate (static batches of {n})"  # batch sizes differ per report: still one line
        report = {"workload": {"num_requests": n}, "results": [
            {"backend": "jax_engine", "output_tokens_per_s": ours}, {"backend": hf, "output_tokens_per_s": theirs}]}
        (tmp_path / f"{n}.json").write_text(json.dumps(report))
        reports.append(str(tmp_path / f"{n}.json"))
    out = tmp_path / "plot.svg"
    result = subprocess.run([sys.executable, "-m", "jax_engine", "bench", "plot", *reports, "-o", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    text = out.read_text()
    assert text.count("<polyline") == 2 and "jax_engine" in text and ">64<" in text
    assert "hf generate (static batches)" in text


def test_throughput_benchmark_compares_with_hf_and_runs_the_workload_again(tiny_checkpoint_dir):
    import json

    command = [sys.executable, "-m", "jax_engine", "bench", "throughput", "--model", tiny_checkpoint_dir,
               "--num-requests", "3", "--length-mode", "fixed", "--input-len", "8", "--output-len", "4",
               "--max-model-len", "64", "--block-size", "4", "--runs", "2", "--compare", "hf",
               "--max-num-seqs", "4", "--max-num-batched-tokens", "64",  # start-up compiles for these only
               "--hf-batch-size", "2", "--hf-num-requests", "2", "--hf-modes", "static", "--top-p", "0.9",
               "--top-k", "5", "--min-p", "0.05", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    engine, again, hf = report["results"]
    # The second run meets an emptied prefix cache (each prompt's first 4-token block is cacheable), so it
    # computes what the first run computed, in as many steps.
    assert again["backend"] == "jax_engine, run 2" and again["prefix_cache_hits"] == engine["prefix_cache_hits"] == 0
    assert again["num_steps"] == engine["num_steps"] and again["num_compilations"] == 0
    from jax_engine.attention.cpu import kernel_unavailable_reason

    default_backend = "cpu" if kernel_unavailable_reason() is None else "xla"
    assert engine["backend"] == "jax_engine" and engine["attention_backend"] == default_backend
    assert hf["backend"] == "hf generate (static batches of 2)"
    assert (engine["num_requests"], hf["num_requests"]) == (3, 2)  # HF ran the trace's first two requests
    for row in (engine, hf):
        assert row["output_tokens_per_s"] > 0
        assert row["total_tokens_per_s"] == pytest.approx(3 * row["output_tokens_per_s"])  # (8 + 4) / 4 per request
        assert f"finished {row['backend']}: " in result.stderr  # reported as it finished, before the table
    assert report["workload"] == dict(length_mode="fixed", num_requests=3, mean_input_len=8.0, mean_output_len=4.0,
                                      sampling=dict(temperature=1.0, top_p=0.9, top_k=5, min_p=0.05))
    assert report["roofline"]["compute_bound_tokens_per_s"] > 0


def test_latency_benchmark_prints_each_engine_beside_the_bound(tiny_checkpoint_dir):
    command = [sys.executable, "-m", "jax_engine", "bench", "latency", "--model", tiny_checkpoint_dir,
               "--batch-sizes", "1", "2", "--input-len", "8", "--output-len", "4", "--quantizations", "none", "int8",
               "--max-num-batched-tokens", "16", "--num-iters-warmup", "1", "--num-iters", "2", "--compare", "hf"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if " batch " in line]
    labels = [line[:30].strip() for line in rows]
    assert labels == ["jax_engine float32"] * 2 + ["jax_engine int8"] * 2 + ["transformers float32"] * 2
    for line in rows:
        ttft, rate = (float(re.search(pattern, line).group(1)) for pattern in (r"TTFT\s+([\d.]+) ms", r"decode\s+([\d.]+)"))
        assert ttft > 0 and rate > 0
        assert ("bound" in line) == line.startswith("jax_engine")
    assert "start-up" in result.stdout and "probe: memory" in result.stdout


def test_latency_warm_up_prompts_have_the_timed_lengths_and_share_no_prefix(tiny_checkpoint_dir):
    """--num-iters-warmup runs other prompts of the same lengths: their shapes compile, and the timed run finds no
    cached prefix of theirs."""
    from transformers import AutoTokenizer

    from jax_engine.bench.latency_prompts import rotations as prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint_dir)
    timed, warm_up = prompts(tokenizer, 8, 16), prompts(tokenizer, 8, 16, first=8)
    assert {len(p) for p in timed + warm_up} == {16}
    assert len({tuple(p[:4]) for p in timed + warm_up}) == 16


def test_latency_timed_runs_compile_nothing_after_their_warm_up(tiny_checkpoint_dir):
    """The xla backend compiles each step shape on first use, as Pallas does on a GPU: after --num-iters-warmup 1
    the timed runs meet only shapes the warm-up met, even where a batch's prompts repeat a smaller batch's (40
    tokens: two whole blocks a prefix cache could serve)."""
    command = [sys.executable, "-m", "jax_engine", "bench", "latency", "--model", tiny_checkpoint_dir,
               "--attention-backend", "xla", "--batch-sizes", "1", "2", "--input-len", "40", "--output-len", "4",
               "--quantizations", "none", "--max-num-batched-tokens", "64", "--num-iters-warmup", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "compiled in the timed run" not in result.stdout
    assert len([line for line in result.stdout.splitlines() if "TTFT" in line]) == 2


@pytest.mark.parametrize("workload", ["chat", "copy"])
def test_chat_and_copy_workloads_are_distinct_templated_prompts(tiny_checkpoint_dir, workload):
    from transformers import AutoTokenizer

    from jax_engine.bench.latency_prompts import workload_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint_dir)
    timed, warm_up = (workload_prompts(workload, tokenizer, 32, 0, first=first) for first in (0, 32))
    assert len({tuple(p) for p in timed}) == 32  # one batch never repeats a prompt
    text = tokenizer.decode(timed[0])
    assert text.startswith(tokenizer.decode(workload_prompts(workload, tokenizer, 1, 0)[0][:4]))
    assert "<|im_start|>user" in text or "user" in text  # through the chat template
    # Warm-up prompts (a system message of their own) share no first block with the timed ones.
    assert not {tuple(p[:16]) for p in timed} & {tuple(p[:16]) for p in warm_up}


SPECULATION = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'


@pytest.mark.parametrize("flags, suffix", [(["--speculative-config", SPECULATION], " +ngram k=3"),
                                           (["--async-scheduling"], " +async scheduling")])
def test_latency_benchmark_times_speculation_or_async_scheduling_beside_the_plain_engine(tiny_checkpoint_dir, flags,
                                                                                          suffix):
    command = [sys.executable, "-m", "jax_engine", "bench", "latency", "--model", tiny_checkpoint_dir,
               "--workload", "chat", "--batch-sizes", "2", "--output-len", "12", "--quantizations", "none",
               "--enforce-eager", *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split(" batch ")[0].strip() for line in result.stdout.splitlines() if " batch " in line]
    assert rows == ["jax_engine float32", "jax_engine float32" + suffix]
    assert re.search(r"[\d.]+x plain decode, [\d.]+x plain TTFT, tokens identical", result.stdout), result.stdout
    if "async" not in suffix:
        acceptance = re.search(r"acceptance +(\d+)%, ([\d.]+) tokens a verification, ", result.stdout)
        assert acceptance, result.stdout[-2000:]
        assert 0 < int(acceptance.group(1)) <= 100 and 1 < float(acceptance.group(2)) <= 4


def test_latency_refuses_no_timed_runs():
    result = subprocess.run([sys.executable, "-m", "jax_engine", "bench", "latency", "--num-iters", "0"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--num-iters: must be at least 1, got 0" in result.stderr, result.stderr


def test_llama_cpp_runs_each_batch_in_turns_with_ours():
    """--num-iters with --compare llama.cpp: the peer runs each batch after each of our runs (default GGUF model),
    and each engine gets one row a batch, its medians."""
    pytest.importorskip("llama_cpp", reason="llama.cpp is an optional extra (pyproject's `llamacpp`), not installed")
    command = [sys.executable, "-m", "jax_engine", "bench", "latency", "--batch-sizes", "1", "2", "--input-len", "8",
               "--output-len", "4", "--quantizations", "gguf", "--num-iters", "3", "--compare", "llama.cpp",
               "--max-num-batched-tokens", "16"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split(" batch ")[0].strip() for line in result.stdout.splitlines() if " batch " in line]
    assert rows == ["jax_engine gguf"] * 2 + ["llama.cpp (GGUF as is)"] * 2, result.stdout


def test_llama_cpps_prompt_lookup_keeps_its_tokens():
    """The peer's drafting row (bench latency --compare llama.cpp with n-gram drafts) times the same tokens."""
    pytest.importorskip("llama_cpp", reason="llama.cpp is an optional extra (pyproject's `llamacpp`), not installed")
    from jax_engine.bench.llama_cpp_peer import time_prompt_lookup
    from jax_engine.loader.load import default_model_path

    prompt = [1] + list(range(300, 320)) * 3  # repeats: prompt lookup finds what follows
    plain, drafting = (time_prompt_lookup(default_model_path(), prompt, 24, 256, drafts) for drafts in (None, (4, 3)))
    assert plain[2] == drafting[2] and len(plain[2]) > 0
    assert plain[1] > 0 and drafting[1] > 0


def test_a_run_is_set_against_the_best_probe_around_it():
    from jax_engine.bench.roofline import Roofline, best

    slow, fast = Roofline(150.0, 40.0, 560.0, 75.0), Roofline(210.0, 30.0, 780.0, 56.0)
    assert best(slow, fast) == Roofline(210.0, 40.0, 780.0, 75.0)


def test_structured_benchmark_times_masks_and_constrained_steps(tiny_checkpoint_dir):
    command = [sys.executable, "-m", "jax_engine", "bench", "structured", "--model", tiny_checkpoint_dir,
               "--batch-sizes", "2", "--input-len", "8", "--output-len", "6", "--num-requests", "2",
               "--max-num-batched-tokens", "32", "--enforce-eager"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"llguidance mask per row: median +[\d.]+ us", result.stdout), result.stdout
    step = re.search(r"batch +2: decode step 0 constrained +([\d.]+) ms +1 constrained +([\d.]+) ms +2 constrained "
                     r"+([\d.]+) ms", result.stdout)
    assert step and all(float(ms) > 0 for ms in step.groups()), result.stdout
    assert re.search(r"json schema: +[\d.]+ output tok/s", result.stdout) and "free text:" in result.stdout


def test_lora_benchmark_prints_each_adapter_count_beside_the_base_model(tiny_checkpoint_dir, tmp_path):
    out = tmp_path / "lora.json"
    command = [sys.executable, "-m", "jax_engine", "bench", "lora", "--model", tiny_checkpoint_dir, "--adapters", "0",
               "1", "3", "--batch-size", "4", "--rank", "4", "--prompt-len", "8", "--decode-steps", "2", "--rounds",
               "2", "--enforce-eager", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    table = result.stdout.splitlines()[-3:]
    assert [line.split()[0] for line in table] == ["0", "1", "3"] and table[0].split()[2] == "100%"
    rows = json.loads(out.read_text())["rows"]
    assert all(0 < r["tokens_per_s"] < r["bound_tokens_per_s"] and r["batch_1_ms"] > r["batch_1_bound_ms"] > 0
               for r in rows)
    assert [r["adapter_bytes"] > 0 for r in rows] == [False, True, True]
