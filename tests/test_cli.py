"""The command line, as a user runs it: `python -m jax_engine generate|chat` (the same as `jax-engine`)."""

import argparse
import subprocess
import sys

import pytest

from jax_engine.cli import build_parser
from jax_engine.config import EngineArgs

SMALL = ["--num-gpu-blocks-override", "64", "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager"]


def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jax_engine", *args], input=stdin, capture_output=True, text=True,
                          timeout=600)


def test_generate_prints_the_completion():
    result = run("generate", "The capital of France is", "--max-tokens", "4", *SMALL)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is Paris")


def test_generate_chat_takes_a_template_of_ones_own():
    """--chat-template (serve's flag) on the local commands: this template ignores the message and asks the
    model to finish a sentence; without --chat it would render nothing, and is refused before the model loads."""
    template = "{{ 'The capital of France is' }}"
    result = run("generate", "--chat", "--chat-template", template, "ignored", "--max-tokens", "2", *SMALL)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(" Paris"), result.stdout
    refused = run("generate", "--chat-template", template, "hi", *SMALL)
    assert refused.returncode != 0 and "--chat-template renders chat prompts: it needs --chat" in refused.stderr


def test_chat_answers_on_stdin_until_exit():
    result = run("chat", "--max-tokens", "24", *SMALL, stdin="What is the capital of France?\n/exit\nnever read\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "never read" not in result.stdout


def test_bad_arguments_are_a_message_not_a_traceback():
    result = run("generate", "hi", "--preemption-mode", "drop", *SMALL)
    assert result.returncode != 0
    assert "preemption_mode must be one of" in result.stderr and "Traceback" not in result.stderr


def _engine_args_of(*command: str):
    """The EngineArgs a command line would build, parsed by the real `jax-engine` parser."""
    return EngineArgs.from_cli_args(build_parser().parse_args(list(command)))


def test_engine_flags_are_declared_once_for_every_command():
    """generate, chat, serve and the benchmarks take the same engine flags, from EngineArgs.add_cli_args."""
    flags = ["--max-num-seqs", "3", "--no-enable-prefix-caching", "--swap-space", "1.5", "--attention-backend", "xla"]
    for command in (["generate", "hi"], ["chat"], ["serve"], ["bench", "throughput"], ["bench", "sharing"]):
        args = _engine_args_of(*command, *flags)
        assert (args.max_num_seqs, args.enable_prefix_caching, args.swap_space, args.attention_backend) == \
            (3, False, 1.5, "xla"), command
    # A benchmark may change a default (the workload's longest request) and fix what its experiment owns.
    assert _engine_args_of("bench", "throughput").max_model_len == 2048
    assert _engine_args_of("generate", "hi").max_model_len is None
    with pytest.raises(SystemExit):  # the preemption benchmark sets the mode itself, run by run
        _engine_args_of("bench", "preemption", "--preemption-mode", "swap")


def test_add_cli_args_refuses_names_that_are_not_fields():
    with pytest.raises(ValueError, match=r"not EngineArgs fields: \['max_len'\]"):
        EngineArgs.add_cli_args(argparse.ArgumentParser(), max_len=4)


def test_serve_takes_vllm_s_tool_flags_and_refuses_a_parser_it_lacks(capsys):
    """vLLM needs --enable-auto-tool-choice and --tool-call-parser for tool_choice "auto"; here auto is always on
    and the one parser reads Hermes' <tool_call> tags, so vLLM's command line for them starts, and a parser this
    server does not have is refused by name."""
    ns = build_parser(for_serve=True).parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert ns.enable_auto_tool_choice and ns.tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        build_parser(for_serve=True).parse_args(["serve", "--tool-call-parser", "mistral"])
    assert "invalid choice: 'mistral' (choose from 'hermes')" in capsys.readouterr().err
