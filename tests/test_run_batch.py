"""`jax-engine run-batch` (vLLM's): an OpenAI batch file through the server's handlers, as a user runs it, on the
tiny random checkpoint; every line answered in order, the failing ones with their status and error."""

import json
import subprocess
import sys

from jax_engine import LLM, EngineArgs, LLMEngine, SamplingParams

ENGINE = ["--num-gpu-blocks-override", "64", "--block-size", "8", "--max-model-len", "128", "--max-num-seqs", "4",
          "--enforce-eager"]


def line(custom_id: str, url: str, body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_a_batch_file_runs_line_by_line(tiny_checkpoint_dir, tiny_checkpoint, tmp_path):
    forced = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20,
              "structured_outputs": {"regex": "hello there"}}
    prompt = [5, 17, 42, 99, 3]
    lines = [line("chat", "/v1/chat/completions", forced),
             line("completion", "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                                    "temperature": 0, "ignore_eos": True}),
             line("bad-value", "/v1/completions", {"prompt": "x", "temperature": -1}),
             line("bad-url", "/v1/embeddings", {"input": "x"}),
             line("streamed", "/v1/completions", {"prompt": "x", "stream": True}),
             "{not json"]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n\n")  # a blank line is skipped
    run = subprocess.run([sys.executable, "-m", "jax_engine", "run-batch", tiny_checkpoint_dir, "-i",
                          str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--served-model-name", "tiny",
                          *ENGINE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "6 requests, 4 failed" in run.stdout
    results = [json.loads(text) for text in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["chat", "completion", "bad-value", "bad-url", "streamed", None]
    chat, completion = (r["response"]["body"]["choices"][0] for r in results[:2])
    assert chat["message"]["content"] == "hello there" and results[0]["error"] is None
    expected = LLM.from_engine(LLMEngine(EngineArgs(num_gpu_blocks_override=64, block_size=8, max_model_len=128,
                                                    enforce_eager=True), checkpoint=tiny_checkpoint))
    [output] = expected.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                 use_tqdm=False)
    assert completion["text"] == output.outputs[0].text
    for result, param in zip(results[2:], ["temperature", "url", "stream", None]):
        assert result["response"]["status_code"] == 400 and result["response"]["body"] is None
        assert result["error"]["param"] == param and result["error"]["type"] == "invalid_request_error"
