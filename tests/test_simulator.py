"""The serving simulator (issue 45, first part): its arithmetic, its workloads, and the paper's systems in the
order the paper finds them."""

import argparse
import ast
import functools
import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.buddy import BuddySpace
from simulator.cost_model import PAPER_OVERHEADS, CostModel, paper_cost_model
from simulator.hardware import hardware
from simulator.model_spec import ModelSpec, model_spec
from simulator.simulate import max_sustainable_rate, simulate
from simulator.systems import SYSTEMS, make_system
from simulator.workload import DATASETS, TraceRequest, load_trace, synthetic

ROOT = pathlib.Path(__file__).parents[1]
OPT_13B_ON_A100 = CostModel(hardware("a100-40gb"), model_spec("opt-13b"))


def test_the_simulator_imports_only_numpy_the_standard_library_and_the_oracle():
    allowed = {"numpy", "reference", "simulator"} | set(sys.stdlib_module_names)
    imported = set()
    for path in (ROOT / "simulator").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add((node.module or "").split(".")[0])
    assert imported - allowed == set()


def test_the_papers_arithmetic():
    """OPT-13B: 13B parameters, 800 KB of K and V per token (the paper's Section 3 figure). On an A100-40GB (40 GiB)
    at 90% utilization, 24 GiB of weights and 1 GiB for activations leave about 14.5k tokens: the paper's Orca (Max),
    reserving 2048 tokens a request, batched 7.00 requests (Fig. 13a), 14.3k tokens."""
    opt = model_spec("opt-13b")
    assert 12.5e9 < opt.num_params < 13.2e9
    assert opt.kv_bytes_per_token(2) == 800 * 1024
    assert 14_000 < OPT_13B_ON_A100.kv_cache_tokens < 15_000
    assert model_spec("llama-3-8b").kv_bytes_per_token(2) == 128 * 1024  # grouped-query attention: 8 KV heads
    # Tensor parallelism splits the weights and each token's KV heads over the devices.
    split = CostModel(hardware("a100-40gb"), opt, tensor_parallel_size=2)
    assert split.weight_bytes == OPT_13B_ON_A100.weight_bytes / 2
    assert split.kv_bytes_per_token == OPT_13B_ON_A100.kv_bytes_per_token / 2


def test_a_decode_step_is_bound_by_reading_the_weights_and_a_long_prefill_by_compute():
    cost = OPT_13B_ON_A100
    weights_read = cost.weight_bytes / cost.hardware.memory_bandwidth
    assert cost.step_time([(0, 1)], paged=False) == pytest.approx(weights_read, rel=1e-3)
    kv = 1000 * cost.kv_bytes_per_token / cost.hardware.memory_bandwidth
    assert cost.step_time([(999, 1)], paged=True) == pytest.approx(weights_read + kv * 1.2, rel=1e-3)
    prefill = cost.step_time([(0, 2048)], paged=False)
    assert prefill == pytest.approx(2 * 2048 * cost.model.num_params / cost.hardware.peak_flops, rel=0.3)
    assert prefill > 5 * weights_read


def test_config_json_gives_the_presets_shapes(tmp_path):
    opt = {"model_type": "opt", "num_hidden_layers": 40, "hidden_size": 5120, "num_attention_heads": 40,
           "ffn_dim": 20480, "vocab_size": 50272, "max_position_embeddings": 2048, "_name_or_path": "opt-13b"}
    (tmp_path / "config.json").write_text(json.dumps(opt))
    assert ModelSpec.from_config(tmp_path) == model_spec("opt-13b")
    with pytest.raises(ValueError, match="model must be one of"):
        model_spec("no-such-model")
    with pytest.raises(ValueError, match="hardware must be one of"):
        hardware("tpu")


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_synthetic_workloads_have_the_papers_mean_lengths_and_rate(dataset):
    requests = synthetic(dataset, rate=4.0, num_requests=20_000, seed=1)
    assert requests == synthetic(dataset, rate=4.0, num_requests=20_000, seed=1)  # deterministic for a seed
    lengths = DATASETS[dataset]
    # Means within 5%: the 2048-token cap trims ShareGPT's tail a little.
    assert np.mean([r.prompt_len for r in requests]) == pytest.approx(lengths.prompt_mean, rel=0.05)
    assert np.mean([r.output_len for r in requests]) == pytest.approx(lengths.output_mean, rel=0.05)
    assert all(r.prompt_len + r.output_len <= 2048 for r in requests)
    assert len(requests) / requests[-1].arrival_s == pytest.approx(4.0, rel=0.05)


