"""`jax-engine serve` starts its engine core process before parsing its flags (engine_core/launch.py): which words
start one, that the client takes that one, and that one nobody takes is stopped. The servers of test_engine_core.py
are served by such early cores; test_server_lora.py checks that an in-process server leaves none running."""

import subprocess
import sys

import pytest

from jax_engine.engine_core import launch


@pytest.fixture(autouse=True)
def no_early_core():
    yield
    launch.discard_early()


@pytest.mark.parametrize("argv", [["serve"], ["serve", "model.gguf", "--port", "9"], ["serve", "--engine-core-process"]])
def test_serve_starts_the_core_early_and_the_client_takes_that_one(argv):
    launch.start_early(argv)
    early = launch._early
    assert early is not None and early.poll() is None
    assert launch.take_core_process() is early
    taken_again = launch.take_core_process()  # nothing early left: a new one
    try:
        assert taken_again is not early and taken_again.poll() is None
    finally:
        for process in (early, taken_again):
            process.kill()
            process.wait()


@pytest.mark.parametrize("argv", [["generate", "hi"], ["serve", "--no-engine-core-process"], ["serve", "--headless"],
                                  ["serve", "--help"], ["bench", "serve"]])
def test_commands_served_without_a_core_start_none(argv):
    launch.start_early(argv)
    assert launch._early is None


def test_the_environment_switch_starts_none(monkeypatch):
    monkeypatch.setenv(launch.MULTIPROCESSING_ENV, "0")
    launch.start_early(["serve"])
    assert launch._early is None


def test_an_early_core_nobody_takes_is_stopped():
    launch.start_early(["serve"])
    early = launch._early
    launch.discard_early()
    assert early.poll() is not None and launch._early is None


def test_a_core_without_arguments_exits_when_its_server_is_gone():
    """The server died before writing the arguments (its stdin closes): the core exits, not waits forever."""
    core = launch.start_core_process()
    core.stdin.close()
    assert core.wait(timeout=120) != 0


def test_serve_parses_its_flags_without_importing_the_server():
    """What `serve` needs before it hands the early core its arguments (server/serve.py, `_engine`): its flags
    parsed without the HTTP server, the tokenizers or the benchmarks imported, which take ~0.7 s more, or JAX,
    which only the core runs (~1.4 s)."""
    script = ("import sys; from jax_engine.cli import build_parser; "
              "ns = build_parser(for_serve=True).parse_args(['serve', '--quantization', 'int8', '--port', '9']); "
              "heavy = [m for m in ('jax', 'fastapi', 'uvicorn', 'transformers', 'jax_engine.server.app', "
              "'jax_engine.async_llm_engine', 'jax_engine.bench.serve') if m in sys.modules]; "
              "print(ns.port, ns.quantization, heavy)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.split("\n")[0] == "9 int8 []", result.stderr


def test_the_engine_core_loads_a_gguf_model_without_transformers():
    """The engine core loads no tokenizer (its API server does, and sends the grammars' tokenizer as JSON), so
    transformers (~0.6 s to import) is not on its way to ready: the core's module, then the engine on the default
    GGUF model as run_engine_core builds it (detokenize=False; eager, to compile nothing)."""
    script = ("import sys; import jax_engine.engine_core.core; from jax_engine.config import EngineArgs; "
              "from jax_engine.llm_engine import LLMEngine; "
              "engine = LLMEngine(EngineArgs(max_model_len=256, enforce_eager=True), detokenize=False); "
              "print(engine.tokenizer, engine.model_config.vocab_size, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.stdout.split("\n")[0] == "None 49152 False", result.stderr[-3000:]
