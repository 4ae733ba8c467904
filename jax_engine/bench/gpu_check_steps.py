"""The steps of `make gpu-check` (jax_engine/bench/gpu_check.py runs them): each takes the Check and returns
{"figures": ..., "targets": [...], "ok": bool}; an exception fails the step and the check goes on."""

import argparse
import contextlib
import gc
import os
import pathlib
import re
import shutil
import subprocess
import sys

from jax_engine.bench.gpu_check_sizes import Check, engine_label, target

# Prompts of a few lengths (byte-level tiny tokenizers: one token a byte), one longer than two 16-token blocks.
PROMPTS = ["Hello there", "The capital of France is", "Once upon a time, in a land far away, there lived a king who"]
# Two backends' greedy tokens may part where the top two tokens' log-probabilities lie this close (nats): there
# rounding picks the token, not a bug. bf16: 4 units of a logit in [4, 8) (2**-5 each); on CPU the interpreted kernels
# part from xla on 7 of the 14 tiny random checkpoints within 16 tokens, at margins of 0.005-0.078. float32: on a GPU
# Triton takes float32 dots in TF32 (unit 2**-11, an eighth of bf16's 2**-8), so an eighth of that, rounded up;
# on CPU (IEEE dots) every checkpoint's tokens are equal.
NEAR_TIE = {"bfloat16": 0.125, "float32": 0.02}
DEFAULT_MODEL_TEST = "tests/test_pallas_kernels.py::test_engine_pallas_backend_gives_the_xla_backends_greedy_tokens"
ENGINE_ARGS = dict(enforce_eager=True, num_gpu_blocks_override=64, block_size=16, max_model_len=128, max_num_seqs=4,
                   max_num_batched_tokens=128)


def _versions() -> dict:
    """jaxlib's and the CUDA plugin's versions, and what nvidia-smi says of the GPU and its driver."""
    from importlib import metadata

    versions = {}
    for name in ("jaxlib", *(f"jax-cuda{v}-{part}" for v in (12, 13) for part in ("plugin", "pjrt"))):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        versions["nvidia-smi"] = subprocess.run(query, capture_output=True, text=True, timeout=60).stdout.strip()
    return versions


def environment(check: Check) -> dict:
    """The machine, the device and its peak bandwidth: what every other figure ran on."""
    import jax

    from jax_engine.bench.kernels import machine, peak_gbps

    figures = {**machine(), **_versions(), "devices": [d.device_kind for d in jax.devices()],
               "peak_gbps": peak_gbps(check.peak_gbps)}
    compiled = jax.default_backend() == "gpu"
    print(f"{figures['device']} ({figures['backend']}), jax {figures['jax']}, peak {figures['peak_gbps']} GB/s")
    return {"figures": figures, "ok": True,
            "targets": [target("kernels compiled for the GPU (not interpreted)", compiled, "gpu backend",
                               None if check.smoke else compiled)]}


def kernel_tests(check: Check) -> dict:
    """The kernel tests against the oracle, in a child pytest (compiled when its jax backend is the GPU)."""
    env = dict(os.environ, HYPOTHESIS_PROFILE="ci", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if check.smoke:
        env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *check.sizes.kernel_tests]
    if check.model:  # without the default model its one test cannot run (the report's command line says so)
        command += ["--deselect", DEFAULT_MODEL_TEST]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=_repo_root(), timeout=900)
    print(result.stdout[-6000:], result.stderr[-2000:], sep="\n")
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", result.stdout)}
    figures = {"command": " ".join(command[2:]), "returncode": result.returncode, **counts}
    return {"figures": figures, "ok": result.returncode == 0 and counts.get("passed", 0) > 0,
            "targets": [target("kernel tests pass against the oracle", counts.get("passed", 0),
                               "all pass", result.returncode == 0)]}


def _repo_root() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parents[2]