def test_bursty_arrivals_keep_the_rate_and_bunch_up():
    """Gamma gaps of shape k (vLLM's --burstiness): the same mean rate, gaps varying 1/sqrt(k) times their mean."""
    for burstiness in (1.0, 0.25):
        arrivals = np.array([r.arrival_s for r in synthetic("alpaca", 4.0, 20_000, seed=2, burstiness=burstiness)])
        gaps = np.diff(arrivals)
        assert len(arrivals) / arrivals[-1] == pytest.approx(4.0, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(burstiness ** -0.5, rel=0.1)


def test_a_buddy_space_rounds_up_to_powers_of_two_and_merges_buddies():
    opt_13b_on_a100 = BuddySpace(14512)  # tiled by the binary digits of 14,512, largest first
    assert opt_13b_on_a100.roots == [(0, 13), (8192, 12), (12288, 11), (14336, 7), (14464, 5), (14496, 4)]
    space = BuddySpace(4096)
    space.allocate("a", 600)  # internal fragmentation: 1024 slots held for 600
    assert space.held["a"] == (0, 10) and space.num_free_slots == 4096 - 1024
    for owner in "bcd":
        space.allocate(owner, 1000)
    space.release("a")
    space.release("c")  # 2048 slots free, but not buddies: external fragmentation
    assert space.num_free_slots == 2048 and not space.fits(1025)
    space.release("b")  # a and b merge; (a, b) and (c, d) cannot while d is held
    assert space.free[11] == {0} and space.free[10] == {2048}
    space.release("d")
    assert {k: starts for k, starts in space.free.items() if starts} == {12: {0}}


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 99)), max_size=60))
def test_a_buddy_space_tiles_its_slots_exactly(operations):
    """Held and free ranges always tile the space, each aligned to its size, and no two free buddies are left
    unmerged: nothing overlaps, nothing is lost."""
    space, owners = BuddySpace(100), []
    for i, (allocate, length, pick) in enumerate(operations):
        if allocate and space.fits(length):
            space.allocate(str(i), length)
            owners.append(str(i))
            assert (1 << space.held[str(i)][1]) // 2 < length <= 1 << space.held[str(i)][1]
        elif owners:
            space.release(owners.pop(pick % len(owners)))
        free = [(start, order) for order, starts in space.free.items() for start in starts]
        ranges = sorted([*space.held.values(), *free])
        assert ranges[0][0] == 0 and ranges[-1][0] + (1 << ranges[-1][1]) == 100
        assert all(a + (1 << k) == b for (a, k), (b, _) in zip(ranges, ranges[1:]))
        assert all(start % (1 << order) == 0 for start, order in ranges)
        for start, order in free:  # a free range whose buddy is free too would have merged with it
            root_order = next(k for root, k in reversed(space.roots) if root <= start)
            assert order == root_order or start ^ (1 << order) not in space.free[order]


