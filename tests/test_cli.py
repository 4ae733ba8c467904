"""The command line, as a user runs it: `python -m jax_engine generate|chat` (the same as `jax-engine`)."""

import subprocess
import sys

SMALL = ["--num-gpu-blocks-override", "64", "--max-model-len", "256", "--max-num-seqs", "4"]


def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jax_engine", *args], input=stdin, capture_output=True, text=True,
                          timeout=600)


def test_generate_prints_the_completion():
    result = run("generate", "The capital of France is", "--max-tokens", "4", *SMALL)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is Paris")


def test_chat_answers_on_stdin_until_exit():
    result = run("chat", "--max-tokens", "24", *SMALL, stdin="What is the capital of France?\n/exit\nnever read\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "never read" not in result.stdout


def test_bad_arguments_are_a_message_not_a_traceback():
    result = run("generate", "hi", "--preemption-mode", "drop", *SMALL)
    assert result.returncode != 0
    assert "preemption_mode must be one of" in result.stderr and "Traceback" not in result.stderr
