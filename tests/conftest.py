"""Shared fixtures: Hypothesis profiles, the default model (loaded once), tiny random checkpoints."""

import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.process_memory import release_freed_memory
from tests.quick_compiles import QUICK_COMPILES

# `ci` keeps the suite inside its time budget and reproducible; `thorough` (make test-thorough) digs.
settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach a hub at run time
# make test's workers share the cores: a BLAS or OpenMP pool as wide as the machine in each spins against the
# others (on CI's 2 cores, the oracle's invariance test over the default model took 37 s with pools of 2, 24 s
# with 1). Set before NumPy or torch load, and inherited by the processes tests start.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # a worker (the controller's own pools run nothing)
    _cores_per_worker = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    for _pool in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(_pool, str(_cores_per_worker))
# Quick XLA compiles, set before JAX starts: tests/quick_compiles.py says why and where tests do otherwise.
if importlib.util.find_spec("jax_cuda12_plugin") is None:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {QUICK_COMPILES}".strip()

# tests/multi_device/ needs several devices: tests/test_multi_device.py runs it in a process that has them.
collect_ignore = [] if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "") else ["multi_device"]
LONGEST_FILE = "tests/test_multi_device.py"  # ~3 minutes in a subprocess of its own


def pytest_collection_modifyitems(items):
    """The longest file first: with two workers (make test), started last it would leave the other one idle."""
    items.sort(key=lambda item: item.nodeid.split("::")[0] != LONGEST_FILE)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After each file, drop what its models left in JAX's in-memory caches (every distinct model keeps its
    compiled programs there): without this one process grows from ~2.5 to ~9 GB over the suite, and two workers
    must fit in 24 GiB. Shapes shared across files still load from the persistent compilation cache."""
    result = yield
    if (nextitem is None or nextitem.module is not item.module) and "jax" in sys.modules:
        gc.collect()  # the file's engines, before their programs
        sys.modules["jax"].clear_caches()
        release_freed_memory()
    return result


@pytest.fixture(scope="session")
def default_checkpoint():
    import dataclasses

    from jax_engine.loader import load_checkpoint

    checkpoint = load_checkpoint()
    # Dequantized once for the session: the loader's GGUFWeights dequantizes a tensor each time it is read.
    return dataclasses.replace(checkpoint, weights=dict(checkpoint.weights))


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory) -> str:
    """A random 2-layer Llama checkpoint (vocab 258) written once per session: an HF checkpoint directory."""
    from tests.tiny_checkpoints import make_tiny_checkpoint

    directory = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_checkpoint(directory, "llama")
    return str(directory)


@pytest.fixture(scope="session")
def bare_checkpoint_dir(tiny_checkpoint_dir, tmp_path_factory) -> str:
    """The tiny checkpoint without its tokenizer files (for skip_tokenizer_init)."""
    import shutil

    from jax_engine.loader.hf_loader import TOKENIZER_FILES

    directory = tmp_path_factory.mktemp("no-tokenizer")
    for path in Path(tiny_checkpoint_dir).iterdir():
        if "token" not in path.name and path.suffix != ".jinja":
            shutil.copy(path, directory / path.name)
    assert not any((directory / name).exists() for name in TOKENIZER_FILES)
    return str(directory)


@pytest.fixture(scope="session")
def templateless_checkpoint_dir(tiny_checkpoint_dir, tmp_path_factory) -> str:
    """The tiny checkpoint without a chat template (as a base model's files come): no chat_template.jinja."""
    import shutil

    directory = tmp_path_factory.mktemp("no-chat-template")
    for path in Path(tiny_checkpoint_dir).iterdir():
        if path.suffix != ".jinja":
            shutil.copy(path, directory / path.name)
    assert "chat_template" not in (directory / "tokenizer_config.json").read_text()
    return str(directory)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoint_dir):
    """The tiny checkpoint, loaded once per session."""
    from jax_engine.loader import load_checkpoint

    return load_checkpoint(tiny_checkpoint_dir)


@pytest.fixture(scope="session")
def long_checkpoint_dir(tmp_path_factory) -> str:
    """The tiny Llama with 4096 positions: room for streams long enough to act on while they run."""
    from tests.tiny_checkpoints import make_tiny_checkpoint

    directory = tmp_path_factory.mktemp("tiny-llama-4k")
    make_tiny_checkpoint(directory, "llama", max_position_embeddings=4096)
    return str(directory)


# One engine per model for the whole session: every LLM compiles its own step shapes, and compiles are the
# suite's main cost. Tests that need other engine arguments build their own, small ones. They compile each
# shape on first use (enforce_eager): compiling every shape at start-up is tested in test_compile_shapes.py.
LLM_ARGS = dict(num_gpu_blocks_override=256, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
                enforce_eager=True)


@pytest.fixture(scope="session")
def llm():
    from jax_engine import LLM

    return LLM(**LLM_ARGS)



@pytest.fixture(scope="session")
def make_llm(default_checkpoint):
    """Build an LLM on the default model without loading the checkpoint again."""
    from jax_engine import LLM, EngineArgs, LLMEngine

    def make(**kwargs):
        kwargs.setdefault("enforce_eager", True)
        return LLM.from_engine(LLMEngine(EngineArgs(**kwargs), checkpoint=default_checkpoint))

    return make