def tiny_checkpoint(check: Check, family: str) -> pathlib.Path:
    """A tiny random checkpoint of `family` under the report's folder (weights 10x the HF default scale, so
    greedy tokens vary from step to step instead of repeating one token)."""
    if str(_repo_root()) not in sys.path:  # tests/ is not installed: gpu-check runs from the repository
        sys.path.insert(0, str(_repo_root()))
    from tests.tiny_checkpoints import make_tiny_checkpoint

    directory = check.out / "checkpoints" / family
    if not (directory / "config.json").exists():
        make_tiny_checkpoint(directory, family, initializer_range=0.2)
    return directory


def _greedy(checkpoint, dtype: str, backend: str, max_tokens: int, kv_cache_dtype: str) -> list:
    from jax_engine import LLM, EngineArgs, LLMEngine, SamplingParams

    # A start-up self-test that fails stops the engine with its figures (the default would serve on xla instead).
    args = EngineArgs(dtype=dtype, kv_cache_dtype=kv_cache_dtype, attention_backend=backend,
                      attention_self_test="error", **ENGINE_ARGS)
    llm = LLM.from_engine(LLMEngine(args, checkpoint=checkpoint))
    assert llm.llm_engine.attention_backend.name == backend, llm.llm_engine.attention_backend.name
    # The top two log-probabilities of each step: where two backends part, how close the two tokens were.
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    del llm
    gc.collect()  # the engine's cache, before the next engine allocates its own
    return outputs


def parting(ours, theirs) -> dict | None:
    """Where two greedy completions first part, and the larger of the two backends' margins (nats) between the two
    tokens there (inf where one backend's top two lack the other's token); None if they never part."""
    position = next((i for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)) if a != b), None)
    if position is None:
        return None
    a, b = ours.token_ids[position], theirs.token_ids[position]
    margins = [top[chosen].logprob - top[other].logprob if other in top else float("inf")
               for top, chosen, other in ((ours.logprobs[position], a, b), (theirs.logprobs[position], b, a))]
    return {"position": position, "margin": max(margins)}


def compare_backends(name: str, load, dtype: str, max_tokens: int, kv_cache_dtype: str = "auto") -> dict:
    """Greedy tokens with the Pallas kernels against the xla backend's on the checkpoint load() gives: equal, or
    parting only at a near tie (rounding, not a bug), where they part, the cumulative logprob gap; or the error.
    Both backends round the keys and values to an 8-bit cache alike (kv_cache_dtype "fp8"): only the sums'
    order differs, as with the model's dtype."""
    label = engine_label(dtype, kv_cache_dtype)
    key = {"model": name, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype}  # what the row is of
    try:
        checkpoint = load()
        pallas, xla = (_greedy(checkpoint, dtype, backend, max_tokens, kv_cache_dtype) for backend in ("pallas", "xla"))
    except Exception as error:  # noqa: BLE001 - one model failing is a row of the table, not the end of it
        print(f"{name:<14}{label:<10} ERROR {type(error).__name__}: {error}", flush=True)
        return key | {"equal": False, "agree": False, "error": f"{type(error).__name__}: {error}"[:500]}
    partings = [parting(p, x) for p, x in zip(pallas, xla)]
    gap = max(abs(p.cumulative_logprob - x.cumulative_logprob) for p, x in zip(pallas, xla))
    row = key | {"equal": partings == [None] * len(partings),
                 "agree": all(t is None or t["margin"] < NEAR_TIE[dtype] for t in partings), "partings": partings,
                 "tokens": sum(len(p.token_ids) for p in pallas), "max_cumulative_logprob_gap": gap}
    verdict = "equal" if row["equal"] else "part at near ties" if row["agree"] else "DIFFER"
    print(f"{name:<14}{label:<10} {verdict} (partings {partings}; cumulative logprob gap {gap:.2e})", flush=True)
    return row