def test_a_trace_is_replayed_and_a_bad_line_is_named(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival": 0.5, "prompt_len": 10, "output_len": 4}\n{"arrival": 0.0, "prompt_len": 3, '
                     '"output_len": 2}\n')
    assert load_trace(trace) == [TraceRequest(0.0, 3, 2), TraceRequest(0.5, 10, 4)]
    report = simulate("vllm", make_system("vllm", OPT_13B_ON_A100), load_trace(trace))
    assert report.preemptions == 0 and report.normalized_latency > 0
    trace.write_text('{"arrival": 0.5, "prompt_len": 10}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1: .*'output_len' is missing"):
        load_trace(trace)
    with pytest.raises(ValueError, match="no file"):
        load_trace(tmp_path / "missing.jsonl")


def test_weights_that_leave_no_room_for_a_kv_cache_are_named():
    with pytest.raises(ValueError, match="weights .* leave no room for a KV cache on l4"):
        make_system("vllm", CostModel(hardware("l4"), model_spec("llama-3-70b")))


def test_the_papers_systems_rank_as_the_paper_finds_them():
    """ShareGPT on OPT-13B / A100-40GB at a rate where memory binds: vLLM batches the most requests and keeps the
    lowest latency, then Orca with exact (oracle), power-of-two and maximal reservations, then static batching."""
    cost = paper_cost_model("opt-13b")
    workload = synthetic("sharegpt", rate=2.0, num_requests=150, seed=0)
    reports = {name: simulate(name, make_system(name, cost), workload, 2.0) for name in SYSTEMS}
    batched = [reports[name].mean_batched_requests for name in SYSTEMS]
    latency = [reports[name].normalized_latency for name in SYSTEMS]
    assert batched[:4] == sorted(batched[:4], reverse=True) and batched[0] > 1.2 * batched[1]
    assert latency == sorted(latency)
    assert all(reports[name].preemptions == 0 for name in SYSTEMS[1:])  # reservations never run out
    assert simulate("vllm", make_system("vllm", cost), workload, 2.0) == reports["vllm"]  # deterministic


def test_figure_13a_batched_requests_at_2_requests_a_second():
    """The paper's Fig. 13a (ShareGPT at 2 req/s, OPT-13B on one A100-40GB with 12 GB of KV cache, 1-hour traces):
    vLLM batches 30.42 requests on average, 2.2x Orca (Oracle)'s 13.62, 3.1x Orca (Pow2)'s 9.81 and 4.3x Orca
    (Max)'s 7.00. The step overhead is fitted to the first figure (PAPER_OVERHEADS); the ratios are predictions.
    The issue asks for 25%; with the paper's buddy allocator they land within 5%, so 10% catches a regression.
    (Orca is overloaded at 2 req/s, its batch pinned at what its memory holds from the first minutes: a
    1000-request trace gives it within 4% of the hour's, in a tenth of the time.)"""
    cost = paper_cost_model("opt-13b")
    hour = synthetic("sharegpt", rate=2.0, num_requests=7200, seed=0)
    vllm = simulate("vllm", make_system("vllm", cost), hour, 2.0).mean_batched_requests
    assert vllm == pytest.approx(30.42, rel=0.02)  # the fitted figure
    shorter = hour[:1000]
    for name, paper in (("orca-oracle", 13.62), ("orca-pow2", 9.81), ("orca-max", 7.00)):
        orca = simulate(name, make_system(name, cost), shorter, 2.0).mean_batched_requests
        assert vllm / orca == pytest.approx(30.42 / paper, rel=0.1), name


def test_section_6_2_request_rates_vllm_sustains_against_orca_and_fastertransformer():
    """The paper's Section 6.2 (ShareGPT, Fig. 12): vLLM sustains 1.7-2.7x the request rate of Orca (Oracle), 2.7-8x
    that of Orca (Max), and up to 22x FasterTransformer's, at similar latency. Here on OPT-13B and its server,
    within 0.2 s/token: vLLM's highest such rate, found by bisection, and then each baseline must miss the bound at
    vLLM's rate over the range's low end and keep it at the high end. (FasterTransformer "manages the memory like
    Orca (Max)", so its low end is Orca (Max)'s.)"""
    cost = paper_cost_model("opt-13b")

    def latency(name: str, rate: float) -> float:
        return simulate(name, make_system(name, cost), synthetic("sharegpt", rate, 1000, seed=0), rate
                        ).normalized_latency

    bound = 0.2
    vllm = max_sustainable_rate(functools.partial(latency, "vllm"), bound, sustained=2.0, overloaded=3.2)
    for name, low, high in (("orca-oracle", 1.7, 2.7), ("orca-max", 2.7, 8.0), ("ft", 2.7, 22.0)):
        assert latency(name, vllm / low) > bound and latency(name, vllm / high) <= bound, name


def test_figure_19a_small_blocks_make_swapping_slow_and_recompute_does_not_care():
    """The paper's Fig. 19a: swapping copies block by block (2 x 40 layers copies a block for OPT-13B, each with a
    fixed cost beside its bytes over PCIe), so small blocks make it slow; recomputing a request is one prefill,
    whatever the block size. Recompute wins at small blocks, swapping (out and back in) at large ones."""
    tokens, recompute = 512, OPT_13B_ON_A100.step_time([(0, 512)], paged=True)
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    swap = [OPT_13B_ON_A100.swap_time(tokens // size, size) for size in sizes]
    assert swap == sorted(swap, reverse=True)
    assert swap[-1] == pytest.approx(tokens * OPT_13B_ON_A100.kv_bytes_per_token / 25e9, rel=0.1)  # PCIe-bound
    assert swap[0] > 4 * recompute and 2 * swap[-1] < recompute


def test_figure_19b_swap_and_recompute_end_to_end_by_block_size():
    """The paper's Fig. 19b (OPT-13B, ShareGPT, one request rate): swapping is far slower with 1-token blocks,
    and from 16 to 64 tokens a block the two modes perform about the same. Both preempt at this rate."""
    workload = synthetic("sharegpt", rate=2.5, num_requests=300, seed=0)
    reports = {(size, mode): simulate("vllm", make_system("vllm", paper_cost_model("opt-13b"), block_size=size,
                                                          swap_space_bytes=4 * 2**30, preemption_mode=mode),
                                      workload, 2.5)
               for size in (1, 16, 64) for mode in ("recompute", "swap")}
    assert all(report.preemptions > 0 for report in reports.values())
    latency = {key: report.normalized_latency for key, report in reports.items()}
    assert latency[1, "swap"] > 1.3 * latency[1, "recompute"]
    for size in (16, 64):
        assert latency[size, "swap"] == pytest.approx(latency[size, "recompute"], rel=0.1)


def test_simulate_command_prints_one_json_object_per_system_and_rate():
    command = [sys.executable, "-m", "jax_engine", "simulate", "--systems", "vllm,orca-max", "--rates", "0.5,1",
               "--num-requests", "40", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["system"], r["rate"]) for r in rows] == [("vllm", 0.5), ("orca-max", 0.5), ("vllm", 1.0),
                                                         ("orca-max", 1.0)]
    assert {"normalized_latency", "mean_batched_requests", "throughput_tokens_per_s", "preemptions"} <= set(rows[0])
    bad = subprocess.run([*command[:4], "--systems", "vllm,orca"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert bad.returncode != 0 and "--systems: unknown ['orca']" in bad.stderr


def test_the_cpu_preset_predicts_the_engine_serving_side_by_side_knee_included():
    """Issue 45's check against this engine, on runs recorded side by side in one run of `jax-engine bench
    simulation` (docs/benchmarks.md, "The simulator against the engine"): the cost model built from `bench
    batching`'s steps and a `bench serve` run of 16 requests together predicts `bench serve`'s normalized latency at every
    rate, 0.5 to 8 req/s, past the knee near 2.5-3, within 25%. Neither input is the sweep it predicts."""
    from jax_engine.bench.simulation import predicted_latency
    from simulator.cpu_fit import fit_cpu_cost_model

    data = ROOT / "docs" / "figures" / "data"
    cost = fit_cpu_cost_model(data / "sim_check_batching.json", data / "sim_check_overhead.json")
    assert 0 < cost.serving_overhead_s < 0.005  # well under a millisecond a streamed token
    runs = json.loads((data / "sim_check_serving.json").read_text())["runs"]
    assert [run["report"]["request_rate"] for run in runs] == [0.5, 1, 2, 4, 8]
    for run in runs:
        measured = run["report"]["mean_normalized_latency_ms"] / 1e3
        assert predicted_latency(run, cost) == pytest.approx(measured, rel=0.25)


def test_this_cpu_is_fitted_from_recorded_runs_of_the_engine(capsys):
    """`--hardware this-cpu` reads the engine's recorded runs (simulator/cpu_fit.py), for the model they measured;
    what it needs, and what it cannot use, is named."""
    from simulator import cli
    from simulator.cpu_fit import MeasuredCostModel
    from simulator.options import cost_model

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    data = ROOT / "docs" / "figures" / "data"
    this_cpu = ["--hardware", "this-cpu", "--batching-json", str(data / "sim_check_batching.json")]
    args = parser.parse_args([*this_cpu, "--serving-json", str(data / "sim_check_overhead.json"),
                              "--dataset", "alpaca", "--systems", "vllm", "--rates", "1,8", "--num-requests", "100"])
    cost = cost_model(args)
    assert isinstance(cost, MeasuredCostModel) and cost.model.name == "smollm2-135m" and cost.serving_overhead_s > 0
    low, high = cli.run(args)
    assert low.normalized_latency < high.normalized_latency and "vllm" in capsys.readouterr().out
    with pytest.raises(ValueError, match="needs --batching-json"):
        cost_model(parser.parse_args(["--hardware", "this-cpu"]))
    with pytest.raises(ValueError, match="mean nothing on a100-40gb"):
        cost_model(parser.parse_args(this_cpu[2:]))
    with pytest.raises(ValueError, match="not opt-13b"):
        cost_model(parser.parse_args([*this_cpu, "--model", "opt-13b"]))


def test_bench_simulation_prints_the_engine_and_the_simulator_side_by_side():
    """`jax-engine bench simulation --compare-only` on the recorded runs: one row per rate, the ratio beside."""
    result = subprocess.run([sys.executable, "-m", "jax_engine", "bench", "simulation", "--compare-only", "--out-dir",
                             str(ROOT / "docs" / "figures" / "data")], capture_output=True, text=True, timeout=300,
                            cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"\s*[\d.]+\s+[\d.]+\s+[\d.]+", line)]
    assert [float(row[0]) for row in rows] == [0.5, 1, 2, 4, 8]
    assert all(0.75 < float(row[-1]) < 1.25 for row in rows)


def test_plan_shows_its_arithmetic_and_the_engine_sizes_its_cache_with_it(tiny_checkpoint):
    result = subprocess.run([sys.executable, "-m", "jax_engine", "plan", "--model", "opt-13b", "--hardware",
                             "a100-40gb"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "KV per token: 2 x 40 layers x 40 KV heads x 128 dims x 2 bytes / 1 = 800 KiB per device" in result.stdout
    assert f"= {OPT_13B_ON_A100.capacity.num_blocks:,} blocks = {OPT_13B_ON_A100.kv_cache_tokens:,} tokens" in (
        result.stdout)
    # The steady state's rate, checked by simulating it: within the latency target (0.1 s/token by default).
    simulated = re.search(r"simulated at [\d.]+ req/s \(vLLM, \d+ s\): ([\d.]+) s/token", result.stdout)
    assert simulated and float(simulated.group(1)) <= 0.1, result.stdout
    # The engine's start-up divides its KV budget into blocks with the same function.
    from jax_engine.attention import get_attention_backend
    from jax_engine.config import EngineArgs
    from jax_engine.kv_cache_plan import bytes_per_block, plan_kv_cache
    from simulator.capacity import num_blocks

    args = EngineArgs(kv_cache_memory_bytes=3_000_000, block_size=16)
    cfg = tiny_checkpoint.config
    _, blocks, _ = plan_kv_cache(args, cfg, "float32", get_attention_backend("auto", "cpu"), 64)
    assert blocks == num_blocks(3_000_000, bytes_per_block(cfg, 16, "float32")) > 0


def test_the_cpu_preset_fitted_to_recorded_steps_predicts_an_older_record_below_its_knee():
    """An older record (docs/figures/data/batching.json and paper_serving.json, one machine, the engine of that
    day): the cost model reads the recorded decode steps back, and without a serving overhead predicts `bench
    serve`'s normalized latency below the knee within 25%. (The record's higher rates are not monotonic, 1 req/s
    slower than 2 and 4: compile spikes of that engine.)"""
    from jax_engine.bench.simulation import replayed_latency
    from simulator.cpu_fit import fit_cpu_cost_model

    data = ROOT / "docs" / "figures" / "data"
    cost = fit_cpu_cost_model(data / "batching.json")
    for step in json.loads((data / "batching.json").read_text())["results"]:
        predicted = cost.step_time([(round(step["mean_context"]) - 1, 1)] * step["batch_size"], paged=False)
        assert predicted == pytest.approx(step["median_step_s"], rel=0.12), step["batch_size"]
    for run in json.loads((data / "paper_serving.json").read_text())["runs"]:
        if run["report"]["request_rate"] <= 0.5:
            measured = run["report"]["mean_normalized_latency_ms"] / 1e3
            assert replayed_latency(run, cost, arrival_seed=0) == pytest.approx(measured, rel=0.25)


@pytest.mark.parametrize(("model", "device", "target"), [("opt-13b", "a100-40gb", 0.1), ("llama-3-8b", "l4", 0.1)])
def test_the_planned_steady_state_keeps_littles_law_the_cache_and_the_target(model, device, target):
    from simulator.plan import steady_state

    cost = CostModel(hardware(device), model_spec(model), **PAPER_OVERHEADS)
    state = steady_state(cost, "sharegpt", target, max_num_seqs=256)
    assert state.rate == pytest.approx(state.num_seqs / state.lifetime_s)
    assert state.num_seqs * state.held_tokens <= cost.kv_cache_tokens and state.step_s <= target
    one_more = cost.step_time([(int(state.held_tokens), 1)] * (state.num_seqs + 1), paged=True)
    assert one_more > target or (state.num_seqs + 1) * state.held_tokens > cost.kv_cache_tokens  # as many as fit
