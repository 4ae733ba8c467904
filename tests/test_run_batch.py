"""`jax-engine run-batch` (vLLM's): an OpenAI batch file through the server's handlers, as a user runs it, on the
tiny random checkpoint; every line answered in order, the failing ones with their status and error."""

import json
import subprocess
import sys

import numpy as np

from jax_engine import LLM, EngineArgs, LLMEngine, SamplingParams
from tests.tiny_checkpoints import hf_vector

ENGINE = ["--num-gpu-blocks-override", "64", "--block-size", "8", "--max-model-len", "128", "--max-num-seqs", "4",
          "--enforce-eager"]


def line(custom_id: str, url: str, body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def run_batch_file(checkpoint_dir: str, lines: list[str], tmp_path, *flags: str) -> tuple[str, list[dict]]:
    """`jax-engine run-batch` on the lines, as a user runs it: its printed summary and the results it wrote."""
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n\n")  # a blank line is skipped
    run = subprocess.run([sys.executable, "-m", "jax_engine", "run-batch", checkpoint_dir, "-i",
                          str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--served-model-name", "tiny",
                          *ENGINE, *flags], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout, [json.loads(text) for text in (tmp_path / "out.jsonl").read_text().splitlines()]


def test_a_batch_file_runs_line_by_line(tiny_checkpoint_dir, tiny_checkpoint, tmp_path):
    forced = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20,
              "structured_outputs": {"regex": "hello there"}}
    prompt = [5, 17, 42, 99, 3]
    lines = [line("chat", "/v1/chat/completions", forced),
             line("completion", "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                                    "temperature": 0, "ignore_eos": True}),
             line("bad-value", "/v1/completions", {"prompt": "x", "temperature": -1}),
             line("text-engine", "/v1/embeddings", {"input": "x"}),
             line("bad-url", "/v1/rerank", {"query": "x"}),
             line("streamed", "/v1/completions", {"prompt": "x", "stream": True}),
             "{not json"]
    stdout, results = run_batch_file(tiny_checkpoint_dir, lines, tmp_path)
    assert "7 requests, 5 failed" in stdout
    ids = ["chat", "completion", "bad-value", "text-engine", "bad-url", "streamed", None]
    assert [r["custom_id"] for r in results] == ids
    chat, completion = (r["response"]["body"]["choices"][0] for r in results[:2])
    assert chat["message"]["content"] == "hello there" and results[0]["error"] is None
    expected = LLM.from_engine(LLMEngine(EngineArgs(num_gpu_blocks_override=64, block_size=8, max_model_len=128,
                                                    enforce_eager=True), checkpoint=tiny_checkpoint))
    [output] = expected.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                 use_tqdm=False)
    assert completion["text"] == output.outputs[0].text
    for result, param in zip(results[2:], ["temperature", "task", "url", "stream", None]):
        assert result["response"]["status_code"] == 400 and result["response"]["body"] is None
        assert result["error"]["param"] == param and result["error"]["type"] == "invalid_request_error"


def test_an_embedding_engine_runs_a_batch_of_embeddings(tiny_checkpoint_dir, tmp_path):
    """vLLM's run-batch takes /v1/embeddings lines too; the vectors are HF's, and a chat line gets the 400."""
    from transformers import AutoModelForCausalLM

    prompts = [[5, 17, 42, 99, 3], list(range(20, 60))]
    lines = [line("first", "/v1/embeddings", {"model": "tiny", "input": prompts[0], "encoding_format": "float"}),
             line("second", "/v1/embeddings", {"input": prompts[1], "dimensions": 8, "encoding_format": "float"}),
             line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})]
    stdout, results = run_batch_file(tiny_checkpoint_dir, lines, tmp_path, "--task", "embed")
    assert "3 requests, 1 failed" in stdout
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint_dir)
    for result, prompt, size in zip(results, prompts, [None, 8]):
        [data] = result["response"]["body"]["data"]
        vector = hf_vector(hf_model, prompt, "LAST", normalize=False)[:size]
        assert np.abs(np.asarray(data["embedding"]) - vector / np.linalg.norm(vector)).max() < 1e-5
        assert result["response"]["body"]["usage"]["prompt_tokens"] == len(prompt)
    assert results[2]["response"]["status_code"] == 400 and results[2]["error"]["param"] == "task"


def test_a_model_without_a_chat_template_chats_with_the_one_given(templateless_checkpoint_dir, tmp_path):
    """A base model's files hold no chat template: its chat lines get a 400 that says how to give one, and with
    --chat-template (here the template itself, vLLM's other form of the flag) they run; completions run either
    way."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
            "structured_outputs": {"regex": "hello"}}
    lines = [line("chat", "/v1/chat/completions", chat),
             line("completion", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})]
    stdout, results = run_batch_file(templateless_checkpoint_dir, lines, tmp_path)
    assert "2 requests, 1 failed" in stdout and results[1]["error"] is None
    error = results[0]["error"]
    assert results[0]["response"]["status_code"] == 400 and error["param"] == "messages"
    assert "no chat template" in error["message"] and "--chat-template" in error["message"]
    stdout, results = run_batch_file(templateless_checkpoint_dir, lines, tmp_path, "--chat-template",
                                     "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert "2 requests, 0 failed" in stdout
    body = results[0]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == "hello" and body["usage"]["prompt_tokens"] == len("Hi")