def _greedy_targets(rows: list[dict]) -> list[dict]:
    """The default model's bf16 tokens equal xla's (the issue's target); every model's equal or parting at a tie."""
    targets = []
    for dtype, tie in NEAR_TIE.items():
        ours = [r for r in rows if r["dtype"] == dtype]
        targets.append(target(f"{dtype} greedy equal to xla's or parting at a near tie", sum(r["agree"] for r in ours),
                              f"every model ({len(ours)}; ties within {tie} nats)", all(r["agree"] for r in ours)))
    plain_bf16 = ("default model", "bfloat16", "auto")
    default = next((r for r in rows if (r["model"], r["dtype"], r["kv_cache_dtype"]) == plain_bf16), None)
    if default:
        targets.insert(0, target("default model: bfloat16 greedy equal to xla's", default["equal"], "equal",
                                 default["equal"]))
    return targets


def engine_greedy(check: Check) -> dict:
    """The engine on the Pallas kernels against the xla backend, greedy, per model and dtype; then the first model
    with an fp8 KV cache (bfloat16 weights, vLLM's usual pairing on a GPU), whose kernels widen each block loaded."""
    import functools

    from jax_engine.loader import load_checkpoint

    models = [("default model", functools.cache(load_checkpoint))] if check.sizes.default_model else []
    if check.model:
        models = [(pathlib.Path(check.model).name, functools.cache(lambda: load_checkpoint(check.model)))]
    models += [(family, functools.cache(lambda f=family: load_checkpoint(str(tiny_checkpoint(check, f)))))
               for family in check.sizes.families]  # the default model first: the one users run
    rows = [compare_backends(name, load, dtype, check.sizes.max_tokens) for name, load in models
            for dtype in NEAR_TIE]
    rows += [compare_backends(*models[0], "bfloat16", check.sizes.max_tokens, "fp8")] if models else []
    return {"figures": {"rows": rows, "near_tie_nats": NEAR_TIE}, "targets": _greedy_targets(rows), "ok": True}


def _bench(check: Check, module_name: str, argv: tuple[str, ...], runs_model: bool = True):
    """A benchmark's main on its own parsed command line; {tiny} is a tiny llama checkpoint (CPU smoke run).
    runs_model: the bench loads a model, so --model (check.model) is passed on (bench kernels loads none)."""
    import importlib

    module = importlib.import_module(f"jax_engine.bench.{module_name}")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    if runs_model and check.model and "--model" not in argv:
        argv = ("--model", check.model, *argv)
    if any("{tiny}" in a for a in argv):
        argv = tuple(a.replace("{tiny}", str(tiny_checkpoint(check, "llama"))) for a in argv)
    print(f"jax-engine bench {module_name.replace('_', '-')} {' '.join(argv)}", flush=True)
    return module.main(parser.parse_args(list(argv)))


def bench_kernels(check: Check) -> dict:
    """`bench kernels` at the headline shape: ours against the jnp path and jax's Pallas kernel, and the ragged
    kernel (on CPU: the cpu backend's kernel). Its table is the step's printed output."""
    argv = check.sizes.bench_kernels + (("--peak-gbps", str(check.peak_gbps)) if check.peak_gbps else ())
    _bench(check, "kernels", argv, runs_model=False)
    return {"figures": {"command": "jax-engine bench kernels " + " ".join(argv)}, "targets": [], "ok": True}


def bench_latency(check: Check) -> dict:
    """`bench latency`: start-up, time to first token and decode tokens/s at small batches."""
    result = _bench(check, "latency", check.sizes.latency)
    rows = [dict(zip(("engine", "batch", "ttft_s", "decode_tokens_per_s", "bound_tokens_per_s"), row))
            for row in result["rows"]]
    return {"figures": {"rows": rows, "roofline": result["roofline"]}, "targets": [], "ok": bool(rows)}


def bench_throughput(check: Check) -> dict:
    """`bench throughput`: offline throughput on a sharegpt-like trace."""
    result = _bench(check, "throughput", check.sizes.throughput)
    return {"figures": result, "targets": [], "ok": bool(result["results"])}

